"""The speculator a SpeculativeConfig asks for, beside a model runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.draft_model import DraftModel, DraftModelProposer
from folio.spec_decode.ngram import NgramProposer
from folio.spec_decode.proposer import Proposer
from folio.spec_decode.speculator import Speculator
from folio.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from folio.worker.model_runner import ModelRunner


def make_speculator(config: SpeculativeConfig, runner: "ModelRunner", draft: Optional[DraftModel]) -> Speculator:
    """draft: the loaded draft model, for method draft_model (its KV cache sits beside the runner's)."""
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "suffix":
        proposer = SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.suffix_cache_requests)
    else:
        group = runner.kv_cache_spec.full_attention_group
        if group is None:
            raise ValueError("a draft model reads the block tables of a full-attention KV cache group, and every "
                             "group of this cache slides")
        proposer = DraftModelProposer(draft, runner.inputs, group, runner.backend, runner.num_blocks, runner.device)
    return Speculator(config, proposer, runner.inputs.max_model_len)
