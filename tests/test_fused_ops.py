"""folio.models.fused_ops' kernels equal its torch reference code (what Transformers computes) bit for bit.

bf16 and float32 inputs of the SmolLM2-135M / Qwen2-0.5B shapes (and odd sizes that take the scalar tails), T = 1,
7, 64, 300: outputs compared as raw bits (NaN included), residual outputs identical; mixed dtypes and a disabled
kernel take the reference path. The first test builds the kernel (~15 s on 2 cores, once per
machine: later runs load it from ~/.cache/folio/torch_extensions).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from folio.csrc_build import CppKernel
from folio.models import fused_ops as F
from folio.models import gated_layout
from folio.models.layers import RMSNorm, RotaryEmbedding

TOKENS = (1, 7, 64, 300)


@pytest.fixture(scope="module", autouse=True)
def ext():
    e = F.load_extension()
    if e is None:
        if shutil.which("c++") is None or shutil.which("ninja") is None:
            pytest.skip(f"no C++ toolchain: {F.extension_error()}")
        pytest.fail(f"the fused ops kernel did not build: {F.extension_error()}")
    return e


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == torch.bfloat16:
        return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))
    if a.dtype == torch.float32:
        return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
    return torch.equal(a, b)


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def norm(h: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    n = RMSNorm(h, 1e-5)
    n.weight.data = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return n


def test_sum_order_matches_torch(ext):
    lanes = F.sum_lanes()
    g = torch.Generator().manual_seed(0)
    for n in (3, 8, 17, 100, 576, 896, 1024, 1536, 4096, 5000, 20000):
        x = (torch.randn(8, n, generator=g) * 2).pow(2)
        assert torch.equal(ext.row_sums(x, lanes), x.sum(-1)), n


@DTYPES
@pytest.mark.parametrize("h", [576, 896, 100, 2048])
@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm_bit_exact(h, t, dtype):
    g = torch.Generator().manual_seed(h * 1000 + t)
    n = norm(h, t, dtype)
    x = torch.randn(t, h, generator=g).to(dtype)
    res = (torch.randn(t, h, generator=g) * 8).to(dtype)
    assert F._ext_for(x, res, n.weight) is not None  # the kernel's path, not the fallback
    ref_out, ref_res = F.ref_rms_norm(x, n.weight, n.eps, res)
    out, new_res = F.fused_add_rms_norm(x, res, n.weight, n.eps)
    assert same_bits(new_res, ref_res)
    assert same_bits(out, ref_out)
    assert same_bits(F.rms_norm(x, n.weight, n.eps), F.ref_rms_norm(x, n.weight, n.eps))


def test_rms_norm_rounds_denormals_nans_and_infinities_as_torch():
    """Rows whose products fall below float32's normals (tiny weights), and NaN and infinite inputs: bf16's
    rounding of such values differs between the CPU's instruction and ATen's, and the kernel must be ATen's."""
    h = 896
    n = norm(h, 4)
    n.weight.data[: h // 2] = 1e-39  # a float32 denormal: w * x is one
    n.weight.data[h // 2: h // 2 + 4] = torch.tensor([float("nan"), float("inf"), -1e-45, 3e38])
    x = torch.randn(4, h).to(torch.bfloat16)
    x[1, 7], x[2, 100], x[3, 5] = float("nan"), float("inf"), 1e-40
    res = torch.randn(4, h).to(torch.bfloat16)
    ref_out, ref_res = F.ref_rms_norm(x, n.weight, n.eps, res)
    out, new_res = F.fused_add_rms_norm(x, res, n.weight, n.eps)
    assert same_bits(new_res, ref_res) and same_bits(out, ref_out)
    assert same_bits(F.rms_norm(x, n.weight, n.eps), F.ref_rms_norm(x, n.weight, n.eps))


def test_rms_norm_non_contiguous_and_3d():
    h = 576
    n = norm(h, 3)
    big = torch.randn(5, 2 * h).to(torch.bfloat16)
    x = big[:, :h]  # row stride 2h
    res = torch.randn(5, h).to(torch.bfloat16)
    ref_out, ref_res = F.ref_rms_norm(x, n.weight, n.eps, res)
    out, new_res = F.fused_add_rms_norm(x, res, n.weight, n.eps)
    assert same_bits(out, ref_out) and same_bits(new_res, ref_res)
    x3 = torch.randn(2, 3, h).to(torch.bfloat16)
    assert same_bits(F.rms_norm(x3, n.weight, n.eps), F.ref_rms_norm(x3, n.weight, n.eps))


@DTYPES
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (14, 2, 64), (8, 2, 128), (4, 4, 48)])
@pytest.mark.parametrize("t", TOKENS)
def test_rotary_bit_exact_in_place(hq, hkv, d, t, dtype):
    rot = RotaryEmbedding(d, 4096, 10000.0, None)
    g = torch.Generator().manual_seed(t * 7 + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype) * 3
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # views, as in LlamaAttention
    q, k = q.view(-1, hq, d), k.view(-1, hkv, d)
    assert F._ext_for(q, k) is not None
    positions = torch.randint(0, 4096, (t,), generator=g)
    ref_q, ref_k = F.ref_rotary(positions, q, k, rot.cos, rot.sin)
    v_before = v.clone()
    out_q, out_k = F.rotary_embedding_(positions, q, k, rot.cos, rot.sin)
    assert out_q is q and out_k is k
    assert same_bits(q, ref_q) and same_bits(k, ref_k)
    assert same_bits(v, v_before)


def test_rotary_int32_positions():
    rot = RotaryEmbedding(64, 512, 1e6, {"rope_type": "llama3", "factor": 8.0,
                                           "original_max_position_embeddings": 128})
    q = torch.randn(7, 9, 64).to(torch.bfloat16)
    k = torch.randn(7, 3, 64).to(torch.bfloat16)
    positions = torch.arange(7, dtype=torch.int32) * 70
    ref_q, ref_k = F.ref_rotary(positions.long(), q, k, rot.cos, rot.sin)
    F.rotary_embedding_(positions, q, k, rot.cos, rot.sin)
    assert same_bits(q, ref_q) and same_bits(k, ref_k)


def test_rotary_position_out_of_range():
    rot = RotaryEmbedding(64, 16, 10000.0, None)
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of range"):
        F.rotary_embedding_(torch.tensor([16]), q, q.clone(), rot.cos, rot.sin)


def needs_float32_silu(dtype: torch.dtype) -> None:
    if dtype == torch.float32 and not F.float32_silu():
        pytest.skip("float32 SiLU runs the reference here (no SLEEF exp to call, or it differs from torch's)")


@pytest.mark.parametrize("i", [1536, 4864, 100])
@pytest.mark.parametrize("t", TOKENS)
@DTYPES
def test_silu_and_mul_bit_exact(i, t, dtype):
    """float32 too: T = 7 rows of 4864 (34048 values) are split between two threads (where two run) inside a
    row, as torch splits its silu's elements, which sends other values through the scalar exp."""
    needs_float32_silu(dtype)
    g = torch.Generator().manual_seed(i + t)
    gate_up = (torch.randn(t, 2 * i, generator=g) * 4).to(dtype)
    if t == 7:  # extremes: exp overflow/underflow, infinities, NaN
        gate_up[0, :8] = torch.tensor([-200.0, 200.0, float("inf"), float("-inf"), float("nan"), -88.0, 88.0, 0.0])
        gate_up[1, i:i + 8] = torch.tensor([float("inf")] * 4 + [1e38, -1e38, 0.0, float("nan")])
    assert same_bits(F.silu_and_mul(gate_up), F.ref_silu_and_mul(gate_up))


def test_silu_and_mul_3d():
    gate_up = torch.randn(2, 3, 2 * 1536).to(torch.bfloat16)
    assert same_bits(F.silu_and_mul(gate_up), F.ref_silu_and_mul(gate_up))


def test_float32_odd_sizes_and_mixed_dtypes():
    """float32 norms, rotary and SiLU of odd sizes on the kernel; a float32 weight with bf16 activations on the
    reference path: all as the reference computes them."""
    n = RMSNorm(96, 1e-6)
    n.weight.data = torch.rand(96) + 0.5
    x, res = torch.randn(7, 96), torch.randn(7, 96)
    out, new_res = F.fused_add_rms_norm(x, res, n.weight, n.eps)
    ref_out, ref_res = F.ref_rms_norm(x, n.weight, n.eps, res)
    assert out.dtype == torch.float32 and same_bits(out, ref_out) and same_bits(new_res, ref_res)
    assert same_bits(F.rms_norm(x, n.weight, n.eps), F.ref_rms_norm(x, n.weight, n.eps))
    # bf16 activations with a float32 weight: torch promotes the output to float32; so does the fallback
    xb = x.to(torch.bfloat16)
    assert same_bits(F.rms_norm(xb, n.weight, n.eps), F.ref_rms_norm(xb, n.weight, n.eps))
    rot = RotaryEmbedding(32, 64, 10000.0, None)
    q, k = torch.randn(7, 4, 32), torch.randn(7, 2, 32)
    pos = torch.arange(7)
    ref_q, ref_k = F.ref_rotary(pos, q, k, rot.cos, rot.sin)
    F.rotary_embedding_(pos, q, k, rot.cos, rot.sin)
    assert same_bits(q, ref_q) and same_bits(k, ref_k)
    gu = torch.randn(7, 64)
    assert same_bits(F.silu_and_mul(gu), F.ref_silu_and_mul(gu))


def test_disabled_kernel_falls_back(monkeypatch):
    monkeypatch.setenv("FOLIO_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setattr(F, "KERNEL", CppKernel("folio_cpu_fused_ops", F.KERNEL.source, "test kernel", "reference"))
    assert F.load_extension() is None and "disabled" in F.extension_error()
    n = norm(576, 1)
    x, res = torch.randn(7, 576).to(torch.bfloat16), torch.randn(7, 576).to(torch.bfloat16)
    out, new_res = F.fused_add_rms_norm(x, res, n.weight, n.eps)
    ref_out, ref_res = F.ref_rms_norm(x, n.weight, n.eps, res)
    assert same_bits(out, ref_out) and same_bits(new_res, ref_res)
    gu = torch.randn(7, 3072).to(torch.bfloat16)
    assert same_bits(F.silu_and_mul(gu), F.ref_silu_and_mul(gu))
    rot = RotaryEmbedding(64, 64, 10000.0, None)
    q, k = torch.randn(7, 9, 64).to(torch.bfloat16), torch.randn(7, 3, 64).to(torch.bfloat16)
    ref_q, ref_k = F.ref_rotary(torch.arange(7), q, k, rot.cos, rot.sin)
    F.rotary_embedding_(torch.arange(7), q, k, rot.cos, rot.sin)
    assert same_bits(q, ref_q) and same_bits(k, ref_k)


@pytest.mark.parametrize("inline", [True, False])
def test_silu_float32_intermediate_matches_torch(ext, inline):
    """Stronger than the bf16 checks: SiLU's float32 result (before rounding) equals torch's float32 silu, with
    either exp (the inline copy: AVX-512 only)."""
    if not ext.has_f32_silu(inline):
        pytest.skip("no vector path with this exp here (inline: AVX-512 only; else Sleef not exported)")
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.rand(1 << 19, generator=g) * 240 - 120, torch.randn(1 << 19, generator=g) * 4])
    x[:5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    assert torch.equal(ext.silu_f32(x, inline).view(torch.int32), torch.nn.functional.silu(x).view(torch.int32))
    if inline:
        assert F.inline_exp()


@pytest.mark.parametrize("inline", [True, False])
def test_silu_and_mul_both_exp_paths(ext, inline):
    gate_up = (torch.randn(300, 2 * 1536) * 4).to(torch.bfloat16)
    assert same_bits(ext.silu_and_mul(gate_up, inline), F.ref_silu_and_mul(gate_up))
    # every bf16 gate value (NaNs, infinities, subnormals included), each through the vector loop's table
    gates = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(torch.bfloat16).reshape(512, 128)
    ups = (torch.randn(512, 128) * 3).to(torch.bfloat16)
    ups[:, :8] = 1.0
    gate_up = torch.cat([gates, ups], dim=1)
    assert same_bits(ext.silu_and_mul(gate_up, inline), F.ref_silu_and_mul(gate_up))


@pytest.mark.parametrize("t", [1, 7, 300])
def test_silu_and_mul_of_the_gated_layout_is_the_ops_on_the_plain_product(t):
    """silu_and_mul_runs reads a product whose columns are in the gated layout in place: the bits silu_and_mul
    gives the plain product, for every bf16 gate value (through the op's table, as rows of a multiple of 64
    outputs take it); shapes it does not serve get None."""
    if not F.has_bf16_silu_table():
        pytest.skip("bf16 silu_and_mul uses no table here")
    gates = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(torch.bfloat16)
    i = 4864
    g = torch.Generator().manual_seed(t)
    plain = (torch.randn(t, 2 * i, generator=g) * 4).to(torch.bfloat16)
    # random gate values; with 300 rows every one of them in turn
    which = torch.arange(t * i) if t == 300 else torch.randint(0, 1 << 16, (t * i,), generator=g)
    plain[:, :i] = gates[which % (1 << 16)].view(t, i)
    gated = gated_layout.interleave_gated(plain.t()).t().contiguous()
    assert same_bits(gated_layout.plain_order(gated), plain)
    assert same_bits(F.silu_and_mul_runs(gated), F.silu_and_mul(plain))
    assert same_bits(F.silu_and_mul_runs(gated.view(1, t, 2 * i)), F.silu_and_mul(plain).view(1, t, i))
    into = torch.full((t + 1, i + 64), float("nan")).to(torch.bfloat16)  # rows of a wider result
    assert F.silu_and_mul_runs(gated, into[1:, :i]).data_ptr() == into[1].data_ptr()
    assert same_bits(into[1:, :i], F.silu_and_mul(plain))
    assert into[0].isnan().all() and into[:, i:].isnan().all()
    with pytest.raises(RuntimeError, match="out must be"):
        F.silu_and_mul_runs(gated, into[1:, :i - 64])
    assert F.silu_and_mul_runs(torch.randn(t, 2 * 96).to(torch.bfloat16)) is None  # 96 outputs: not whole 64s
    assert F.silu_and_mul_runs(torch.randn(t, 2 * 64)) is None  # float32


def test_gated_layout_without_the_kernel_takes_the_op_over_the_plain_order(monkeypatch):
    plain = torch.randn(5, 2 * 192).to(torch.bfloat16)
    gated = gated_layout.interleave_gated(plain.t()).t().contiguous()
    monkeypatch.setattr(F, "silu_and_mul_runs", lambda gate_up, out=None: None)
    assert same_bits(gated_layout.silu_and_mul_gated(gated), F.ref_silu_and_mul(plain))
    rows = torch.full((7, 192), float("nan")).to(torch.bfloat16)
    assert gated_layout.silu_and_mul_gated(gated, out=rows[1:6]).data_ptr() == rows[1].data_ptr()
    assert same_bits(rows[1:6], F.ref_silu_and_mul(plain)) and rows[0].isnan().all() and rows[6].isnan().all()


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog):
    import logging

    from folio import csrc_build

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension: no compiler")

    monkeypatch.setattr(csrc_build, "build_and_load", broken)
    monkeypatch.setattr(F, "KERNEL", CppKernel("folio_cpu_fused_ops", F.KERNEL.source, "CPU fused elementwise kernel",
                                               "using the torch reference ops"))
    with caplog.at_level(logging.WARNING, logger="folio"):
        gu = torch.randn(3, 64).to(torch.bfloat16)
        assert same_bits(F.silu_and_mul(gu), F.ref_silu_and_mul(gu))
        assert same_bits(F.silu_and_mul(gu), F.ref_silu_and_mul(gu))
    assert caplog.text.count("no compiler") == 1 and "no compiler" in F.extension_error()
