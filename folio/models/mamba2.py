"""The Mamba2 mixer (Granite 4.0-H's "mamba" layers), as Transformers' torch path computes it
(GraniteMoeHybridMambaLayer), on folio's flattened batch with a recurrent state per request
(folio.models.recurrent_state).

  * in_proj gives, per token, the gate z (intermediate channels), x, B and C (intermediate + 2 * groups * d_state
    channels: they go through the convolution together) and dt (one per head);
  * a causal depthwise convolution over the last conv_kernel inputs of each of those channels, then SiLU. Its state:
    a request's last conv_kernel - 1 inputs (in the model's dtype);
  * the selective state-space scan: per head h, with dt = clamp(softplus(dt + dt_bias), time_step_limit) and
    A = -exp(A_log), the state S [head_dim, d_state] follows S <- exp(dt * A) * S + dt * x B^T and the output is
    y = S C + D * x (the D skip). B and C are per group: heads / groups heads share them. Its state: S of every head,
    float32 in every dtype (Transformers keeps the chunked scan's float32 final state);
  * the gated RMSNorm, gate first (norm_before_gate=False): y * silu(z), normalised over groups of
    intermediate / groups channels, then out_proj.

A prefill chunk runs the SSD chunked form of the scan per request (Mamba2's; Transformers' mamba2_chunk_scan):
within blocks of mamba_chunk_size tokens the scan is a masked, decay-weighted product like attention's, and the
state is carried from block to block, so the work is in matmuls (a sequential recurrence over 512 tokens would make
512 passes over every state). C^T B, shared by a group's heads, is computed once per group. A decode step (every
request one token) updates every request's state at once.

The time-step limit is applied to every token. Transformers' one-token path (mamba2_selective_state_update) skips
it, as mamba_ssm's step does, where the chunked scan (and training) clamp: folio clamps alike in both, so that a
token's output does not depend on how the scheduler chunked its request. At the default limit (0, inf), which the
released Granite 4.0-H checkpoints keep, the clamp changes nothing. A decode step also computes in float32 where
Transformers' one-token path rounds dt * B * x and the output to the model's dtype.

Tensor parallelism is refused: the gated norm spans every head of a group (one group in the released models), so
splitting heads across ranks would need a collective inside the norm, and replicating the layers on every rank
would keep every rank's states whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from folio.distributed.parallel_state import tensor_parallel_group
from folio.models.causal_conv import CausalDepthwiseConv
from folio.models.hot_path import HotPathModule
from folio.models.linear import Linear
from folio.models.llama import StepContext
from folio.models.model_config import ModelConfig
from folio.models.recurrent_state import RecurrentStep, StateSpec
from folio.models.weight_loader import uninitialized


def config_float(value: Any) -> float:
    """A float of a config.json: Transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., l, s] = a[s + 1] + ... + a[l] for s <= l (0 on the diagonal), -inf above it,
    by masked cumulative sums as Transformers' segment_sum (steadier than differences of one cumulative sum)."""
    ones = torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool, device=a.device)
    sums = a[..., None].expand(*a.shape, a.shape[-1]).masked_fill(~ones.tril(-1), 0).cumsum(-2)
    return sums.masked_fill(~ones.tril(), -torch.inf)


class GatedRMSNorm(HotPathModule):
    """RMSNorm of y * silu(gate) over groups of group_size channels, in float32 (GraniteMoeHybridRMSNormGated)."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = uninitialized(size)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(h.shape).to(y.dtype)


class Mamba2Mixer(HotPathModule):
    """One Mamba2 layer's mixer, its parameters named as the checkpoint's (model.layers.N.mamba.*); its states are
    the model runner's rows (`state_shapes`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        if tensor_parallel_group().size > 1:
            raise ValueError(f"{cfg.architecture}: tensor parallelism is not supported for its Mamba2 layers")
        hf = cfg.hf_config
        self.layer_idx = layer_idx
        self.num_heads, self.groups = int(hf["mamba_n_heads"]), int(hf["mamba_n_groups"])
        self.d_state, self.taps = int(hf["mamba_d_state"]), int(hf["mamba_d_conv"])
        self.intermediate = int(hf["mamba_expand"]) * cfg.hidden_size
        head_dim = hf["mamba_d_head"]
        self.head_dim = self.intermediate // self.num_heads if head_dim == "auto" else int(head_dim)
        if self.head_dim * self.num_heads != self.intermediate or self.num_heads % self.groups:
            raise ValueError(f"{cfg.architecture}: mamba_n_heads {self.num_heads} of mamba_d_head {self.head_dim} do "
                             f"not make mamba_expand * hidden_size ({self.intermediate}) in {self.groups} groups")
        self.chunk_size = int(hf["mamba_chunk_size"])
        limit = hf.get("time_step_limit") or (0.0, float("inf"))
        self.dt_min, self.dt_max = config_float(limit[0]), config_float(limit[1])
        self.conv_dim = self.intermediate + 2 * self.groups * self.d_state
        bias = bool(hf["mamba_proj_bias"])
        self.in_proj = Linear(cfg.hidden_size, self.intermediate + self.conv_dim + self.num_heads, bias=bias)
        self.conv1d = CausalDepthwiseConv(self.conv_dim, self.taps, bool(hf["mamba_conv_bias"]))
        self.dt_bias, self.A_log, self.D = (uninitialized(self.num_heads) for _ in range(3))
        self.norm = GatedRMSNorm(self.intermediate, self.intermediate // self.groups, cfg.rms_norm_eps)
        self.out_proj = Linear(self.intermediate, cfg.hidden_size, bias=bias)

    def state_shapes(self) -> tuple[tuple[int, ...], StateSpec]:
        """A request's states: the convolution's last taps - 1 inputs, and every head's SSM state (float32)."""
        return self.conv1d.state_shape, StateSpec((self.num_heads, self.head_dim, self.d_state), torch.float32)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        step = ctx.recurrent
        gate, xbc, dt = self.in_proj(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias).clamp(self.dt_min, self.dt_max).float()  # softplus in the model's dtype
        if step.decodes_only:
            conv = F.silu(self.conv1d.decodes(xbc, step.states[self.layer_idx][0], step.rows))
            y = self._decode(conv, dt, step)
        else:
            y, start = torch.empty(x.shape[0], self.intermediate, dtype=torch.float32, device=x.device), 0
            for row, n in zip(step.rows.tolist(), step.query_lens):
                tokens = slice(start, start + n)
                conv = F.silu(self.conv1d.tokens(xbc[tokens], step.states[self.layer_idx][0], row))
                y[tokens] = self._prefill(conv, dt[tokens], step, row)
                start += n
        return self.out_proj(self.norm(y, gate).to(x.dtype))

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, groups, heads per group, head_dim], B and C [T, groups, d_state], all float32."""
        x, b, c = xbc.float().split([self.intermediate, self.groups * self.d_state, self.groups * self.d_state], -1)
        return (x.view(-1, self.groups, self.num_heads // self.groups, self.head_dim),
                b.view(-1, self.groups, self.d_state), c.view(-1, self.groups, self.d_state))

    def _grouped(self, per_head: torch.Tensor) -> torch.Tensor:
        return per_head.view(*per_head.shape[:-1], self.groups, self.num_heads // self.groups)

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, step: RecurrentStep, row: int) -> torch.Tensor:
        """The SSD chunked scan of one request's tokens from its state: [T, intermediate] float32. Head-major
        ([groups, heads per group, tokens, ...]), so that each product below is one batched matmul."""
        x, b, c = self._split(xbc)
        states = step.states[self.layer_idx][1]
        state = states[row].view(self.groups, -1, self.head_dim, self.d_state)  # [g, r, p, n]
        dt = self._grouped(dt)
        log_decay = (dt * self._grouped(-torch.exp(self.A_log.float()))).permute(1, 2, 0)  # [g, r, T]
        xdt = (x * dt[..., None]).permute(1, 2, 0, 3).contiguous()  # [g, r, T, p]
        b, c = b.transpose(0, 1).unsqueeze(1), c.transpose(0, 1).unsqueeze(1)  # [g, 1, T, n]
        y = torch.empty_like(xdt)
        for first in range(0, x.shape[0], self.chunk_size):
            block = slice(first, first + self.chunk_size)
            a, xb, bb, cb = log_decay[..., block], xdt[:, :, block], b[:, :, block], c[:, :, block]
            cum = a.cumsum(-1)  # [g, r, l]
            # within the block: y_l = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s
            scores = segment_sums(a).exp_().mul_(cb @ bb.transpose(-1, -2))  # [g, r, l, s]
            # and from the state at the block's start, decayed to each token
            y[:, :, block] = scores @ xb + (cb @ state.transpose(-1, -2)) * cum.exp().unsqueeze(-1)
            # the state at the block's end: the start's decayed over the block, plus each token's decayed to the end
            to_end = (cum[..., -1:] - cum).exp_().unsqueeze(-1)  # [g, r, l, 1]
            state = state * cum[..., -1:].exp().unsqueeze(-1) + (xb * to_end).transpose(-1, -2) @ bb
        states[row] = state.view(states.shape[1:])
        y = y.permute(2, 0, 1, 3) + self._grouped(self.D)[..., None] * x  # [T, g, r, p]: the D skip
        return y.reshape(x.shape[0], -1)

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        """One token of every request: S <- exp(dt A) S + (dt x) B^T, y = S C + D x; [B, intermediate] float32.
        Each request's state is updated where it lies: at MiBs a request, gathering and scattering the batch's
        rows would cost two more passes over them than the update itself."""
        x, b, c = self._split(xbc)
        dt = self._grouped(dt)  # [B, g, r]
        decay = torch.exp(dt * self._grouped(-torch.exp(self.A_log.float())))[..., None, None]
        u, b, c = (dt[..., None] * x)[..., None], b[:, :, None, None, :], c[:, :, None, :, None]
        states, y = step.states[self.layer_idx][1], torch.empty_like(x)
        for i, row in enumerate(step.rows.tolist()):
            state = states[row].view(self.groups, -1, self.head_dim, self.d_state)
            y[i] = (state.mul_(decay[i]).addcmul_(u[i], b[i]) @ c[i]).squeeze(-1)
        return (y + self._grouped(self.D)[..., None] * x).view(x.shape[0], -1)
