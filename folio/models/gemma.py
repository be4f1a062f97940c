"""Gemma 1, 2 and 3 (text): the Llama decoder with Gemma's changes, as Transformers computes them.

  * embeddings scaled by sqrt(hidden_size), the factor rounded to the model's dtype first;
  * RMSNorm multiplies by (1 + weight), in float32 before the one rounding to the model's dtype: the
    parameter keeps 1 + weight in float32 (`GemmaRMSNorm`), computed as it loads;
  * four norms per layer: before attention, after it (before the residual add), before and after the MLP
    (Gemma 1: Llama's two, before attention and before the MLP);
  * GeGLU: gelu (tanh approximation) of the gate times the up projection;
  * attention scaled by query_pre_attn_scalar ** -0.5 (Gemma 1: head_dim ** -0.5); local layers see a sliding
    window (Gemma 2: every other layer, Gemma 3: five of every six, or as layer_types says; Gemma 1: none),
    global layers the whole context;
  * final logits soft-capped (cap * tanh(x / cap)) where the config says so (Gemma 2: 30), and in Gemma 2
    the attention scores too (50; Gemma 3's attention ignores attn_logit_softcapping, as Transformers' does;
    Gemma 1 soft-caps nothing);
  * Gemma 3: an RMSNorm over each head of q and k before RoPE, and RoPE bases of their own for local
    (rope_local_base_freq, 10k) and global layers (rope_theta, 1M, scaled linearly on the larger models).

Gemma 1 (gemma-2b/7b, gemma-1.1, CodeGemma) reads its activation from hidden_act, where the "gelu" of its first
config.json files means the tanh approximation (Transformers' GemmaConfig). Gemma3ForConditionalGeneration
checkpoints load their language model only (text in, text out; the vision tower's tensors are skipped).
EmbeddingGemma's bidirectional attention is not supported.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from folio.attention.backend import AttentionParams
from folio.models.hot_path import HotPathModule
from folio.models.layers import RotaryEmbedding
from folio.models.linear import Linear
from folio.models.llama import LlamaAttention, LlamaMLP, StepContext, checkpoint_target
from folio.models.model_config import ModelConfig
from folio.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from folio.models.weight_loader import ShardId, copy_checked, set_weight_loader, uninitialized
from folio.sample.sampling_ops import argmax_rows

GELU_TANH = ("gelu_pytorch_tanh",)
GEMMA1_GELU_TANH = ("gelu_pytorch_tanh", "gelu")  # GemmaConfig reads Gemma 1's legacy "gelu" as the tanh GELU


def _load_one_plus(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
    if shard_id is not None:
        raise ValueError(f"is given as shard {shard_id!r} of a parameter that has no shards")
    copy_checked(param.data, 1.0 + tensor.float())


class GemmaRMSNorm(HotPathModule):
    """x * rsqrt(mean(x^2) + eps) * (1 + w) in float32, rounded once to x's dtype. `weight` holds 1 + w in
    float32 whatever the model's dtype: it loads as the checkpoint's w plus one (Transformers' own sum)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = uninitialized(size, dtype=torch.float32)
        set_weight_loader(self.weight, _load_one_plus, (None,))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's softmax scale (query_pre_attn_scalar), window, soft-cap (Gemma 2), q/k
    norms (Gemma 3) and an o_proj bias where q/k/v have one."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool,
                 softcap: Optional[float]) -> None:
        super().__init__(cfg, layer_idx, rotary)
        if cfg.attention_bias:
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=True, parallel="row")
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn_params = AttentionParams(scale=self.softmax_scale(cfg),
                                           sliding_window=cfg.sliding_window(layer_idx), logit_softcap=softcap)

    def softmax_scale(self, cfg: ModelConfig) -> float:
        return float(cfg.hf_config["query_pre_attn_scalar"]) ** -0.5

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (q, k) if self.q_norm is None else (self.q_norm(q), self.k_norm(k))


class GemmaMLP(LlamaMLP):
    """Llama's MLP with GeGLU (tanh-approximated GELU) instead of SwiGLU."""

    swiglu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(HotPathModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool,
                 softcap: Optional[float]) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer_idx, rotary, qk_norm, softcap)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x), ctx)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma1Attention(GemmaAttention):
    """Gemma 1 has no query_pre_attn_scalar (Transformers ignores one in its config.json): the usual scale."""

    def softmax_scale(self, cfg: ModelConfig) -> float:
        return self.head_dim ** -0.5


class Gemma1DecoderLayer(HotPathModule):
    """Llama's pre-norm layer with Gemma's norms, attention and GeGLU. post_attention_layernorm is, as Llama's,
    the norm before the MLP (Gemma 2's of that name normalises the attention's output)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool,
                 softcap: Optional[float]) -> None:
        super().__init__()
        self.self_attn = Gemma1Attention(cfg, layer_idx, rotary, qk_norm, softcap)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma2ForCausalLM(nn.Module):
    layer_cls = GemmaDecoderLayer
    qk_norm = False  # Gemma 3 normalises q and k per head
    local_rope = False  # Gemma 3's local layers have a RoPE base of their own
    attn_softcap = True  # Gemma 3 does not soft-cap attention scores, whatever attn_logit_softcapping says
    logit_softcap = True  # Gemma 1 soft-caps nothing
    activation_fields = ("hidden_activation", "hidden_act")  # the config's activation: the first one set
    activations = GELU_TANH
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        hf = cfg.hf_config
        activation = next((hf[field] for field in self.activation_fields if hf.get(field)), None)
        if activation not in self.activations:
            raise ValueError(f"{cfg.architecture} with {self.activation_fields[0]} {activation!r} is not supported "
                             f"(supported: {', '.join(self.activations)})")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{cfg.architecture} with use_bidirectional_attention (EmbeddingGemma) is not supported")
        self.config = cfg
        rotary = RotaryEmbedding.for_model(cfg, max_positions, cfg.rope_theta, cfg.rope_scaling)
        local = rotary
        if self.local_rope:
            local = RotaryEmbedding.for_model(cfg, max_positions, float(hf["rope_local_base_freq"]),
                                              hf.get("rope_local_scaling"))
        cap = hf.get("attn_logit_softcapping") if self.attn_softcap else None
        softcap = None if cap is None else float(cap)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        self._embed_scales: dict[torch.dtype, torch.Tensor] = {}  # the scale rounded to each dtype, made once
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, i, local if cfg.sliding_window(i) is not None else rotary, self.qk_norm, softcap)
            for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size,
                                      tied_to=self.embed_tokens.weight if cfg.tie_word_embeddings else None)
        cap = hf.get("final_logit_softcapping") if self.logit_softcap else None
        self.final_logit_softcap = None if cap is None else float(cap)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        scale = self._embed_scales.get(x.dtype)
        if scale is None:  # rounded to the model's dtype first, as Transformers rounds it
            scale = self._embed_scales[x.dtype] = torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        x = x * scale
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax(compute_logits(hidden), dim=-1), int64. Soft-capping is monotonic, but its rounding may tie
        logits the head ranked apart, so capped logits are computed whole."""
        if self.final_logit_softcap is not None:
            return argmax_rows(self.compute_logits(hidden))
        return self.lm_head.argmax(hidden)

    def map_checkpoint_name(self, name: str) -> Optional[tuple[str, ShardId]]:
        """Where a checkpoint tensor (Hugging Face name) goes: (parameter name, shard id), or None to skip it."""
        return checkpoint_target(name, self.stacked_params, self.config.tie_word_embeddings)


class GemmaForCausalLM(Gemma2ForCausalLM):
    """Gemma 1: Gemma 2's model with two norms a layer, no soft-caps and no sliding window."""

    layer_cls = Gemma1DecoderLayer
    attn_softcap = False
    logit_softcap = False
    activation_fields = ("hidden_act",)
    activations = GEMMA1_GELU_TANH


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    local_rope = True
    attn_softcap = False
