"""Linear layers compute through a pluggable method, load fused checkpoint shards by shard id, and the
rotary tables are float32 buffers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from folio import LLM, SamplingParams
from folio.loader.model_loader import load_model
from folio.models import dense_linear, fused_ops, small_batch_gemm
from folio.models.dense_linear import DenseLinearMethod
from folio.models.onednn_layout import can_prepack
from folio.models.linear import Linear, LinearMethod, bind_linear_methods
from folio.platforms import current_platform

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61)), [300] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


class ReferenceLinearMethod(LinearMethod):
    """A second method: F.linear on an unpacked copy of the loaded weight, in any dtype."""

    def __init__(self) -> None:
        self.bound: list[Linear] = []
        self.calls = 0

    def create_weights(self, layer: Linear) -> None:
        if not layer.tied:
            layer.weight = layer.row_parameter(layer.input_size)
        layer.bias = layer.row_parameter() if layer.with_bias else None
        self.bound.append(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.reference_weight = layer.weight.detach().clone()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.linear(x, layer.reference_weight, layer.bias)


def _greedy(folder: str, dtype: str) -> list[list[int]]:
    llm = LLM(folder, dtype=dtype, kv_cache_memory=1 << 22)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_a_plugged_in_method_generates_what_the_dense_one_does(tiny_model_factory, monkeypatch, dtype, arch, tie):
    # the small-batch kernel rounds bf16 sums its own way (within one step: test_small_batch_gemm); oneDNN's
    # packed matmul equals F.linear bit for bit, so with the kernel off the two methods must agree exactly
    monkeypatch.setattr(small_batch_gemm, "available", lambda dtype=None: False)
    folder = tiny_model_factory(arch, tie)
    dense = _greedy(folder, dtype)
    reference = ReferenceLinearMethod()
    monkeypatch.setattr(type(current_platform()), "linear_method", lambda self, model, quantization=None: reference)
    assert _greedy(folder, dtype) == dense
    assert len(reference.bound) == 2 * 4 + 1 and reference.calls > 0  # qkv, o, gate_up, down per layer; lm_head
    assert all(layer.method is reference for layer in reference.bound)


def test_a_chooser_picks_a_method_per_layer_by_name(llama_dir):
    reference = ReferenceLinearMethod()
    dense = DenseLinearMethod()
    net = load_model(llama_dir, torch.float32, 64,
                     linear_method=lambda model: lambda name, layer: reference if name == "lm_head" else dense).model
    assert reference.bound == [net.lm_head]
    others = [layer for layer in net.modules() if isinstance(layer, Linear) and layer is not net.lm_head]
    assert len(others) == 8 and all(layer.method is dense for layer in others)


def _bound_fused_layer() -> Linear:
    layer = Linear(4, {"q": 3, "k": 2, "v": 2}, bias=True, params_dtype=torch.float32)
    bind_linear_methods(layer, DenseLinearMethod())
    return layer


def test_fused_layer_loads_each_shard_into_its_rows():
    layer = _bound_fused_layer()
    weights = {s: torch.randn(rows, 4) for s, rows in (("v", 2), ("q", 3), ("k", 2))}  # any order
    biases = {s: torch.randn(w.shape[0]) for s, w in weights.items()}
    for s in weights:
        layer.weight.weight_loader(layer.weight, weights[s], s)
        layer.bias.weight_loader(layer.bias, biases[s], s)
    weight, bias = torch.cat([weights[s] for s in "qkv"]), torch.cat([biases[s] for s in "qkv"])
    assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)
    x = torch.randn(5, 4)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    with pytest.raises(ValueError, match=r"has shape \(3, 4\), expected \(2, 4\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(3, 4), "k")
    with pytest.raises(ValueError, match="shard 'x' of a layer whose shards are \\['q', 'k', 'v'\\]"):
        layer.weight.weight_loader(layer.weight, torch.randn(2, 4), "x")


def test_linear_declarations_are_checked():
    with pytest.raises(ValueError, match="positive"):
        Linear(4, {0: 3, 1: 0})
    with pytest.raises(ValueError, match=r"needs a weight of shape \(8, 4\)"):
        Linear(4, 8, tied_to=torch.nn.Parameter(torch.empty(8, 5)))
    with pytest.raises(ValueError, match="already bound to DenseLinearMethod"):
        bind_linear_methods(_bound_fused_layer(), DenseLinearMethod())
    for sizes in (8, {0: 4, 1: 3}, {0: 4, 1: 4, 2: 4}):
        with pytest.raises(ValueError, match="two shards of one size"):
            Linear(4, sizes, silu_and_mul=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_silu_and_mul_layer_returns_silu_of_its_gates_times_its_ups(dtype):
    """A method that does not fuse the op (here the dense one) applies it to its product."""
    layer = Linear(16, {0: 8, 1: 8}, params_dtype=dtype, silu_and_mul=True)
    bind_linear_methods(layer, DenseLinearMethod())
    weights = [torch.randn(8, 16).to(dtype) for _ in range(2)]
    for shard, weight in enumerate(weights):
        layer.weight.weight_loader(layer.weight, weight, shard)
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(3, 16).to(dtype)
    gate, up = layer.method.apply(layer, x).chunk(2, dim=-1)  # the product, gates first
    torch.testing.assert_close(gate, F.linear(x, weights[0]))
    assert torch.equal(layer(x), F.silu(gate) * up)
    assert layer(x.view(1, 3, 16)).shape == (1, 3, 8)


def _gate_up(weights: list[torch.Tensor], gated: bool, monkeypatch) -> Linear:
    """A bf16 SwiGLU gate/up on the dense method, in the gated layout where the method chooses it (gated) or
    never (the method's table lookup made to answer None)."""
    i, k = weights[0].shape
    layer = Linear(k, {0: i, 1: i}, params_dtype=torch.bfloat16, silu_and_mul=True)
    bind_linear_methods(layer, DenseLinearMethod())
    for shard, weight in enumerate(weights):
        layer.weight.weight_loader(layer.weight, weight, shard)
    with monkeypatch.context() as patch:
        if not gated:
            patch.setattr(dense_linear, "gated_silu_table", lambda layer: None)
        layer.method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("i,k", [(64, 64), (4864, 896), (96, 64)])
def test_a_gated_gate_up_gives_silu_and_mul_of_the_plain_product(i, k, monkeypatch):
    """Where the AMX tiles take its small batches, a bf16 gate/up of a multiple of 64 outputs (no bias) is packed
    in the gated layout: every batch size (the vector loop's, the tiles' epilogue, oneDNN's) gives the bits of
    the same layer packed plainly, through Linear and through the method's apply; elsewhere, and for 96 outputs,
    nothing changes."""
    if not can_prepack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear here")
    weights = [(torch.randn(i, k) * 0.1).to(torch.bfloat16) for _ in range(2)]
    gated, plain = _gate_up(weights, True, monkeypatch), _gate_up(weights, False, monkeypatch)
    expect_gated = i % 64 == 0 and small_batch_gemm.AMX_ROWS > 0 and fused_ops.has_bf16_silu_table()
    assert (gated.silu_table is not None) == expect_gated and plain.silu_table is None
    assert gated.weight is None  # one packed copy, as for any other layer
    for rows in (1, 8, 9, 40, 62, 64, 65, 300, 1100):  # 1100: oneDNN's in three pieces (SILU_PIECE_ROWS)
        x = (torch.randn(rows, k) * 2).to(torch.bfloat16)
        want = plain(x)
        assert want.shape == (rows, i) and torch.equal(gated(x).view(torch.int16), want.view(torch.int16))
        if expect_gated:  # the product asked for directly is SiLU-and-mul's too
            assert torch.equal(gated.method.apply(gated, x).view(torch.int16), want.view(torch.int16))
    x3 = torch.randn(2, 5, k).to(torch.bfloat16)
    assert torch.equal(gated(x3).view(torch.int16), plain(x3).view(torch.int16))


def test_a_gated_gate_ups_large_batches_go_to_onednn_in_pieces(monkeypatch):
    """Past SILU_PIECE_ROWS rows a gated gate/up's product is oneDNN's piece by piece, pieces of equal size, each
    piece's SiLU-and-mul written into its rows of the result: the bits of the layer packed plainly."""
    if not can_prepack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear here")
    weights = [(torch.randn(128, 64) * 0.1).to(torch.bfloat16) for _ in range(2)]
    gated, plain = _gate_up(weights, True, monkeypatch), _gate_up(weights, False, monkeypatch)
    if gated.silu_table is None:
        pytest.skip("no gated layout here (it goes with the AMX tiles)")
    pieces = []
    product = DenseLinearMethod.product
    monkeypatch.setattr(DenseLinearMethod, "product", lambda self, layer, x: pieces.append(x.shape[0]) or
                        product(self, layer, x))
    monkeypatch.setattr(dense_linear, "SILU_PIECE_ROWS", 100)
    for rows, expect in ((100, [100]), (101, [51, 50]), (300, [100, 100, 100]), (301, [76, 76, 76, 73])):
        pieces.clear()
        x = (torch.randn(rows, 64) * 2).to(torch.bfloat16)
        got = gated(x)
        assert pieces == expect
        assert torch.equal(got.view(torch.int16), plain(x).view(torch.int16))


@pytest.mark.parametrize("bf16_values", [False, True])  # on oneDNN's packed weight, or bf16 blocks (bf16_valued)
def test_a_float32_gate_ups_large_batches_go_in_pieces(bf16_values, monkeypatch):
    """Every gate/up, in plain order too, takes a batch past SILU_PIECE_ROWS piece by piece, each piece's
    SiLU-and-mul written into its rows of the result."""
    weights = [torch.randn(128, 64) for _ in range(2)]
    if bf16_values:
        weights = [w.to(torch.bfloat16).float() for w in weights]
    layer = Linear(64, {0: 128, 1: 128}, params_dtype=torch.float32, silu_and_mul=True)
    bind_linear_methods(layer, DenseLinearMethod())
    for shard, weight in enumerate(weights):
        layer.weight.weight_loader(layer.weight, weight, shard)
    layer.method.process_weights_after_loading(layer)
    if layer.small_batch_weight is None:
        pytest.skip("no float32 small-batch kernel here (or oneDNN's layout is not one it reads)")
    assert (layer.small_batch_weight.blocks.dtype == torch.bfloat16) == bf16_values  # or oneDNN's float32 blocks
    pieces = []
    product = DenseLinearMethod.product
    monkeypatch.setattr(DenseLinearMethod, "product", lambda self, layer, x: pieces.append(x.shape[0]) or
                        product(self, layer, x))
    monkeypatch.setattr(dense_linear, "SILU_PIECE_ROWS", 100)
    for rows, expect in ((100, [100]), (101, [51, 50]), (301, [76, 76, 76, 73])):
        pieces.clear()
        x = torch.randn(rows, 64)
        got = layer(x)
        assert pieces == expect
        torch.testing.assert_close(got, F.silu(x @ weights[0].T) * (x @ weights[1].T), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", [DenseLinearMethod, ReferenceLinearMethod])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_the_argmax_of_the_layers_output(method, dtype):
    """Every method answers Linear.argmax as torch.argmax of its own product, at every batch size (the dense
    bf16 method without writing the product where the AMX tiles take the batch)."""
    layer = Linear(64, 3000, bias=True, params_dtype=dtype)
    bind_linear_methods(layer, method())
    weight = torch.randn(3000, 64).to(dtype)
    weight[2999] = weight[1234]  # tied columns: the first one leads where they do
    layer.weight.data.copy_(weight)
    layer.bias.data.zero_()
    layer.method.process_weights_after_loading(layer)
    for rows in (1, 8, 9, 40, 64, 65):
        x = torch.randn(rows, 64).to(dtype)
        x[0] = weight[1234]
        tokens = layer.argmax(x)
        assert tokens.dtype == torch.int64 and torch.equal(tokens, torch.argmax(layer(x), dim=-1))
        assert tokens[0] == 1234


def _edited_copy(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
     r"lacks tensors for layers.1.self_attn.qkv_proj.weight \(shard 'k'\)$"),
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight"), r"layers.0.mlp.gate_up_proj.weight \(shard 1\)"),
    (lambda t: t.pop("model.norm.weight"), r"lacks tensors for norm.weight$"),
    (lambda t: t.update({"model.layers.0.self_attn.v_proj.weight": torch.zeros(16, 64)}),
     r"'model.layers.0.self_attn.v_proj.weight' has shape \(16, 64\), expected \(32, 64\)"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}), "has no place in LlamaForCausalLM"),
])
def test_checkpoint_errors_name_the_tensor(llama_dir, tmp_path, edit, message):
    folder = _edited_copy(llama_dir, str(tmp_path / "edited"), edit)
    with pytest.raises(ValueError, match=message):
        load_model(folder, torch.float32, 64)


def test_rotary_tables_are_float32_buffers_that_follow_device_moves(llama_dir):
    net = load_model(llama_dir, torch.bfloat16, 64).model
    rotary = net.layers[0].self_attn.rotary
    assert all(layer.self_attn.rotary is rotary for layer in net.layers)  # one table for the model
    buffers = dict(net.named_buffers())
    assert set(buffers) == {"layers.0.self_attn.rotary.cos", "layers.0.self_attn.rotary.sin"}
    assert all(b.dtype == torch.float32 and b.shape == (64, 16) for b in buffers.values())
    assert not any("rotary" in name for name in net.state_dict())  # computed, never loaded
    cos = rotary.cos.clone()
    rotary.to(torch.bfloat16)
    assert rotary.cos.dtype == torch.float32 and torch.equal(rotary.cos, cos)
    rotary.to("meta", torch.float16)
    assert rotary.cos.device.type == rotary.sin.device.type == "meta" and rotary.cos.dtype == torch.float32
