"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config.json dict.

GGUF files are translated into the same dict shape by the GGUF loader, so there is one parser for both.
We read config.json with the json module rather than transformers' AutoConfig: that costs milliseconds
instead of seconds and keeps transformers off the serving path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from folio.models.rope_scaling import SUPPORTED as SUPPORTED_ROPE_TYPES, rope_type


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts of a config.json (Mixtral's num_local_experts, ERNIE 4.5's moe_num_experts, DeepSeek's
    n_routed_experts, the others' num_experts); 0: dense."""
    return int(cfg.get("num_local_experts") or cfg.get("moe_num_experts") or cfg.get("num_experts")
               or cfg.get("n_routed_experts") or 0)


def ernie_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5's mixture-of-experts fields (Transformers' Ernie4_5_MoeConfig) under the names the others use, so
    that one parser reads them all: moe_k of the experts a token, always renormalised (folio.models.ernie4_5_moe
    floors the sum at moe_norm_min); moe_num_shared_experts shared experts of moe_intermediate_size each, which run
    as one MLP of their total size; sparse layers every moe_layer_interval-th (by (i + 1) % interval, as
    Transformers counts) from moe_layer_start_index to moe_layer_end_index (-1: the last), dense MLPs elsewhere."""
    layers = int(cfg["num_hidden_layers"])
    start, end = int(cfg["moe_layer_start_index"]), int(cfg["moe_layer_end_index"])
    end = layers - 1 if end == -1 else end
    return {"num_experts_per_tok": cfg["moe_k"], "norm_topk_prob": True,
            "decoder_sparse_step": cfg["moe_layer_interval"],
            "shared_expert_intermediate_size": int(cfg["moe_num_shared_experts"]) * int(cfg["moe_intermediate_size"]),
            "mlp_only_layers": [i for i in range(layers) if not start <= i <= end]}


@dataclass
class MoEConfig:
    """The mixture-of-experts facts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, GPT-OSS and ERNIE 4.5 MoE
    configs (folio.models.moe)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's / Granite MoE's / ERNIE's always-on expert, 0: none
    decoder_sparse_step: int = 1  # every n-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... but these stay dense

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Optional["MoEConfig"]:
        experts = num_experts(cfg)
        if not experts:
            return None
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"clip_qkv={cfg['clip_qkv']} (OLMoE's q/k/v clamping) is not supported")
        if int(cfg.get("moe_layer_freq") or 1) != 1:
            raise ValueError(f"moe_layer_freq={cfg['moe_layer_freq']} (DeepSeek's sparse layers at intervals) is not "
                             "supported (supported: 1)")
        mixtral = cfg.get("model_type") == "mixtral" or "MixtralForCausalLM" in (cfg.get("architectures") or ())
        if "Ernie4_5_MoeForCausalLM" in (cfg.get("architectures") or ()):
            cfg = {**cfg, **ernie_moe_fields(cfg)}
        intermediate = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        return cls(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                   # OLMoE's and Mixtral's experts have intermediate_size; Qwen's have their own
                   intermediate_size=intermediate,
                   norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
                   # Qwen2-MoE's gated shared expert, Granite MoE's ungated shared MLP, or DeepSeek's n_shared_experts
                   # experts' worth of one ungated MLP
                   shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size")
                                                       or cfg.get("shared_intermediate_size")
                                                       or int(cfg.get("n_shared_experts") or 0) * intermediate),
                   decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                   # Qwen's dense layers by index, or DeepSeek's first first_k_dense_replace layers
                   mlp_only_layers=tuple(cfg.get("mlp_only_layers") or range(int(cfg.get("first_k_dense_replace")
                                                                                     or 0))))


# Fields a config.json may leave out, as Transformers' config classes default them (Gemma 3's multimodal
# checkpoints keep little more than the sizes in their text_config).
_GEMMA_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "vocab_size": 256000, "max_position_embeddings": 8192,
                          "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072,
                          "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6},
    "MistralForCausalLM": {"sliding_window": 4096},
    # Transformers' GemmaConfig (Gemma 1: config.json files of its time leave tying out), Ernie4_5Config (a head_dim
    # that is not hidden_size / heads) and Exaone4Config (hybrid attention unless sliding_window is null)
    "GemmaForCausalLM": {"head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "Ernie4_5ForCausalLM": {"head_dim": 128, "tie_word_embeddings": True},
    "Exaone4ForCausalLM": {"sliding_window": 4096, "sliding_window_pattern": 4},
    # Ernie4_5_MoeConfig's (ERNIE-4.5-21B-A3B's sizes, every layer but the first sparse)
    "Ernie4_5_MoeForCausalLM": {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "moe_num_experts": 64, "moe_k": 6,
                                "moe_intermediate_size": 1536, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                                "moe_layer_end_index": -1, "moe_layer_interval": 1, "moe_norm_min": 1e-12},
    "Olmo2ForCausalLM": {"rms_norm_eps": 1e-5},
    "Lfm2ForCausalLM": {"tie_word_embeddings": True, "conv_L_cache": 3},
    # Lfm2MoeConfig's (LFM2-8B-A1B's router: sigmoid scores, a bias that chooses, renormalised, unscaled)
    "Lfm2MoeForCausalLM": {"tie_word_embeddings": True, "conv_L_cache": 3, "num_dense_layers": 2, "num_experts": 32,
                           "num_experts_per_tok": 4, "moe_intermediate_size": 1792, "use_expert_bias": True,
                           "norm_topk_prob": True, "routed_scaling_factor": 1.0},
    # Transformers' GraniteMoeHybridConfig (its Mamba2 layers' sizes, and eight experts unless the file says 0)
    "GraniteMoeHybridForCausalLM": {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
                                    "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2,
                                    "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
                                    "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024},
    # DeepSeek V2 and V3 (Transformers' configs, and the router fields their config.json files state), GLM-4.5 MoE
    "DeepseekV2ForCausalLM": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                              "v_head_dim": 128, "n_shared_experts": 2, "moe_intermediate_size": 1407,
                              "topk_method": "greedy", "scoring_func": "softmax"},
    "DeepseekV3ForCausalLM": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                              "v_head_dim": 128, "n_shared_experts": 1, "moe_intermediate_size": 2048,
                              "num_experts_per_tok": 8, "n_routed_experts": 256, "first_k_dense_replace": 3,
                              "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                              "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "Glm4MoeForCausalLM": {"partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "n_shared_experts": 1,
                           "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_routed_experts": 128,
                           "first_k_dense_replace": 1, "norm_topk_prob": True, "topk_method": "noaux_tc",
                           "scoring_func": "sigmoid"},
    # Cohere's CohereConfig / Cohere2Config (Cohere 2: a window on three layers of every four)
    "CohereForCausalLM": {"layer_norm_eps": 1e-5, "logit_scale": 0.0625, "tie_word_embeddings": True},
    "Cohere2ForCausalLM": {"layer_norm_eps": 1e-5, "logit_scale": 0.0625, "tie_word_embeddings": True,
                           "sliding_window": 4096, "sliding_window_pattern": 4},
    # OLMo 3 (Transformers' Olmo3Config): a RoPE base of 500000 for both layer types; a legacy rope_theta (and
    # rope_scaling) is the full layers' only
    "Olmo3ForCausalLM": {"rms_norm_eps": 1e-5, "sliding_window": 4096, "rope_theta": 500_000.0,
                         "rope_local_base_freq": 500_000.0},
}
# RoPE bases of the architectures whose config classes default to another than 10000 (Transformers' default_theta):
# apart from HF_DEFAULTS, since a file may state its base in rope_parameters, where a default would shadow it.
DEFAULT_ROPE_THETA: dict[str, float] = {"CohereForCausalLM": 500_000.0, "Lfm2ForCausalLM": 1_000_000.0,
                                         "Lfm2MoeForCausalLM": 1_000_000.0}
# Multimodal architectures whose language model folio serves, text in and text out (the vision tower and projector
# are not served: folio.models.llama.checkpoint_target skips their tensors) -> the architecture of that language
# model, whose defaults, attention pattern and model class apply, and the model_type its text_config must declare
# (Ministral 3's checkpoints are Mistral 3's too, with a language model of its own that folio does not serve).
LANGUAGE_MODELS: dict[str, tuple[str, str]] = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "mistral"),
}
LAYER_TYPES = ("full_attention", "sliding_attention")
# layers that keep a recurrent state per request instead of K/V in the paged cache (folio.models.recurrent_state):
# LFM2's short convolutions, Granite 4.0-H's Mamba2 mixers
RECURRENT_LAYER_TYPES = ("conv", "mamba")
LFM2_ARCHITECTURES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")


def language_model_architecture(arch: str) -> str:
    """The architecture folio serves for a declared one: a multimodal one's language model, else itself."""
    return LANGUAGE_MODELS[arch][0] if arch in LANGUAGE_MODELS else arch


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a multimodal config's text_config (LANGUAGE_MODELS), with the language model's
    defaults for the fields it leaves out. Gemma 3's and OLMo 3's per-layer RoPE parameters become rope_theta /
    rope_scaling (global layers) and rope_local_base_freq / rope_local_scaling (sliding ones), whichever way the file
    writes them."""
    arch = ModelConfig.architecture_of(cfg)
    text_arch = language_model_architecture(arch)
    if arch in LANGUAGE_MODELS:
        inner = dict(cfg.get("text_config") or {})
        expected = LANGUAGE_MODELS[arch][1]
        if inner.get("model_type", expected) != expected:
            raise ValueError(f"{arch} with a {inner['model_type']!r} language model is not supported "
                             f"(supported: {expected!r})")
        inner["architectures"] = [arch]
        for key in ("bos_token_id", "eos_token_id"):
            if key in cfg:
                inner.setdefault(key, cfg[key])
        # the outer model owns the lm_head: Transformers ties it by the outer config's flag where the file has one
        if "tie_word_embeddings" in cfg:
            inner["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        cfg = inner
    cfg = {**HF_DEFAULTS.get(text_arch, {}), **cfg}
    if text_arch in LFM2_ARCHITECTURES:
        cfg.update(lfm2_fields(cfg, moe=text_arch == "Lfm2MoeForCausalLM"))
    if text_arch == "GraniteMoeHybridForCausalLM":
        cfg.update(granite_hybrid_fields(cfg))
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (folio.models.mla): the KV cache keeps one row a token
        cfg["num_key_value_heads"], cfg["head_dim"] = 1, int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
    if text_arch == "Olmo3ForCausalLM" and cfg.get("layer_types") is None:  # Olmo3Config: every 4th layer full
        cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                              for i in range(int(cfg.get("num_hidden_layers") or 0))]
    if text_arch in ("Gemma3ForCausalLM", "Olmo3ForCausalLM"):
        rope = cfg.pop("rope_parameters", None) or {}
        if "full_attention" in rope or "sliding_attention" in rope:  # Transformers 5: per layer type
            full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
            cfg["rope_theta"] = full.pop("rope_theta", cfg["rope_theta"])
            cfg["rope_local_base_freq"] = local.pop("rope_theta", cfg["rope_local_base_freq"])
            cfg["rope_scaling"], cfg["rope_local_scaling"] = full or None, local or None
        elif rope:
            cfg["rope_scaling"] = rope
    return cfg


def lfm2_fields(cfg: dict[str, Any], moe: bool) -> dict[str, Any]:
    """LFM2's fields (Transformers' Lfm2Config, Lfm2MoeConfig) under the common names: its layer types (LFM2's from
    the older full_attn_idxs where layer_types is absent; LFM2-MoE has no such fallback), its norms' epsilon, the
    older tie_embedding where a config.json has it (it wins, as in Transformers), and LFM2's MLP width as Lfm2MLP
    derives it (block_auto_adjust_ff_dim: two thirds of intermediate_size, times block_ffn_dim_multiplier, rounded
    up to block_multiple_of), so that tensor-parallel ranks split the width the checkpoint has. LFM2-MoE's dense
    MLPs have intermediate_size as it is, its first num_dense_layers layers are dense, and its router
    (folio.models.grouped_topk) takes sigmoid scores whose expert_bias, where use_expert_bias says so, chooses the
    experts (DeepSeek V3's noaux_tc, in one group)."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None and moe:
        raise ValueError("Lfm2MoeForCausalLM: the model config has no 'layer_types' (Lfm2MoeConfig has no default)")
    if types is None:
        full = cfg.get("full_attn_idxs")
        full = range(layers) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    fields = {"layer_types": types, "rms_norm_eps": cfg.get("norm_eps", 1e-5),
              "tie_word_embeddings": cfg.get("tie_embedding", cfg["tie_word_embeddings"])}
    if moe:
        return {**fields, "mlp_only_layers": list(range(int(cfg["num_dense_layers"]))), "scoring_func": "sigmoid",
                "topk_method": "noaux_tc" if cfg["use_expert_bias"] else "greedy"}
    size = int(cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier, multiple = cfg.get("block_ffn_dim_multiplier", 1.0), int(cfg.get("block_multiple_of", 256))
        if multiplier is not None:
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    return {**fields, "intermediate_size": size, "block_auto_adjust_ff_dim": False}


def granite_hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0-H's layer types under the common names: the released files' "mamba" and "attention" (in
    layer_types, or layers_block_type in older ones), which Transformers 5 writes "linear_attention" and
    "full_attention"; every layer a Mamba2 one where neither is given (Transformers' default)."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * int(cfg["num_hidden_layers"])
    names = {"attention": "full_attention", "linear_attention": "mamba"}
    return {"layer_types": [names.get(t, t) for t in types]}


def sliding_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[Optional[int], ...]:
    """Per layer, the sliding window its attention uses (None: full attention), as Transformers decides it
    (layer_types, or the pattern of `arch`, the language model's architecture); () when no layer slides."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):  # even layers slide
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        elif arch == "Gemma3ForCausalLM":  # five local layers to one global
            pattern = int(cfg.get("sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif arch == "Qwen2ForCausalLM":
            first = int(cfg.get("max_window_layers", 28)) if cfg.get("use_sliding_window") else num_layers
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # every layer (Phi-3-mini-4k: 2047)
            types = ["sliding_attention"] * num_layers
        # the pattern: 4 (every 4th global) or EXAONE 4's "LLLG"
        elif arch in ("Exaone4ForCausalLM", "Cohere2ForCausalLM") and window is not None:
            pattern = cfg.get("sliding_window_pattern") or 4
            slides = ([pattern[i % len(pattern)] == "L" for i in range(num_layers)] if isinstance(pattern, str)
                      else [(i + 1) % int(pattern) != 0 for i in range(num_layers)])
            types = ["sliding_attention" if s else "full_attention" for s in slides]
        else:
            return ()
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    unknown = sorted(set(types) - set(LAYER_TYPES) - set(RECURRENT_LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer type {unknown[0]!r} in layer_types (supported: "
                         f"{', '.join(LAYER_TYPES + RECURRENT_LAYER_TYPES)})")
    if window is None:
        return ()
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: Optional[dict[str, Any]] = None
    bos_token_id: Optional[int] = None
    partial_rotary_factor: float = 1.0
    moe: Optional[MoEConfig] = None
    kv_head_replicas: int = 1  # of a rank's slice (for_tensor_parallel): the ranks that keep each KV head
    # layers with a recurrent state per request and no K/V (layer_types' RECURRENT_LAYER_TYPES: LFM2's convolutions)
    recurrent_layers: tuple[int, ...] = ()
    # the KV cache's values are its keys: multi-head latent attention's one row a token (folio.models.mla)
    values_are_keys: bool = False

    @property
    def kv_cache_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V in the paged cache, in order: a layer's KV cache is its index in this list."""
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.recurrent_layers)

    @property
    def max_context(self) -> int:
        """The longest context the model handles: max_position_embeddings, times the factor of the scaling
        types that stretch it at run time (linear and dynamic; the others' checkpoints state the stretched
        length), as vLLM derives it."""
        if rope_type(self.rope_scaling) in ("linear", "dynamic"):
            return int(self.max_position_embeddings * float(self.rope_scaling["factor"]))
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """The leading channels of each head that RoPE rotates (Transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)
    # per layer: the sliding window of its attention, or None (full attention); () when no layer slides
    sliding_windows: tuple[Optional[int], ...] = ()
    # the (text) config.json dict with the architecture's defaults: architecture-specific fields come from here
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # a window no shorter than the context hides no key: full attention, which keeps the faster prefill path
        # and a single KV cache group (Phi-3.5's and Phi-4-mini's 262144 over a context of 131072)
        windows = tuple(None if w is not None and w >= self.max_context else w for w in self.sliding_windows)
        self.sliding_windows = windows if any(w is not None for w in windows) else ()

    def sliding_window(self, layer_idx: int) -> Optional[int]:
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    def for_tensor_parallel(self, size: int) -> "ModelConfig":
        """The config of one rank's slice of the model when `size` ranks split it (folio.distributed): its share of
        the attention heads, of the KV heads (one, where there are fewer than ranks) and of the intermediate columns
        of the MLP and of every expert; the rest whole (a mixture of experts' router too). A model built from it
        declares its layers at the rank's sizes (folio.models.linear: parallel layers)."""
        if size == 1:
            return self
        moe = self.moe
        sizes = {"num_attention_heads": self.num_attention_heads, "intermediate_size": self.intermediate_size}
        if moe is not None:
            sizes.update(moe_intermediate_size=moe.intermediate_size,
                         shared_expert_intermediate_size=moe.shared_expert_intermediate_size)
        for name, value in sizes.items():
            if value % size:
                raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} ({value})")
        if moe is not None:  # every rank keeps its columns of every expert (vLLM's tensor-parallel experts)
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // size,
                                      shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size)
        kv_heads = self.num_key_value_heads
        if kv_heads % size and size % kv_heads:
            raise ValueError(f"tensor_parallel_size {size} neither divides nor is a multiple of the model's "
                             f"num_key_value_heads ({kv_heads})")
        # fewer KV heads than ranks: each rank keeps one, shared by the ranks of its query heads (as vLLM does)
        return dataclasses.replace(self, num_attention_heads=self.num_attention_heads // size,
                                   num_key_value_heads=max(1, kv_heads // size),
                                   kv_head_replicas=max(1, size // kv_heads),
                                   intermediate_size=self.intermediate_size // size, moe=moe)

    @staticmethod
    def architecture_of(cfg: dict[str, Any]) -> str:
        """The architecture name a config.json declares (whether folio implements it is the registry's call)."""
        return (cfg.get("architectures") or [str(cfg.get("model_type"))])[0]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = cls.architecture_of(cfg)
        text_arch = language_model_architecture(arch)
        cfg = text_config(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            default_theta = DEFAULT_ROPE_THETA.get(text_arch, 10000.0)
            rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", default_theta)))
            kind = rope_type(rope)
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"{arch}: unsupported rope_scaling type {kind!r} "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            if kind in ("llama3", "yarn", "longrope"):  # Transformers' standardize_rope_params
                original = (cfg.get("original_max_position_embeddings")  # Phi-3 keeps it beside rope_scaling
                            or rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048))
                rope["original_max_position_embeddings"] = int(original)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases, Qwen2-MoE unless qkv_bias says not; Llama and Mistral only when
                # attention_bias says so.
                attention_bias=(text_arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
                                or (text_arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))),
                rope_scaling=rope if kind != "default" else None,
                bos_token_id=cfg.get("bos_token_id"),
                moe=MoEConfig.from_hf_dict(cfg),
                partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
                sliding_windows=sliding_windows(cfg, text_arch, int(cfg["num_hidden_layers"])),
                recurrent_layers=tuple(i for i, kind in enumerate(cfg.get("layer_types") or ())
                                       if kind in RECURRENT_LAYER_TYPES),
                values_are_keys=bool(cfg.get("kv_lora_rank")),
                hf_config=cfg,
            )
        except KeyError as e:
            raise ValueError(f"model config is missing the field {e.args[0]!r}") from e
