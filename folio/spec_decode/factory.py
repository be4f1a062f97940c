"""The speculator a SpeculativeConfig asks for."""

from __future__ import annotations

from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.ngram import NgramProposer
from folio.spec_decode.proposer import Proposer
from folio.spec_decode.speculator import Speculator
from folio.spec_decode.suffix import SuffixProposer


def make_speculator(config: SpeculativeConfig, max_model_len: int) -> Speculator:
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "suffix":
        proposer = SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.suffix_cache_requests)
    else:
        raise ValueError(f"speculative_config.method {config.method!r} is not available yet")
    return Speculator(config, proposer, max_model_len)
