"""folio: an LLM inference and serving engine (paged KV cache, continuous batching, OpenAI-compatible server)."""

# before anything below imports torch, which loads OpenMP: how long its threads spin, and (as thread_count is
# imported) how many cores the process may use before OpenMP binds this thread; and before any oneDNN primitive
# is made, how many its caches keep
from folio import onednn_caches, openmp_wait, thread_count

openmp_wait.set_default_spin()
onednn_caches.bound_default_capacity()

from folio.config import EngineConfig
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from folio.entrypoints.llm import LLM
from folio.logger import configure_logging
from folio.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "PoolingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput", "Logprob", "OutputKind",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "__version__"]

configure_logging()
