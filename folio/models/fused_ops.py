"""Fused CPU kernels for the elementwise ops of a decoder layer (folio/csrc/cpu_fused_ops.cpp).

The ops of folio.models.layers, as the torch reference code below computes them, to the same bits:

  fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)   = RMSNorm.forward(x, residual)
  rms_norm(x, weight, eps) -> out                                      = RMSNorm.forward(x)
  rotary_embedding_(positions, q, k, cos, sin) -> (q, k), IN PLACE      = RotaryEmbedding.forward
  silu_and_mul(gate_up) -> out                                         = layers.silu_and_mul

The kernel is used for CPU bf16 tensors (weights bf16 too) with unit stride along the last dimension, and for
float32 ones (where no bf16 CPU runs models in float32, its ~10 small torch ops a norm were a third of a batch-1
decode step's time outside the linear layers; SiLU where its SLEEF exp matched torch's at load, float32_silu);
any other case (fp16, a GPU tensor, a weight of another dtype, the kernel failed to build or
FOLIO_DISABLE_CPU_KERNELS=1) runs the reference torch code, which gives the same results.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import nn

from folio.csrc_build import CSRC, CppKernel

logger = logging.getLogger(__name__)

# -ffp-contract=off: the float32 formulas are torch's separate ops, each rounding its result (no FMA of a product
# and a sum)
KERNEL = CppKernel("folio_cpu_fused_ops", CSRC / "cpu_fused_ops.cpp", what="CPU fused elementwise kernel",
                   fallback="using the torch reference ops", cflags=("-ffp-contract=off",))


_lanes: Optional[int] = None
_inline_exp: Optional[bool] = None
_float32_silu: Optional[bool] = None


def load_extension(verbose: bool = False):
    """The compiled module, built on first use; None (after one warning) if it cannot be built."""
    return KERNEL.load(verbose)


def sum_lanes() -> int:
    """Vector width whose summation order reproduces torch.sum of float rows (RMSNorm's mean) bit for bit.

    ATen's float sum adds in an order set by its Vectorized<float> width, which depends on the torch build
    and the CPU's kernel dispatch (8 lanes for torch 2.13 on x86, even on AVX-512). Measured once against
    torch.sum; if no width matches, 8 (then RMSNorm outputs may differ from torch's by 1 bf16 ulp, rarely)."""
    global _lanes
    if _lanes is None:
        ext = KERNEL.load()
        lanes = 8
        if ext is not None:
            g = torch.Generator().manual_seed(1234)
            rows = (torch.randn(32, 1000, generator=g) * 3).pow(2)
            # rows of several lengths: the sum order differs with the length (levels, leftovers)
            want = {n: rows[:, :n].contiguous().sum(-1) for n in (576, 896, 1000)}
            for cand in (8, 16, 4, 32):
                if all(torch.equal(ext.row_sums(rows[:, :n].contiguous(), cand), w) for n, w in want.items()):
                    lanes = cand
                    break
            else:
                logger.warning("no summation order matched torch.sum; fused RMSNorm may differ by 1 bf16 ulp")
        _lanes = lanes
    return _lanes


def _silu_matches_torch(ext, inline: bool) -> bool:
    """Whether the kernel's float32 silu with that exp equals torch's own (which uses SLEEF's) bit for bit, on 1M
    values over [-120, 120] plus specials (one tensor of more than a thread's grain: split as torch splits it)."""
    if not ext.has_f32_silu(inline):
        return False
    g = torch.Generator().manual_seed(99)
    x = torch.cat([torch.rand(1 << 20, generator=g) * 240 - 120,
                   torch.tensor([0.0, -0.0, 88.7, -88.8, 87.0, 103.9, 104.0, 104.1, -100.0, -100.1,
                                 float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 3e38] * 16)])
    return torch.equal(ext.silu_f32(x, inline).view(torch.int32), nn.functional.silu(x).view(torch.int32))


def inline_exp() -> bool:
    """Whether SiLU may use the kernel's inline copy of SLEEF's expf (AVX-512): checked once against torch
    (_silu_matches_torch); else the kernel calls libtorch's Sleef_expf16_u10 (slower: not inlined)."""
    global _inline_exp
    if _inline_exp is None:
        ext = KERNEL.load()
        ok = ext is not None and ext.has_avx512() and _silu_matches_torch(ext, True)
        if ext is not None and ext.has_avx512() and not ok:
            logger.info("inline SLEEF exp differs from torch's here; SiLU calls libtorch's Sleef_expf16_u10")
        _inline_exp = ok
    return _inline_exp


def float32_silu() -> bool:
    """Whether float32 SiLU-and-mul takes the kernel: its vector exp is at hand (libtorch's Sleef entry point
    where the exp is not inline) and its silu matched torch's at load; else the reference ops run it."""
    global _float32_silu
    if _float32_silu is None:
        ext = KERNEL.load()
        _float32_silu = ext is not None and _silu_matches_torch(ext, inline_exp())
    return _float32_silu


def prepare() -> None:
    """Build or load the kernel and run its one-time checks now (at model load), not in the first forward."""
    if load_extension() is not None:
        sum_lanes()
        inline_exp()
        float32_silu()


def bf16_silu_table() -> Optional[torch.Tensor]:
    """The table bf16 silu_and_mul looks each gate's rounded silu up in (int32 [32776] over 65552 uint16 entries),
    for a kernel that fuses the op into its epilogue with the same results (folio.models.onednn_int8's gated
    weights); None where the op uses no table here (the kernel missing, no AVX-512 or no vector exp)."""
    ext = KERNEL.load()
    return None if ext is None else ext.bf16_silu_table(inline_exp())


@functools.cache
def has_bf16_silu_table() -> bool:
    """Whether bf16 silu_and_mul looks its values up in a table here (bf16_silu_table)."""
    return bf16_silu_table() is not None


def extension_error() -> Optional[str]:
    return KERNEL.error


def _ext_for(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)):
    """The kernel, where every tensor is a CPU one of the same dtype among `dtypes`, unit-strided along its rows."""
    # (kept lean: this runs ~100 times per model step; torch.Size / .view() calls cost microseconds each)
    dtype = tensors[0].dtype
    if dtype not in dtypes:
        return None
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu or t.stride(-1) != 1:
            return None
    return KERNEL.load()


# ---------------------------------------------------------------------------------- reference code
# What Transformers computes (same op order, same float32 upcasts): the fallback, and the kernels' spec.

def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_rotary(positions, q, k, cos_table, sin_table):
    cos = cos_table[positions].to(q.dtype).unsqueeze(1)
    sin = sin_table[positions].to(q.dtype).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def ref_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


# ---------------------------------------------------------------------------------------- fused ops

def silu_and_mul_runs(gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """silu_and_mul of a bf16 product [..., 2I] whose columns go in runs of 32 gates, each followed by the same
    outputs' ups (folio.models.gated_layout), [..., I] in the outputs' order, by the kernel: the op's results over
    the plain product, bit for bit; written into `out` (a 2-D product's: [T, I], rows of unit stride) if given.
    None where the kernel does not serve it (no table here, I not a multiple of 64: the caller puts the product in
    plain order and takes the op)."""
    ext = _ext_for(gate_up, dtypes=(torch.bfloat16,))
    if ext is None or gate_up.shape[-1] % 128 or not has_bf16_silu_table():
        return None
    exp = _inline_exp if _inline_exp is not None else inline_exp()
    if gate_up.dim() == 2:
        return ext.silu_and_mul_runs(gate_up, exp, out)
    assert out is None, "out is for 2-D products"
    shape = gate_up.shape
    return ext.silu_and_mul_runs(gate_up.reshape(-1, shape[-1]), exp).view(*shape[:-1], shape[-1] // 2)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(x + residual), x + residual), as new tensors shaped like x."""
    ext = _ext_for(x, residual, weight)
    if ext is None or weight.dim() != 1:
        return ref_rms_norm(x, weight, eps, residual)
    if x.dim() == 2 and residual.dim() == 2:
        return ext.fused_add_rms_norm(x, residual, weight, eps, _lanes or sum_lanes())
    if x.shape != residual.shape:
        return ref_rms_norm(x, weight, eps, residual)
    shape = x.shape
    out, new_res = ext.fused_add_rms_norm(x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), weight,
                                          eps, _lanes or sum_lanes())
    return out.view(shape), new_res.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _ext_for(x, weight)
    if ext is None or weight.dim() != 1:
        return ref_rms_norm(x, weight, eps)
    if x.dim() == 2:
        return ext.rms_norm(x, weight, eps, _lanes or sum_lanes())
    shape = x.shape
    return ext.rms_norm(x.reshape(-1, shape[-1]), weight, eps, _lanes or sum_lanes()).view(shape)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (they may be views of one qkv tensor); returns (q, k).

    cos/sin: the float32 [max_positions, D] tables of layers.RotaryEmbedding (contiguous)."""
    ext = _ext_for(q, k)
    if (ext is None or q.dim() != 3 or k.dim() != 3 or cos.dtype is not torch.float32
            or sin.dtype is not torch.float32 or not positions.is_cpu):
        rq, rk = ref_rotary(positions, q, k, cos, sin)
        q.copy_(rq)
        k.copy_(rk)
        return q, k
    if positions.dtype is not torch.int64 or positions.dim() != 1 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous().reshape(-1)
    ext.rotary_embedding(positions, q, k, cos, sin)
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ext = _ext_for(gate_up)
    if ext is None or gate_up.shape[-1] % 2 or (gate_up.dtype is torch.float32 and not
                                                (_float32_silu if _float32_silu is not None else float32_silu())):
        return ref_silu_and_mul(gate_up)
    if gate_up.dim() == 2:
        return ext.silu_and_mul(gate_up, _inline_exp if _inline_exp is not None else inline_exp())
    shape = gate_up.shape
    out = ext.silu_and_mul(gate_up.reshape(-1, shape[-1]), inline_exp())
    return out.view(*shape[:-1], shape[-1] // 2)
