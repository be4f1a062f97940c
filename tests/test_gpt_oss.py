"""GPT-OSS: greedy outputs and logprobs equal Transformers' (float32) on a tiny random model, with chunked prefill and
preemption forced, from a float checkpoint, from one whose experts are MXFP4 (quantised here; folio runs them on its
MXFP4 kernel, Transformers dequantises them: Mxfp4Config(dequantize=True)), and from llama.cpp's GGUF file with
MXFP4 experts (kept as MXFP4, repacked from ggml's blocks, and dequantised at load).

The tiny model's biases (q/k/v, o_proj, the experts' gate/up and down) and attention sinks are drawn at random (its
init leaves most of them zero), large enough that each matters; the clamped SwiGLU's limit (0.5) is one the gates and
ups pass often. Each of swiglu_limit, swiglu_alpha, the sinks and the sliding window must change folio's logprobs
when changed in folio's copy alone, or the match with Transformers would not show that folio applies it.
"""

from __future__ import annotations

import copy
import json
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from conftest import build_tiny_model, hf_greedy_logprobs
from folio import LLM, SamplingParams
from folio.loader.model_loader import load_model
from folio.models import fused_moe, mxfp4, mxfp4_linear
from folio.models.dense_linear import DenseLinearMethod
from folio.models.experts_method import ClampedSwiGLU, PerExpertMethod
from folio.models.gpt_oss import SWIGLU_LIMIT, GptOssMoeBlock
from folio.models.linear import bind_linear_methods, process_weights_after_loading
from folio.loader.gguf_loader import stop_token_ids
from folio.models.model_config import ModelConfig
from greedy_match import assert_greedy_matches, greedy_logprobs
from test_gguf_models import _add, add_byte_level_tokenizer, write_out
from test_tensor_parallel import GREEDY, _assert_same, _run

Q = gguf.GGMLQuantizationType

KV_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, kv heads, head_dim, fp32 bytes, block_size
PROMPTS = [list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301]]
MAX_TOKENS = 24
RANDOM_TENSORS = ("_proj.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias", "self_attn.sinks")


def rewrite(folder, change) -> None:
    """The folder's checkpoint with change(tensors) applied (in place on the dict)."""
    tensors = load_file(f"{folder}/model.safetensors")
    change(tensors)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})


def edit_config(folder, **fields) -> None:
    cfg = json.load(open(f"{folder}/config.json"))
    cfg.update(fields)
    json.dump(cfg, open(f"{folder}/config.json", "w"))


def build_gpt_oss(folder: str, **overrides) -> str:
    """The tiny model (conftest's), its biases and sinks drawn at random."""
    build_tiny_model(folder, "gpt_oss", **overrides)
    g = torch.Generator().manual_seed(1)

    def randomize(tensors):
        for name, tensor in tensors.items():
            if name.endswith(RANDOM_TENSORS):
                tensors[name] = torch.randn(tensor.shape, generator=g) * (2.0 if name.endswith("sinks") else 0.5)

    rewrite(folder, randomize)
    return folder


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    return build_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")))


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8 [..., rows, cols / 32]): each
    block of 32 scaled by the power of two that brings its largest |value| to at most 6, each value rounded to the
    nearest FP4 one, two codes a byte, the even column's in the low nibble."""
    groups = w.float().unflatten(-1, (-1, mxfp4.BLOCK))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126) / 6.0))
    codes = ((groups / 2 ** exponent).unsqueeze(-1) - torch.tensor(mxfp4.FP4_VALUES)).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exponent.squeeze(-1) + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_dir(gpt_oss_dir, tmp_path_factory) -> str:
    """The model with its experts' weights in MXFP4, as the official checkpoints store them."""
    folder = shutil.copytree(gpt_oss_dir, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "model")

    def quantize(tensors):
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = to_mxfp4(tensors.pop(name).transpose(1, 2))

    rewrite(folder, quantize)
    edit_config(folder, quantization_config={"quant_method": "mxfp4"})
    return str(folder)


@pytest.fixture(scope="module")
def expected(gpt_oss_dir) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy_logprobs(gpt_oss_dir, p, MAX_TOKENS) for p in PROMPTS]


def assert_logprobs_match(folder: str, expected) -> None:
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(greedy_logprobs(folder, PROMPTS, MAX_TOKENS), expected):
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_greedy_matches_transformers(gpt_oss_dir):
    assert_greedy_matches(gpt_oss_dir, KV_BLOCK)


def test_logprobs_match_transformers(gpt_oss_dir, expected):
    assert_logprobs_match(gpt_oss_dir, expected)


def test_mxfp4_experts_match_transformers(mxfp4_dir, expected):
    # Transformers dequantises on CPU (Mxfp4Config(dequantize=True)); rounding to FP4 moves the logprobs
    hf_mxfp4 = hf_greedy_logprobs(mxfp4_dir, PROMPTS[0], 8)
    assert hf_mxfp4[1][:4] != pytest.approx(expected[0][1][:4], abs=1e-3)
    [(tokens, logprobs)] = greedy_logprobs(mxfp4_dir, PROMPTS[:1], 8)
    assert tokens == hf_mxfp4[0] and logprobs == pytest.approx(hf_mxfp4[1], abs=1e-4)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_experts_quantised_as_they_load(gpt_oss_dir, scheme):
    """quantization="int8" / "int4" takes the biased experts too (one by one, through their linear method): the first
    token's logprob near float32's, as those schemes' are on other models, and not float32's own."""
    llm = LLM(gpt_oss_dir, dtype="float32", quantization=scheme, kv_cache_memory=1 << 22)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert any(type(m).__name__ != "DenseLinearMethod" for m in
               (layer.method for layer in llm.llm_engine.runner.model.layers[0].mlp.experts[0].children()))
    llm.llm_engine.shutdown()
    float_logprob = hf_greedy_logprobs(gpt_oss_dir, PROMPTS[0], 1)[1][0]
    assert 1e-5 < abs(out.logprobs[0][out.token_ids[0]].logprob - float_logprob) < 0.5


@pytest.mark.parametrize("change", ["swiglu_limit", "swiglu_alpha", "sinks", "sliding_window"])
def test_each_feature_matters(gpt_oss_dir, expected, change, tmp_path):
    folder = shutil.copytree(gpt_oss_dir, tmp_path / change)
    if change == "sinks":  # sinks far below every score: as if there were none
        rewrite(folder, lambda t: t.update({n: torch.full_like(x, -1e4) for n, x in t.items() if n.endswith("sinks")}))
    elif change == "sliding_window":
        edit_config(folder, layer_types=["full_attention"] * 2)
    else:
        edit_config(folder, **{change: 100.0})
    for (_, logprobs), (_, hf_logprobs) in zip(greedy_logprobs(str(folder), PROMPTS, 4), expected):
        assert logprobs != pytest.approx(hf_logprobs[:4], abs=1e-3)


def test_fused_experts_equal_the_per_expert_path():
    """The clamped SwiGLU experts with biases, fused (the kernel's own tiles, and ATen's GEMMs from one row) and one
    by one: the model's match above runs the fused tiles."""
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["GptOssForCausalLM"], "vocab_size": 32, "hidden_size": 72, "intermediate_size": 40,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": 5, "num_experts_per_tok": 2,
        "swiglu_limit": 1.5})
    block = GptOssMoeBlock(cfg)
    bind_linear_methods(block, DenseLinearMethod())
    g = torch.Generator().manual_seed(0)
    for param in block.parameters():
        param.data.copy_(torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5 * 3)
    fused = copy.deepcopy(block)
    process_weights_after_loading(fused)
    assert isinstance(block.experts.method, PerExpertMethod)
    assert isinstance(fused.experts.method, fused_moe.FusedExpertsMethod) and fused.experts.b13.shape == (5, 80)
    x = torch.randn(50, 72, generator=g)
    with torch.no_grad():
        want = block(x)
        for gemm_min_rows in (1 << 30, 1):
            fused.experts.method.gemm_min_rows = gemm_min_rows
            torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)
        gate_up = block.experts[0].gate_up_proj(x)
        assert (gate_up.abs() > 1.5).float().mean() > 0.2  # the clamps change many values


def test_clamped_swiglu_is_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = GptOssExperts(GptOssConfig(num_local_experts=1, hidden_size=8, intermediate_size=8, swiglu_limit=1.5,
                                    swiglu_alpha=1.3))
    gate_up = torch.randn(10, 64) * 3
    want = hf._apply_gate(gate_up)
    got = ClampedSwiGLU(alpha=1.3, limit=1.5)(gate_up[:, ::2], gate_up[:, 1::2])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="swiglu_limit must be positive, got 0.0"):
        ClampedSwiGLU(alpha=1.0, limit=0.0)


def test_mxfp4_values():
    # blocks of codes 0..15 (low nibble first) under scales 2^-1 and 2^3
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = torch.stack([codes[0::2] | (codes[1::2] << 4)] * 2).view(1, 2, 8).repeat(1, 1, 2)
    scales = torch.tensor([[126, 130]], dtype=torch.uint8)
    values = torch.tensor(mxfp4.FP4_VALUES * 2)
    assert torch.equal(mxfp4.dequantize(blocks, scales), torch.cat([values / 2, values * 8])[None].bfloat16())
    with pytest.raises(ValueError, match="expected uint8 both"):
        mxfp4.dequantize(blocks.int(), scales)
    with pytest.raises(ValueError, match="expected"):
        mxfp4.dequantize(blocks[..., :4], scales)


def test_two_ranks_give_one_ranks_greedy_tokens(gpt_oss_dir):
    """Each rank keeps its heads' sinks and its columns of every expert (biases on the down projections added once)."""
    _assert_same(_run(gpt_oss_dir, GREEDY, 1), _run(gpt_oss_dir, GREEDY, 2))


def test_layer_types_default_to_transformers(gpt_oss_dir):
    # GptOssConfig without layer_types: the even layers slide
    cfg = json.load(open(f"{gpt_oss_dir}/config.json"))
    del cfg["layer_types"]
    assert ModelConfig.from_hf_dict(cfg).sliding_windows == (8, None)


def gpt_oss_to_gguf(folder: str, path: str) -> str:
    """The model as llama.cpp's converter writes it (its GptOssModel): gate_up's even and odd rows as ffn_gate_exps
    and ffn_up_exps, their biases likewise, the experts [E, out, in] in MXFP4, the rest in float32, the sinks as
    attn_sinks.weight, the router as ffn_gate_inp; YaRN and the window as keys (the SwiGLU clamp is hard-coded)."""
    cfg = json.load(open(f"{folder}/config.json"))
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    add_byte_level_tokenizer(w)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
    for name, t in load_file(f"{folder}/model.safetensors").items():
        t = t.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            _add(w, {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name], t, Q.F32)
            continue
        layer, part = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if part == "self_attn.sinks":
            _add(w, f"blk.{layer}.attn_sinks.weight", t, Q.F32)
        elif part == "mlp.experts.gate_up_proj":
            t = t.transpose(0, 2, 1)
            _add(w, f"blk.{layer}.ffn_gate_exps.weight", t[:, 0::2], Q.MXFP4)
            _add(w, f"blk.{layer}.ffn_up_exps.weight", t[:, 1::2], Q.MXFP4)
        elif part == "mlp.experts.gate_up_proj_bias":
            _add(w, f"blk.{layer}.ffn_gate_exps.bias", t[:, 0::2], Q.F32)
            _add(w, f"blk.{layer}.ffn_up_exps.bias", t[:, 1::2], Q.F32)
        elif part == "mlp.experts.down_proj":
            _add(w, f"blk.{layer}.ffn_down_exps.weight", t.transpose(0, 2, 1), Q.MXFP4)
        elif part == "mlp.experts.down_proj_bias":
            _add(w, f"blk.{layer}.ffn_down_exps.bias", t, Q.F32)
        else:
            module, suffix = part.rsplit(".", 1)
            _add(w, f"blk.{layer}.{names[module]}.{suffix}", t, Q.F32)
    write_out(w)
    return path


@pytest.fixture(scope="module")
def gguf_and_rounded(tmp_path_factory) -> tuple[str, str]:
    """llama.cpp's GGUF file of the tiny model with MXFP4 experts, the clamp at its default (GGUF files do not store
    it), and the Hugging Face folder whose experts hold the MXFP4-rounded values (ggml's own rounding)."""
    tmp_path = tmp_path_factory.mktemp("gpt_oss_gguf")
    folder = build_gpt_oss(str(tmp_path / "hf"), swiglu_limit=SWIGLU_LIMIT)
    path = gpt_oss_to_gguf(folder, str(tmp_path / "gpt-oss.gguf"))

    def rounded(t: torch.Tensor) -> torch.Tensor:  # along the rows llama.cpp quantises: [E, out, in]
        rows = t.transpose(1, 2).float().numpy()
        return torch.from_numpy(dequantize(quantize(rows, Q.MXFP4), Q.MXFP4)).transpose(1, 2).contiguous()

    rewrite(folder, lambda t: t.update({n: rounded(x) for n, x in t.items()
                                        if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}))
    return path, folder


@pytest.mark.usefixtures("isolated_gguf_cache")
def test_gguf_with_mxfp4_experts_matches_transformers(gguf_and_rounded, monkeypatch):
    """The GGUF file as it runs by default (its experts on the MXFP4 method where the kernel builds) gives
    Transformers' tokens and logprobs on the rounded folder, and so does its load dequantised (as where the kernel
    does not build)."""
    path, folder = gguf_and_rounded
    expected = [hf_greedy_logprobs(folder, p, 12) for p in PROMPTS]
    as_stored = greedy_logprobs(path, PROMPTS, 12)
    monkeypatch.setattr(mxfp4_linear, "available", lambda: False)
    for got in (as_stored, greedy_logprobs(path, PROMPTS, 12)):
        for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(got, expected):
            assert tokens == hf_tokens
            assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


@pytest.mark.skipif(not mxfp4_linear.available(), reason="the MXFP4 kernel does not build here")
@pytest.mark.usefixtures("isolated_gguf_cache")
def test_gguf_mxfp4_experts_keep_the_file_s_blocks(gguf_and_rounded):
    """Run as stored, and read back from the conversion's cache, every expert layer is on the MXFP4 method with the
    file's scale bytes and its codes repacked: they dequantise to gguf's own values. The other layers (float32 in
    the file) stay dense, and the experts run one by one."""
    path, _ = gguf_and_rounded
    stored = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
    for _ in ("converted", "cached"):
        model = load_model(path, torch.float32, 64, gguf_native=True).model
        assert isinstance(model.layers[0].self_attn.qkv_proj.method, DenseLinearMethod)
        for i, layer in enumerate(model.layers):
            assert isinstance(layer.mlp.experts.method, PerExpertMethod)
            for e, expert in enumerate(layer.mlp.experts):
                for linear, parts in ((expert.gate_up_proj, ("gate", "up")), (expert.down_proj, ("down",))):
                    assert isinstance(linear.method, mxfp4_linear.Mxfp4LinearMethod)
                    rows = np.concatenate([stored[f"blk.{i}.ffn_{part}_exps.weight"][e] for part in parts])
                    scales = rows.reshape(rows.shape[0], -1, 1 + mxfp4.BLOCK // 2)[..., 0]
                    assert torch.equal(linear.weight_scale, torch.from_numpy(scales))
                    assert torch.equal(mxfp4.dequantize(linear.weight, linear.weight_scale).float(),
                                       torch.from_numpy(dequantize(rows, Q.MXFP4)))


def test_gguf_stops_at_both_harmony_ends():
    """llama.cpp's converter stores <|return|> as EOS; its vocabulary ends generation at <|call|> too, by name."""
    tokens = ["a", "<|return|>", "b", "<|call|>", "<|end|>"]
    assert stop_token_ids("gpt-oss", tokens, 1, None, None) == [1, 3]
    assert stop_token_ids("llama", tokens, 1, 4, None) == [1, 4]  # (other models: the file's ids only)
