"""EngineConfig: every option of the engine, grouped by the part of the engine it sets.

Each option is defined once, as a field of its group made with `option()`: its type, default, help text and
any command-line specifics. The `LLM(...)` keywords (`EngineConfig.from_kwargs`) and the `folio` flags
(folio.cli) are generated from these definitions, so an option added here needs nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

import torch

from folio.platforms import current_platform
from folio.spec_decode.config import SpeculativeConfig


def option(default: Any, help: str, default_means: Optional[str] = None, **cli: Any) -> Any:
    """A field that is an engine option. `help`, followed by `default_means` (words for a default whose value
    says little, such as None) or else the default itself, is the flag's help; `cli` holds argparse keywords
    that the field's type cannot say (choices, a parser of its own)."""
    return field(default=default, metadata={"help": help, "default_means": default_means, "cli": cli})


_MEMORY_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_memory_size(text: str) -> Union[int, float]:
    """'4GiB', '512M', '1000000' -> bytes; '0.3' -> a fraction of available memory."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 4GiB, 512MiB) or a fraction (e.g. 0.3), got {text!r}")
    number, unit = match.groups()
    if "." in number and not unit:
        return float(number)
    return int(float(number) * _MEMORY_UNITS[unit])


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATION_SCHEMES = ("int8", "w8a16", "int4", "int4-g128", "w4a8", "gguf", "none")  # folio.models.quantization
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # folio.attention.kv_quant


def is_gguf_file(model: Optional[str]) -> bool:
    """Whether a model option names a GGUF file (folio loads those and folders; None: the default model, a GGUF)."""
    return model is None or not os.path.isdir(os.path.expanduser(model))


@dataclass
class ModelOptions:
    """Which weights run, in which dtype, over how long a context, from which seed."""

    model: Optional[str] = option(None, "Hugging Face model folder or .gguf file",
                                  default_means="the embedded SmolLM2-135M-Instruct")
    dtype: Union[str, torch.dtype] = option(
        "auto", "auto, float32, bfloat16 or float16",
        default_means="auto = the platform's: on CPUs bfloat16 where the CPU has fast bf16, else float32")
    max_model_len: Optional[int] = option(None, "context length", default_means="the model's")
    seed: int = option(0, "random seed of the engine; when given, folio generate and chat also seed each "
                          "request with it")
    attention_backend: Optional[str] = option(
        None, "attention kernel: cpu_paged (C++, reads the paged cache in place) or torch_sdpa (reference)",
        default_means="$FOLIO_ATTENTION_BACKEND, else the fastest that builds here")
    quantization: Optional[str] = option(
        None, "low-precision weights, quantised as they load: int8 (per-channel, rotated, with dynamic per-token "
              "int8 activations), w8a16 (int8 per-channel, activations as 16-bit integers per token), int4 / int4-g128 (groups of 32 / 128, float "
              "activations; the lm_head in int8), w4a8 (int4 in groups of 32 and int8 activations per block of "
              "32); gguf: a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and MXFP4 layers as stored; none: every weight in dtype "
              "(a GGUF file's dequantised)",
        default_means="the checkpoint's: a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and MXFP4 layers as stored (as gguf), a "
                      "pre-quantised folder's quantised layers as stored, every other weight in dtype",
        choices=QUANTIZATION_SCHEMES)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, got {self.quantization!r}")
        self.torch_dtype  # validates dtype

    @property
    def gguf_as_stored(self) -> bool:
        """Whether a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / MXFP4 layers keep their blocks
        (folio.loader.gguf_native): with "gguf", and by default, as a pre-quantised folder's layers load as stored and as vLLM runs GGUF
        files (the default model is one); "none" and the schemes that quantise on the fly dequantise them."""
        return is_gguf_file(self.model) if self.quantization is None else self.quantization == "gguf"

    @property
    def weight_scheme(self) -> Optional[str]:
        """The scheme layers are quantised into as they load (folio.models.quantization), or None."""
        return None if self.quantization == "none" else self.quantization

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return current_platform().default_dtype()
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}") from None


@dataclass
class CacheOptions:
    """The paged KV cache: its unit, its budget and whether full blocks are shared between requests."""

    block_size: int = option(16, "tokens per KV cache block")
    # An int > 1 is bytes, a float in (0, 1] a fraction of the memory available at start.
    kv_cache_memory: Union[int, float, None] = option(
        None, "KV cache size: bytes (4GiB, 512MiB) or a fraction of available memory (0.3)",
        default_means="the smaller of 4 GiB and 40% of available memory (within a container's limit)",
        type=parse_memory_size)
    enable_prefix_caching: bool = option(True, "reuse the KV cache of earlier prompts' full blocks")
    kv_cache_dtype: str = option(
        "auto", "KV cache storage: auto (the model's dtype), int8 or fp8 (e4m3): 8-bit codes with a float32 scale "
                "per token and head, about half of bf16's bytes, so about twice the tokens fit",
        choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None and not (
                (isinstance(self.kv_cache_memory, float) and 0.0 < self.kv_cache_memory <= 1.0)
                or (isinstance(self.kv_cache_memory, int) and self.kv_cache_memory > 1)):
            raise ValueError("kv_cache_memory must be a byte count (int) or a fraction of free memory in (0, 1], "
                             f"got {self.kv_cache_memory!r}")


@dataclass
class SchedulerOptions:
    """How much work one step takes on, and in which order requests are admitted."""

    max_num_seqs: int = option(256, "most requests in a batch")
    max_num_batched_tokens: int = option(2048, "most tokens in one step (prefill chunks + decodes)")
    scheduling_policy: str = option("fcfs", "order of admission: fcfs, or priority (lower first)",
                                    choices=SCHEDULING_POLICIES)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")  # folio.executor


@dataclass
class ParallelOptions:
    """How many cores the engine's steps use, and over how many processes a model's layers are split."""

    num_threads: Optional[int] = option(None, "torch intra-op threads (of each worker, with tensor parallelism)",
                                        default_means="OMP_NUM_THREADS, else the cores this process may use, within "
                                                      "its cgroup's CPU quota (shared out among the workers)")
    tensor_parallel_size: int = option(1, "processes that each hold a slice of every layer (attention heads, MLP "
                                          "columns) and run steps together over torch.distributed")
    distributed_executor_backend: Optional[str] = option(
        None, "where the model runs: uni (in the engine's process), mp (one worker process per rank) or ray (one Ray "
              "actor per rank, on this machine)",
        default_means="uni for one rank, mp for several", choices=EXECUTOR_BACKENDS)

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.tensor_parallel_size == 1 else "mp"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank in the engine's process; "
                             f"tensor_parallel_size {self.tensor_parallel_size} needs 'mp' or 'ray'")


STRUCTURED_OUTPUTS_BACKENDS = ("llguidance",)
REASONING_PARSER_NAMES = ("deepseek_r1", "glm45", "mistral", "openai_gptoss", "qwen3")  # folio.reasoning_parser


@dataclass
class StructuredOutputsOptions:
    """How constrained outputs (JSON schema, regex, choice, grammar) are enforced, and where a reasoning model's
    thinking ends: the constraint applies to the answer after it (as vLLM's structured outputs config has it)."""

    structured_outputs_backend: str = option("llguidance", "grammar library that builds the token masks",
                                             choices=STRUCTURED_OUTPUTS_BACKENDS)
    reasoning_parser: Optional[str] = option(
        None, "the reasoning model family: its think block becomes the server's reasoning (chat's `reasoning`, "
              "a Responses reasoning item), and structured outputs and tool grammars start after it",
        default_means="none: all output is content", choices=REASONING_PARSER_NAMES)

    def __post_init__(self) -> None:
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                             f"got {self.structured_outputs_backend!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)}, "
                             f"got {self.reasoning_parser!r}")


@dataclass
class SpeculativeOptions:
    """Speculative decoding (folio.spec_decode): off unless configured."""

    speculative_config: Optional[SpeculativeConfig] = option(
        None, 'speculative decoding as JSON, vLLM\'s shape: {"method": "ngram" | "suffix" | "draft_model", '
              '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, "model": PATH, ...}',
        default_means="off", type=SpeculativeConfig.parse)

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


@dataclass
class EngineConfig:
    """The engine's options, one group per part of the engine. A new group (speculative decoding, structured
    output) is one more field here; its options then become keywords and flags with no further code."""

    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    structured_outputs: StructuredOutputsOptions = field(default_factory=StructuredOutputsOptions)

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_parallel_size
        if tp > 1 and self.model.gguf_as_stored:
            raise ValueError(f"tensor_parallel_size {tp} splits dequantised or float weights; a GGUF file's layers "
                             f"as stored are not split: pass quantization 'none' (or a scheme that quantises as "
                             f"it loads, such as int8)")
        spec = self.speculative.speculative_config
        if tp > 1 and spec is not None and spec.method == "draft_model":
            raise ValueError(f"speculative_config: method 'draft_model' is not supported with tensor_parallel_size "
                             f"{tp}; 'ngram' and 'suffix' are")

    @classmethod
    def from_kwargs(cls, **options: Any) -> EngineConfig:
        """The config from flat option names (the keywords of LLM and LLMEngine.from_kwargs, the CLI flags):
        each goes to the group that defines it; the rest keep their defaults."""
        unknown = sorted(options.keys() - _GROUP_OF.keys())
        if unknown:
            raise TypeError(f"unexpected engine option(s): {', '.join(unknown)}")
        grouped: dict[str, dict[str, Any]] = {group.name: {} for group in dataclasses.fields(cls)}
        for name, value in options.items():
            grouped[_GROUP_OF[name]][name] = value
        return cls(**{group.name: group.default_factory(**grouped[group.name]) for group in dataclasses.fields(cls)})


def engine_options() -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """Every engine option, in definition order, as (the EngineConfig field of its group, its field, its type)."""
    for group in dataclasses.fields(EngineConfig):
        types = typing.get_type_hints(group.default_factory)
        for f in dataclasses.fields(group.default_factory):
            yield group.name, f, types[f.name]


def _group_of_options() -> dict[str, str]:
    """Option name -> its group. Flat keywords and flags need each name to belong to one group only."""
    group_of: dict[str, str] = {}
    for group, f, _ in engine_options():
        assert f.name not in group_of, f"engine option {f.name!r} is in both {group_of[f.name]} and {group}"
        group_of[f.name] = group
    return group_of


_GROUP_OF = _group_of_options()
