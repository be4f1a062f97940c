"""The fused MoE path (folio.models.fused_moe) against the per-expert path it replaces for unquantised experts:
same routing, same numbers (float32: to rounding, rtol/atol 1e-5; bf16: within 3e-2 of outputs of size ~1, and
on average no further from the float32 result than the per-expert path, give or take 25%), for odd shapes, experts without tokens, top-k
1/2/8, one token and a prefill, the kernel's own tiles and its ATen GEMM path, and Qwen2-MoE's shared expert;
float32 experts of bf16 values held in bf16 with the float32 results bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from folio.models import fused_moe
from folio.models.dense_linear import DenseLinearMethod
from folio.models.experts_method import PerExpertMethod
from folio.models.linear import bind_linear_methods, process_weights_after_loading
from folio.models.model_config import ModelConfig
from folio.models.moe import SparseMoeBlock

pytestmark = pytest.mark.skipif(fused_moe.KERNEL.load() is None, reason="the fused MoE kernel does not build here")

HIDDEN = 72  # not a multiple of AVX-512's 16 lanes: exercises the dot products' tails there (AVX2: sizes 13, 7...)


def make_blocks(num_experts: int, top_k: int, intermediate: int, dtype: torch.dtype, shared: int = 0,
                seed: int = 0, bf16_values: tuple[str, ...] = (), hidden: int = HIDDEN
                ) -> tuple[SparseMoeBlock, SparseMoeBlock]:
    """(per-expert block, fused block) with the same random weights; those whose names contain one of
    bf16_values hold bf16 values, as a bf16 checkpoint's do."""
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 32,
        "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": intermediate,
        "norm_topk_prob": True, "shared_expert_intermediate_size": shared})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        block = SparseMoeBlock(cfg, float_weights=False)
    finally:
        torch.set_default_dtype(previous)
    bind_linear_methods(block, DenseLinearMethod())
    g = torch.Generator().manual_seed(seed)
    for name, param in block.named_parameters():
        values = torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5
        param.data.copy_(values.to(torch.bfloat16) if any(part in name for part in bf16_values) else values)
    fused = copy.deepcopy(block)
    process_weights_after_loading(fused)
    assert isinstance(fused.experts.method, fused_moe.FusedExpertsMethod) and len(fused.experts) == 0
    assert isinstance(block.experts.method, PerExpertMethod)
    return block, fused


def routing(tokens: int, num_experts: int, top_k: int, skip: tuple[int, ...], seed: int = 1):
    """Random distinct experts per token, never those in skip (experts without tokens); float32 weights."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("gemm_min_rows", [1 << 30, 1], ids=["tiles", "aten-gemm"])
@pytest.mark.parametrize("tokens,num_experts,top_k,skip", [
    (1, 5, 2, ()), (200, 5, 2, (3,)), (1, 9, 8, ()), (200, 11, 8, (0, 10)), (200, 7, 1, (1, 2)), (37, 3, 1, ()),
])
def test_fused_equals_per_expert_float32(tokens, num_experts, top_k, skip, gemm_min_rows):
    per_expert, fused = make_blocks(num_experts, top_k, intermediate=40, dtype=torch.float32)
    fused.experts.method.gemm_min_rows = gemm_min_rows
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(tokens, num_experts, top_k, skip)
    with torch.no_grad():
        want = per_expert.experts(x, weights, ids)
        got = fused.experts(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fused.experts.w13.dtype == fused.experts.w2.dtype == torch.float32  # values bf16 cannot hold
    ran = torch.tensor([int(bool((ids == e).any())) for e in range(num_experts)])
    assert torch.equal(fused.experts.runs, ran) and torch.equal(per_expert.experts.runs, ran)


@pytest.mark.parametrize("gemm_min_rows", [1 << 30, 1], ids=["tiles", "aten-gemm"])
@pytest.mark.parametrize("hidden,intermediate", [(HIDDEN, 40), (13, 7), (25, 33)])  # and the dot products' tails
@pytest.mark.parametrize("tokens,num_experts,top_k,skip", [(1, 5, 2, ()), (200, 9, 8, (4,)), (37, 3, 1, ())])
def test_float32_experts_of_bf16_values_stay_bf16_and_give_the_float32_results(tokens, num_experts, top_k, skip,
                                                                            hidden, intermediate, gemm_min_rows):
    """A float32 block whose expert weights hold bf16 values (a bf16 checkpoint run in float32) stacks them in
    bf16; the kernel's float32 results on them are those on the same values in float32: bit for bit on its own
    tiles, to the GEMM's rounding on ATen's (the widened copy may sit at another alignment than an expert's view)."""
    per_expert, fused = make_blocks(num_experts, top_k, intermediate, torch.float32, bf16_values=("experts",),
                                    hidden=hidden)
    experts = fused.experts
    assert experts.w13.dtype == experts.w2.dtype == torch.bfloat16
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(tokens, num_experts, top_k, skip)
    with torch.no_grad():
        got, counts = fused_moe.KERNEL.load().fused_moe(x, experts.w13, experts.w2, weights, ids, gemm_min_rows)
        widened, _ = fused_moe.KERNEL.load().fused_moe(x, experts.w13.float(), experts.w2.float(), weights, ids,
                                                       gemm_min_rows)
        want = per_expert.experts(x, weights, ids)
    assert got.dtype == torch.float32
    if gemm_min_rows > tokens:
        assert torch.equal(got, widened)
    else:
        torch.testing.assert_close(got, widened, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=num_experts))


@pytest.mark.parametrize("bf16_part", ["gate_up_proj", "down_proj"])
def test_experts_stay_float32_unless_all_of_a_layers_weights_hold_bf16_values(bf16_part):
    """gate/up and down go to the kernel in one dtype: bf16 only where both hold bf16 values."""
    per_expert, fused = make_blocks(5, 2, intermediate=40, dtype=torch.float32, bf16_values=(bf16_part,))
    assert fused.experts.w13.dtype == fused.experts.w2.dtype == torch.float32
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(9, 5, 2, ())
    with torch.no_grad():
        torch.testing.assert_close(fused.experts(x, weights, ids), per_expert.experts(x, weights, ids),
                                   rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_experts_of_another_dtype_than_it_can_widen():
    """bf16 experts serve float32 activations; float32 experts never serve bf16 ones."""
    x = torch.randn(2, HIDDEN).bfloat16()
    w13, w2 = torch.randn(3, 16, HIDDEN), torch.randn(3, HIDDEN, 8)
    weights, ids = routing(2, 3, 1, ())
    with pytest.raises(RuntimeError, match="bf16 under float32 x"):
        fused_moe.KERNEL.load().fused_moe(x, w13, w2, weights, ids, 1 << 30)


@pytest.mark.parametrize("gemm_min_rows", [1 << 30, 1], ids=["tiles", "aten-gemm"])
@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 5, 2), (200, 9, 8), (200, 6, 1)])
def test_fused_bf16_close_to_per_expert(tokens, num_experts, top_k, gemm_min_rows):
    per_expert, fused = make_blocks(num_experts, top_k, intermediate=48, dtype=torch.bfloat16)
    fused.experts.method.gemm_min_rows = gemm_min_rows
    reference, _ = make_blocks(num_experts, top_k, intermediate=48, dtype=torch.float32)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(tokens, num_experts, top_k, skip=(num_experts - 1,))
    with torch.no_grad():
        want = reference.experts(x, weights, ids)  # float32, from the same weights before rounding to bf16
        reference_bf16 = per_expert.experts(x.bfloat16(), weights.bfloat16(), ids)
        got = fused.experts(x.bfloat16(), weights.bfloat16(), ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_bf16.float(), rtol=3e-2, atol=3e-2)
    # fewer bf16 roundings than the per-expert path (slack: on the ATen GEMM path both round alike, and the
    # GEMMs' own rounding differs by CPU)
    assert (got.float() - want).abs().mean() <= 1.25 * (reference_bf16.float() - want).abs().mean()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_shared_expert_block(dtype, tol):
    """Qwen2-MoE's block (router, routed experts, sigmoid-gated shared expert) fused as per expert."""
    per_expert, fused = make_blocks(num_experts=6, top_k=2, intermediate=24, dtype=dtype, shared=56)
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), per_expert(x), rtol=tol, atol=tol)


def test_quantised_experts_stay_per_expert():
    """A linear method without plain float weights (int8) keeps the expert modules and their path."""
    from folio.models.quantization import quantization_chooser

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 64,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    block = SparseMoeBlock(cfg, float_weights=False)
    bind_linear_methods(block, quantization_chooser("int8", DenseLinearMethod()))
    for param in block.parameters():
        param.data.copy_(torch.randn(param.shape).to(param.dtype))
    process_weights_after_loading(block)
    assert isinstance(block.experts.method, PerExpertMethod) and len(block.experts) == 4
