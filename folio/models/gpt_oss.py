"""OpenAI's GPT-OSS (gpt-oss-20b, gpt-oss-120b): the Llama decoder with routed experts, as Transformers computes it.

  * attention sinks: a learned logit per query head that joins every softmax's denominator and weighs no value
    (AttentionParams.sinks, honoured by every attention backend), kept in float32;
  * sliding-window (128) and full attention alternating by layer_types; YaRN RoPE; biases on q/k/v and o_proj;
  * the router is a Linear with a bias; each token's top-k logits are softmaxed among themselves;
  * the experts (moe.ClampedSwiGLUExpert) have biases on gate/up and down, and a clamped SwiGLU
    (experts_method.ClampedSwiGLU: swiglu_limit, swiglu_alpha) instead of SiLU(gate) * up;
  * the RMSNorms keep float32 weights and multiply in float32, rounding once (Transformers keeps them in float32).

The checkpoint stacks each layer's experts, with gate and up interleaved: experts.gate_up_proj [E, hidden, 2I]
(gate = [..., ::2], up = [..., 1::2]) and its bias [E, 2I], experts.down_proj [E, I, hidden] and its bias [E,
hidden]. `split_checkpoint_tensor` cuts them into each expert's gate_proj, up_proj and down_proj weights and biases,
which load into the per-expert Linear layers every linear method serves. The official checkpoints store the expert
weights as MXFP4 (`*_blocks`, `*_scales`, quantization_config.quant_method "mxfp4"): the experts keep them
(folio.models.mxfp4_linear: a quarter of bf16's bytes, run one by one through experts_method.PerExpertMethod), or,
where its kernel does not build, they are dequantised to bf16 at load (folio.models.mxfp4), exactly, as Transformers'
Mxfp4Config(dequantize=True) does, and run fused. llama.cpp's GGUF files ("gpt-oss") come through
folio.loader.gguf_loader, their experts one by one already, their sinks as self_attn.sinks.weight; where their
MXFP4 experts run as stored (the default for a GGUF file, folio.loader.gguf_native), the loader repacks ggml's
blocks into each expert's weight and weight_scale, which load into the same MXFP4 layers; else they come
dequantised.

Tensor parallelism: each rank keeps its heads' sinks and its columns of every expert (folio.models.moe).
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from folio.attention.backend import AttentionParams
from folio.distributed.parallel_state import tensor_parallel_group
from folio.models import mxfp4
from folio.models.experts_method import ClampedSwiGLU
from folio.models.gemma import GemmaRMSNorm
from folio.models.hot_path import HotPathModule
from folio.models.layers import RotaryEmbedding
from folio.models.linear import Linear, load_rank_rows
from folio.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from folio.models.model_config import ModelConfig
from folio.models.moe import Experts, Gate
from folio.models.mxfp4_linear import Mxfp4LinearMethod
from folio.models.weight_loader import default_weight_loader, set_weight_loader, uninitialized

# Transformers' GptOssConfig defaults
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
# a layer's stacked expert tensors: (experts prefix, projection, suffix: "" for the weight, _bias, _blocks, _scales)
_EXPERTS_TENSOR = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)")
_GGUF_SINKS = ".self_attn.sinks.weight"  # a GGUF file's name of the sinks (llama.cpp's attn_sinks.weight)


class GptOssRMSNorm(GemmaRMSNorm):
    """weight * x * rsqrt(mean(x^2) + eps), in float32 with a float32 weight (loaded as it is), rounded once to x's
    dtype; given a residual, (norm(x + residual), x + residual), as the Llama layers call their norms."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        set_weight_loader(self.weight, default_weight_loader, (None,))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return super().forward(x)
        x = residual + x
        return super().forward(x), x


class GptOssAttention(LlamaAttention):
    """Llama's attention with an o_proj bias and a float32 sink per query head."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias, parallel="row")
        self.sinks = uninitialized(self.num_heads, dtype=torch.float32)
        load_rank_rows(self.sinks)  # (the rank's heads')
        self.attn_params = AttentionParams(sliding_window=cfg.sliding_window(layer_idx), sinks=self.sinks)


class GptOssRouter(Gate):
    """The router: logits with a bias, each token's top-k of them softmaxed among themselves (in their dtype)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.moe.num_experts)
        self.bias = uninitialized(cfg.moe.num_experts)
        self.top_k = cfg.moe.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), both [T, top_k]."""
        logits, experts = torch.topk(nn.functional.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1), experts


class GptOssMoeBlock(HotPathModule):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        activation = ClampedSwiGLU(alpha=float(hf.get("swiglu_alpha", SWIGLU_ALPHA)),
                                   limit=float(hf.get("swiglu_limit", SWIGLU_LIMIT)))
        self.router = GptOssRouter(cfg)
        self.experts = Experts(cfg, cfg.moe, activation)
        self.tp = tensor_parallel_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.experts(x, *self.router(x)))  # (the ranks' partial sums: moe.Experts)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} is a mixture of experts, but its config has no num_local_experts")
        return GptOssMoeBlock(cfg)


def expert_tensors(prefix: str, projection: str, kind: str,
                   experts: Iterable[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Each expert's rows [out, ...] of a stacked tensor (weights [out, in], or biases [out]) under the names of its
    Linear layers' checkpoint tensors: gate_up's interleaved rows as gate_proj (even) and up_proj (odd)."""
    if projection == "down_proj":
        return [(f"{prefix}.{e}.down_proj.{kind}", rows) for e, rows in enumerate(experts)]
    return [(f"{prefix}.{e}.{proj}.{kind}", rows[first::2]) for e, rows in enumerate(experts)
            for proj, first in (("gate_proj", 0), ("up_proj", 1))]


class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._mxfp4_halves: dict[str, torch.Tensor] = {}  # an MXFP4 weight's blocks or scales, until the other comes

    def split_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as the (name, tensor) pairs `map_checkpoint_name` places (folio.loader.weights): a
        stacked expert tensor as each expert's gate_proj, up_proj and down_proj weights or biases (an MXFP4 one as
        each expert's rows of its blocks, or of its scales, where the experts keep MXFP4, else dequantised once both
        have come), a GGUF file's sinks as self_attn.sinks; any other tensor as it is."""
        if name.endswith(_GGUF_SINKS):
            return ((name[:-len(".weight")], tensor),)
        match = _EXPERTS_TENSOR.fullmatch(name)
        if match is None:
            return ((name, tensor),)
        prefix, projection, suffix = match.groups()
        if suffix == "_bias":
            return expert_tensors(prefix, projection, "bias", tensor)
        if suffix == "":  # Transformers' [E, in, out]
            return expert_tensors(prefix, projection, "weight", tensor.transpose(1, 2))
        if self._keeps_mxfp4(prefix):  # each expert's rows of the blocks, or of the scales, as they come
            return expert_tensors(prefix, projection, "weight" if suffix == "_blocks" else "weight_scale", tensor)
        other = name[:-len(suffix)] + ("_scales" if suffix == "_blocks" else "_blocks")
        if other not in self._mxfp4_halves:
            self._mxfp4_halves[name] = tensor
            return ()
        blocks, scales = (tensor, self._mxfp4_halves.pop(other)) if suffix == "_blocks" else \
            (self._mxfp4_halves.pop(other), tensor)
        try:  # expert by expert: the float32 intermediates of one at a time
            weights = [mxfp4.dequantize(b, s) for b, s in zip(blocks, scales, strict=True)]
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r} {e}") from None
        return expert_tensors(prefix, projection, "weight", weights)

    def _keeps_mxfp4(self, prefix: str) -> bool:
        """Whether the experts under this checkpoint prefix keep their MXFP4 blocks (their layers' method is
        mxfp4_linear's, chosen where its kernel builds), or load them dequantised."""
        param, _ = self.map_checkpoint_name(f"{prefix}.0.down_proj.weight")
        return isinstance(self.get_submodule(param.rsplit(".", 1)[0]).method, Mxfp4LinearMethod)
