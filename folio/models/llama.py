"""The Llama decoder family: Llama, Mistral and Qwen2 (Qwen2 = Llama with q/k/v biases); Mistral 3's multimodal
checkpoints (Mistral Small 3.1 and 3.2, Magistral, Devstral) serve their Mistral language model, text in and out.

The model works on the flattened batch: [num_tokens] ids and positions in, [num_tokens, hidden] out.
Q, K and V come from one fused matmul, gate and up from another; checkpoints keep their separate
Hugging Face tensors, which load as shards of the fused layers (`map_checkpoint_name`). The model declares
its linear layers' shapes only: how they store weights and compute is bound later (folio.models.linear).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from folio.attention.backend import AttentionBackend, AttentionParams
from folio.models.hot_path import HotPathModule
from folio.models.layers import RMSNorm, RotaryEmbedding
from folio.models.linear import Linear
from folio.models.model_config import ModelConfig
from folio.models.recurrent_state import RecurrentStep
from folio.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from folio.models.weight_loader import ShardId


@dataclass
class StepContext:
    """What every attention layer needs for one step: the backend, its per-step metadata (one per KV cache group:
    a layer's cache names its group, folio.attention.backend.LayerKVCache), the paged cache; and what a hybrid
    model's recurrent layers need: their states and the step's rows of them (folio.models.recurrent_state)."""

    backend: AttentionBackend
    metadata: list[Any]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    recurrent: Optional[RecurrentStep] = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               params: AttentionParams) -> torch.Tensor:
        kv_cache = self.kv_caches[layer_idx]
        return self.backend.forward(q, k, v, kv_cache, self.metadata[getattr(kv_cache, "group", 0)], params)


class LlamaAttention(HotPathModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                               bias=cfg.attention_bias, parallel="column",
                               shard_replicas={"k": cfg.kv_head_replicas, "v": cfg.kv_head_replicas})
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, parallel="row")
        self.rotary = rotary
        self.attn_params = AttentionParams(sliding_window=cfg.sliding_window(layer_idx))  # Mistral's window

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for architectures that normalise q and k per head before RoPE (Qwen3)."""
        return q, k

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        # per head, in one view and one split (each Python-level torch call costs microseconds at decode)
        q, k, v = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim).split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], 1)
        q, k = self.normalize_qk(q, k)
        q, k = self.rotary(positions, q, k)
        out = ctx.attend(self.layer_idx, q, k, v, self.attn_params)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(HotPathModule):
    swiglu = True  # gate_up_proj's output is SiLU-and-mul's (Linear's silu_and_mul); GeGLU models set False

    def __init__(self, cfg: ModelConfig, intermediate_size: Optional[int] = None, reduce_results: bool = True) -> None:
        """reduce_results=False: under tensor parallelism the output is this rank's partial sum, which the owner
        adds up (a mixture of experts' block, once for all its experts)."""
        super().__init__()
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, {0: size, 1: size}, silu_and_mul=self.swiglu, parallel="column")
        self.down_proj = Linear(size, cfg.hidden_size, bias=False, parallel="row", reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(HotPathModule):
    attention_cls = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx, rotary)
        self.mlp = self.make_mlp(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Hook for architectures whose feed-forward differs (mixture-of-experts layers: folio.models.moe)."""
        return LlamaMLP(cfg)

    def forward(self, positions, x, residual, ctx: StepContext):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# A multimodal checkpoint (folio.models.model_config.LANGUAGE_MODELS) nests its language model under one of the
# decoder prefixes (Transformers 5 writes model.language_model.*, older versions language_model.model.* and
# language_model.lm_head); the tensors of its vision tower and projector are not served.
DECODER_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def checkpoint_target(name: str, stacked_params: dict[str, tuple[str, ShardId]],
                      tie_word_embeddings: bool) -> Optional[tuple[str, ShardId]]:
    """A checkpoint tensor's place: (parameter name, shard id of a fused layer), or None for what is not loaded
    (rotary tables, a tied lm_head, a multimodal checkpoint's vision tower and projector)."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    name = next((name[len(p):] for p in DECODER_PREFIXES if name.startswith(p)), name)
    if "rotary_emb" in name or (name == "lm_head.weight" and tie_word_embeddings):
        return None
    for part, (fused, shard_id) in stacked_params.items():
        if f".{part}." in name:
            return name.replace(part, fused), shard_id
    return name, None


class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer
    rotary_cls = RotaryEmbedding  # GLM rotates interleaved pairs (layers.InterleavedRotaryEmbedding)
    # checkpoint tensor name fragment -> (fused parameter fragment, shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        activation = cfg.hf_config.get("hidden_act", "silu")  # (GPT-OSS's experts have their own: moe.Experts)
        if activation != "silu":  # the MLPs compute SiLU(gate) * up whatever the config says: refuse the others
            raise ValueError(f"{cfg.architecture}: hidden_act {activation!r} is not supported (supported: 'silu')")
        self.config = cfg
        rotary = self.rotary_cls.for_model(cfg, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size,
                                      tied_to=self.embed_tokens.weight if cfg.tie_word_embeddings else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hook for architectures that scale the embeddings before the first layer (Granite)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax(compute_logits(hidden), dim=-1), int64: the head's method may skip writing the logits."""
        return self.lm_head.argmax(hidden)

    def map_checkpoint_name(self, name: str) -> Optional[tuple[str, ShardId]]:
        """Where a checkpoint tensor (Hugging Face name) goes: (parameter name, shard id), or None to skip it."""
        return checkpoint_target(name, self.stacked_params, self.config.tie_word_embeddings)
