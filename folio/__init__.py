"""folio: an LLM inference and serving engine (paged KV cache, continuous batching, OpenAI-compatible server)."""

import logging as _logging

from folio.config import EngineConfig
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.entrypoints.llm import LLM
from folio.outputs import CompletionOutput, Logprob, RequestOutput
from folio.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "OutputKind", "__version__"]

_logging.getLogger("folio").addHandler(_logging.NullHandler())
