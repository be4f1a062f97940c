"""quantization="gguf" (the default for a GGUF file): Q8_0, Q4_0, Q4_1 and Q4_K linear layers converted exactly into the int8 / int4 formats
and run on their kernels; the same model dequantised gives the same logprobs up to float32 summation order (and
the float32 int4 block kernel's 16-bit codes of x)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from conftest import runs_float32_int16_codes
from folio import LLM, SamplingParams
from folio.loader.gguf_loader import read_gguf_cached
from folio.loader.gguf_native import FORMAT_OF, GGUFBlocks
from folio.models import quant_kernels
from folio.models import quant_reference as ref
from test_gguf_loader import ARCHS, _quantize, write_tiny_gguf

pytestmark = [pytest.mark.skipif(not quant_kernels.available(), reason="needs the quantised linear kernel built"),
              pytest.mark.usefixtures("isolated_gguf_cache")]

PROMPT = [5, 6, 7, 8] + list(range(40, 70))


@pytest.mark.parametrize("qtype", list(FORMAT_OF), ids=lambda q: q.name)
def test_blocks_convert_to_exactly_the_dequantised_weight(qtype):
    blocks = _quantize(np.random.default_rng(int(qtype)), 12, 512, qtype)
    packed, scales, offsets = GGUFBlocks(qtype, blocks).convert()
    assert (offsets is None) == (FORMAT_OF[qtype] == "int8") and scales.shape == (12, 512 // 32)
    want = torch.from_numpy(dequantize(blocks, qtype))
    assert torch.equal(ref.dequantize(packed, scales, offsets), want)
    assert GGUFBlocks(qtype, blocks).shape == (12, 512) and GGUFBlocks(qtype, blocks)[2:5].shape == (3, 512)


def _methods(llm: LLM) -> set[str]:
    return {type(layer.method).__name__ for layer in llm.llm_engine.runner.model.modules() if hasattr(layer, "method")}


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([e[PROMPT[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])


@pytest.mark.parametrize("qtype", [*FORMAT_OF, None], ids=lambda q: q.name if q else "mixed")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_layers_give_the_dequantised_models_logprobs(tmp_path, arch, qtype):
    path = write_tiny_gguf(str(tmp_path / f"{arch}.gguf"), arch, tensor_type=qtype)  # None: types cycle
    native = LLM(path, dtype="float32", quantization="gguf", kv_cache_memory=1 << 22)
    methods = _methods(native)
    # a tied lm_head whose embedding is stored quantised gets an int8 copy of its own (per channel)
    tied_int8 = ARCHS[arch][2] and read_gguf_cached(path)[1]["model.embed_tokens.weight"] in FORMAT_OF
    assert ("GGUFInt8LinearMethod" in methods) == (qtype in (Q.Q8_0, None))
    assert ("GGUFInt4LinearMethod" in methods) == (qtype != Q.Q8_0)
    assert ("Int8LinearMethod" in methods) == tied_int8
    assert ("DenseLinearMethod" in methods) == (qtype is None or (ARCHS[arch][2] and not tied_int8))
    got = _prompt_logprobs(native)
    want = _prompt_logprobs(LLM(path, dtype="float32", quantization="none", kv_cache_memory=1 << 22))
    # exact conversions agree up to float32 summation order, int4 and int8 layers kept as float32 column blocks
    # (AVX2 CPUs without AVX-512) up to their kernels' 16-bit codes of x (measured within 2e-4 relative); the
    # requantised head within its int8 rounding (this random model's logprobs run to -1500)
    rtol = 1e-2 if tied_int8 else 1e-3 if runs_float32_int16_codes(native) else 1e-5
    assert torch.allclose(got, want, rtol=rtol, atol=1e-4)


def test_a_gguf_file_runs_its_quantised_layers_as_stored_unless_told_none(tmp_path):
    """By default, as with "gguf" (and as vLLM runs GGUF files); "none" dequantises every layer."""
    path = write_tiny_gguf(str(tmp_path / "llama.gguf"), "llama", tensor_type=Q.Q4_0)
    assert "GGUFInt4LinearMethod" in _methods(LLM(path, dtype="float32", kv_cache_memory=1 << 22))
    assert _methods(LLM(path, dtype="float32", quantization="none", kv_cache_memory=1 << 22)) == {"DenseLinearMethod"}


def test_none_keeps_a_folder_in_its_dtype(tiny_model_factory):
    assert _methods(LLM(tiny_model_factory("llama"), quantization="none", kv_cache_memory=1 << 22)) == \
        {"DenseLinearMethod"}


def test_gguf_quantization_needs_a_gguf_file(tiny_model_factory):
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model file"):
        LLM(tiny_model_factory("llama"), quantization="gguf")


def test_native_loads_are_cached_and_read_back_without_the_file(tmp_path, monkeypatch):
    """The metadata and the kept blocks come back from the cache, no GGUFReader open (seconds on a real
    vocabulary); another kept set is another entry."""
    from folio.loader import gguf_loader, gguf_metadata

    path = write_tiny_gguf(str(tmp_path / "llama.gguf"), "llama", tensor_type=None)  # types cycle
    checkpoint, types = gguf_loader.read_gguf_cached(path)
    kept = frozenset(name for name, t in types.items() if t in FORMAT_OF and "layers.0." in name)
    weights = gguf_loader.load_gguf_native_cached(path, torch.float32, checkpoint, types, kept)
    assert kept and {n for n, w in weights.items() if isinstance(w, GGUFBlocks)} == kept

    opened = []
    reader = gguf_metadata.GGUFReader
    monkeypatch.setattr(gguf_metadata, "GGUFReader", lambda p: opened.append(p) or reader(p))
    assert gguf_loader.read_gguf_cached(path) == (checkpoint, types)
    cached = gguf_loader.load_gguf_native_cached(path, torch.float32, checkpoint, types, kept)
    assert opened == [] and cached.keys() == weights.keys()
    for name, w in weights.items():
        if name in kept:
            assert cached[name].qtype == w.qtype and np.array_equal(cached[name].blocks, w.blocks)
        else:
            assert torch.equal(cached[name], w)
    gguf_loader.load_gguf_native_cached(path, torch.float32, checkpoint, types, frozenset())
    assert opened == [path]


def test_a_cached_native_model_gives_the_same_logprobs(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "qwen2.gguf"), "qwen2", tensor_type=Q.Q4_K)
    first = _prompt_logprobs(LLM(path, dtype="float32", kv_cache_memory=1 << 22))  # converts and caches
    assert torch.equal(_prompt_logprobs(LLM(path, dtype="float32", kv_cache_memory=1 << 22)), first)
