"""Load a model for serving: a Hugging Face folder, a GGUF file, or (no model given) the embedded default.

Weights go straight into a model whose layers allocate without initialising, so loading costs one copy of
each tensor and no random init. The model is built with its linear layers' shapes only; a linear method
(by default the platform's) then creates their parameters, the checkpoint fills them, and the
method post-processes them (e.g. packs them for oneDNN).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open

from folio.distributed.parallel_state import tensor_parallel_group
from folio.loader.default_model import default_model_path
from folio.loader.gguf_loader import GGUFCheckpoint, load_gguf_cached, load_gguf_native_cached, read_gguf_cached
from folio.loader.gguf_native import native_chooser, native_layers
from folio.loader.weights import load_weights
from folio.memory import release_freed_memory
from folio.models.compressed_tensors import compressed_tensors_chooser
from folio.models.fp8_checkpoints import dequantized, fp8_config
from folio.models.hot_path import mirror_members
from folio.models.int4_checkpoints import int4_checkpoint_chooser, quantized_layers
from folio.models.linear import (LinearMethodChooser, LinearMethods, as_chooser, bind_linear_methods,
                                 process_weights_after_loading)
from folio.models.model_config import LANGUAGE_MODELS, ModelConfig
from folio.models.mxfp4_linear import mxfp4_chooser
from folio.models.registry import build_model, check_supported
from folio.platforms import current_platform
from folio.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    path: str
    config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _safetensors_files(folder: str) -> list[str]:
    index = _read_json(os.path.join(folder, "model.safetensors.index.json"))
    if index:
        names = sorted(set(index.get("weight_map", {}).values()))
    else:
        names = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not names:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return [os.path.join(folder, n) for n in names]


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor through a handle of its own: a handle maps its whole file, and the pages that reads touch
    stay resident until it closes, so one handle per file kept the whole checkpoint resident beside the
    loaded weights (the 0.5B Qwen2 in bf16 peaked at 2.24 GB for 1.31 GB loaded; 1.3 GB so). A tensor keeps
    only its own part of the mapping, released when it is freed; opening costs a header parse (0.2 s for 290
    tensors)."""
    for path in files:
        try:
            for name in _tensor_names([path]):
                with safe_open(path, framework="pt") as f:
                    tensor = f.get_tensor(name)
                yield name, tensor
        except FileNotFoundError:
            raise ValueError(f"weight file {path} is missing (named by the checkpoint index)") from None
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read weights from {path}: {e}") from e


def _tensor_names(files: list[str]) -> list[str]:
    names = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def _prequantized_chooser(quantization_config: dict, folder: str, model: torch.nn.Module,
                          otherwise: LinearMethodChooser) -> LinearMethodChooser:
    """The linear methods of a pre-quantised Hugging Face folder, by its quant_method: its quantised layers
    load as stored (repacked, for GPTQ and AWQ), the others with `otherwise`."""
    quant_method = quantization_config.get("quant_method")
    if quant_method == "mxfp4":  # GPT-OSS's experts, kept as MXFP4 or dequantised (folio.models.gpt_oss)
        return mxfp4_chooser(otherwise)
    if quant_method == "compressed-tensors":
        return compressed_tensors_chooser(quantization_config, otherwise)
    if quant_method in ("gptq", "awq"):
        layers = quantized_layers(_tensor_names(_safetensors_files(folder)), model.map_checkpoint_name)
        return int4_checkpoint_chooser(quantization_config, layers, otherwise)
    raise ValueError(f"quantization_config: quant_method {quant_method!r} is not supported; folio loads "
                     f"\"compressed-tensors\" (int8), \"gptq\" and \"awq\" (int4), \"mxfp4\" (GPT-OSS's "
                     f"experts), \"fp8\" (dequantised)")


def eos_token_ids(hf_config: dict, generation_config: dict, tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that end a request, worked out here only: the eos_token_id (an id or a list) of config.json
    and of generation_config.json, where instruct models list their end-of-turn ids (Llama 3's <|eot_id|>),
    and the tokenizer's eos_token."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    for cfg in (hf_config, generation_config):
        eos = cfg.get("eos_token_id")
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(ids)


def _parse_config(hf_config: dict) -> ModelConfig:
    check_supported(ModelConfig.architecture_of(hf_config))  # before parsing: name the architecture, not a field
    return ModelConfig.from_hf_dict(hf_config)


@dataclass
class ModelDescription:
    """What a model is, without its weights: enough to tokenize, size the KV cache and schedule (an engine whose
    workers load the weights in their own processes reads only this)."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]


def describe_model(model: Optional[str]) -> ModelDescription:
    """Config, tokenizer and end-of-sequence ids of a Hugging Face folder, a GGUF file or (None) the default
    model, read without touching the weights."""
    path = _model_path(model)
    return _describe_folder(path)[0] if os.path.isdir(path) else _describe_gguf(path, read_gguf_cached(path)[0])


def _model_path(model: Optional[str]) -> str:
    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist (folio loads local folders and .gguf files only)")
    return path


def _tying_the_file_shows(hf_config: dict, path: str) -> dict:
    """A multimodal config whose outer and language-model flags disagree on tying the lm_head (Transformers 5
    writes the outer one, true by default, beside the language model's false) ties it as the checkpoint was
    saved: tied where the file holds no lm_head of its own (a checkpoint re-saved with its own lm_head stays
    untied whatever the outer flag says)."""
    inner = hf_config.get("text_config") or {}
    outer = hf_config.get("tie_word_embeddings")
    if ModelConfig.architecture_of(hf_config) not in LANGUAGE_MODELS or outer is None or \
            inner.get("tie_word_embeddings", outer) == outer:
        return hf_config
    names = _tensor_names(_safetensors_files(path))
    return {**hf_config, "tie_word_embeddings": not any(name.endswith("lm_head.weight") for name in names)}


def _describe_folder(path: str) -> tuple[ModelDescription, dict]:
    """A Hugging Face folder's description, and its config.json."""
    hf_config = _read_json(os.path.join(path, "config.json"))
    if not hf_config:
        raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
    hf_config = _tying_the_file_shows(hf_config, path)
    cfg = _parse_config(hf_config)
    tokenizer = Tokenizer.from_dir(path)
    generation_config = _read_json(os.path.join(path, "generation_config.json"))
    return ModelDescription(path, cfg, tokenizer, eos_token_ids(hf_config, generation_config, tokenizer)), hf_config


def _describe_gguf(path: str, checkpoint: GGUFCheckpoint) -> ModelDescription:
    tokenizer = Tokenizer.from_parts(checkpoint.tokenizer_json, checkpoint.tokenizer_config)
    return ModelDescription(path, _parse_config(checkpoint.hf_config), tokenizer,
                            eos_token_ids(checkpoint.hf_config, checkpoint.generation_config, tokenizer))


def load_model(model: Optional[str], dtype: torch.dtype, max_positions_cap: Optional[int],
               linear_method: Optional[Callable[[torch.nn.Module], LinearMethods]] = None,
               device: torch.device = torch.device("cpu"), gguf_native: bool = False) -> LoadedModel:
    """Load weights, config and tokenizer. `max_positions_cap` bounds the RoPE table (the engine's max_model_len).
    In a tensor-parallel group (folio.distributed) the model is this rank's slice; `config` stays the whole
    model's.

    linear_method: gives the built (not yet loaded) model its linear method, or a chooser of one per layer
    (see folio.models.linear); a function of the model because a method may size itself by the model, as
    the dense one does. None: the current platform's (folio.platforms). device: where the weights live.
    gguf_native: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / MXFP4 linear layers keep their blocks and run on the
    int8 / int4 / MXFP4 kernels (folio.loader.gguf_native); its other tensors are dequantised. A Hugging Face folder
    whose config.json has a quantization_config (compressed-tensors int8, folio.models.compressed_tensors;
    GPTQ or AWQ int4, folio.models.int4_checkpoints) loads its quantised layers as stored; an FP8 one
    (folio.models.fp8_checkpoints) is dequantised as it streams in and loads as a float folder does.
    """
    path = _model_path(model)
    if gguf_native and os.path.isdir(path):
        raise ValueError(f"quantization 'gguf' needs a .gguf model file, got the folder {path}")
    if os.path.isdir(path):
        described, hf_config = _describe_folder(path)
        tensors: Iterator[tuple[str, torch.Tensor]] = _iter_safetensors(_safetensors_files(path))
        fp8 = fp8_config(hf_config.get("quantization_config"))
        if fp8 is not None:  # float tensors from here on: no layer loads as stored, and ranks split them
            tensors = dequantized(tensors, fp8, dtype)
            hf_config = {key: value for key, value in hf_config.items() if key != "quantization_config"}
    else:
        if gguf_native:
            checkpoint, types = read_gguf_cached(path)
        else:
            checkpoint, state = load_gguf_cached(path, dtype)
            tensors = iter(state.items())
        described, hf_config = _describe_gguf(path, checkpoint), checkpoint.hf_config
    cfg = described.config

    max_positions = cfg.max_context if max_positions_cap is None else max_positions_cap
    ranks = tensor_parallel_group().size
    if ranks > 1 and "quantization_config" in hf_config:
        raise ValueError(f"tensor_parallel_size {ranks}: pre-quantised checkpoints are not split across ranks")
    with _default_dtype(dtype), device:
        net = build_model(cfg.for_tensor_parallel(ranks), max_positions)  # this rank's slice of each layer
        methods = (linear_method or current_platform().linear_method)(net)
        if "quantization_config" in hf_config:  # pre-quantised: its layers load as stored, the rest as asked
            methods = _prequantized_chooser(hf_config["quantization_config"], path, net, as_chooser(methods))
        if gguf_native:
            layers, quantized_tensors = native_layers(types, net)
            methods = native_chooser(layers, as_chooser(methods))
            tensors = iter(load_gguf_native_cached(path, dtype, checkpoint, types, quantized_tensors).items())
        bind_linear_methods(net, methods)
    load_weights(net, tensors)
    process_weights_after_loading(net)
    release_freed_memory()  # the weights' load-time forms, freed as they were processed
    net.eval()
    mirror_members(net)  # the weights are final: the hot path reads its layers' members as plain attributes
    return LoadedModel(path, cfg, net, described.tokenizer, described.eos_token_ids)
