"""A causal depthwise convolution over each request's own tokens, whose history is a recurrent state (LFM2's short
convolutions, Mamba2's convolution; folio.models.recurrent_state).

Channel c of token t is sum_j weight[c, j] * input[c, t - taps + 1 + j] (+ bias[c]): each token sees its channel's
last `taps` inputs, those of the request's earlier steps coming from its state, a [channels, taps - 1] row of the
request's last inputs, which the call then replaces with its own last ones. The weights are Conv1d's
[channels, 1, taps], loaded row by row (each tensor-parallel rank its channels').
"""

from __future__ import annotations

import torch
from torch import nn

from folio.models.linear import load_rank_rows
from folio.models.weight_loader import uninitialized


class CausalDepthwiseConv(nn.Module):
    def __init__(self, channels: int, taps: int, bias: bool) -> None:
        super().__init__()
        self.channels, self.taps = channels, taps
        self.weight = uninitialized(channels, 1, taps)
        load_rank_rows(self.weight)
        self.bias = None
        if bias:
            self.bias = uninitialized(channels)
            load_rank_rows(self.bias)

    @property
    def state_shape(self) -> tuple[int, int]:
        return self.channels, self.taps - 1

    def decodes(self, x: torch.Tensor, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token a request: x [B, channels], the requests' state rows `rows` -> [B, channels]."""
        window = torch.cat([state[rows], x.unsqueeze(-1)], dim=-1)  # [B, channels, taps]
        state[rows] = window[..., 1:]
        out = (window * self.weight[:, 0]).sum(-1)
        return out if self.bias is None else out + self.bias

    def tokens(self, x: torch.Tensor, state: torch.Tensor, row: int) -> torch.Tensor:
        """One request's tokens x [n, channels], after its state row `row` -> [n, channels]."""
        seq = torch.cat([state[row], x.t()], dim=-1)  # [channels, taps - 1 + n]
        state[row] = seq[:, seq.shape[1] - (self.taps - 1):]
        return nn.functional.conv1d(seq.unsqueeze(0), self.weight, self.bias, groups=self.channels)[0].t()
