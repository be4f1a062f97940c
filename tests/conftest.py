"""Shared fixtures: tiny random-weight models built locally with transformers, and a tiny trained tokenizer.

Nothing is downloaded: every model is config -> random weights -> save_pretrained into a temp folder.
"""

from __future__ import annotations

import contextlib
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 512
EOS_ID = 2

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time there was a little engine that could serve many requests at once.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Paged attention keeps the KV cache in fixed-size blocks; continuous batching fills every step.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u65e5\u672c\u8a9e \U0001F600 0123456789 hello world",
]


def write_tokenizer(folder: str) -> None:
    """Train a small byte-level BPE (vocab <= VOCAB) and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML}, f)


ARCH_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {"sliding_window": None, "pad_token_id": 0}),
    "mixtral": ("MixtralConfig", {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 0]}),  # layers 1, 3: NoPE
    # Granite's scalars far from 1 (a softmax scale 0.05 against head_dim ** -0.5 = 0.25; logits divided by 3)
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "attention_multiplier": 0.05, "logits_scaling": 3.0}),
    # ERNIE 4.5: a head_dim (32) that is not hidden_size / heads (16), as the released 128 against 64
    "ernie4_5": ("Ernie4_5Config", {"head_dim": 32}),
    # ERNIE 4.5 MoE: dense ERNIE's 32-wide heads; layers 1 and 3 sparse (from moe_layer_start_index 1, every 2nd),
    # six experts of 32 (two a token) and two shared ones (an MLP of 64); build_tiny_model gives the routers a
    # correction bias that changes their choices
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"head_dim": 32, "num_hidden_layers": 4, "moe_layer_interval": 2,
                                            "moe_num_experts": 6, "moe_k": 2, "moe_intermediate_size": 32,
                                            "moe_num_shared_experts": 2}),
    # EXAONE 4: an 8-token window on layers 0-2 (with RoPE), layer 3 global (NoPE), by sliding_window_pattern 4
    "exaone4": ("Exaone4Config", {"num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4}),
    # Granite MoE: the same scalars, four experts of 32 (two a token); the shared variant adds an MLP of 48
    "granitemoe": ("GraniteMoeConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                        "attention_multiplier": 0.05, "logits_scaling": 3.0, "intermediate_size": 32,
                                        "num_local_experts": 4, "num_experts_per_tok": 2}),
    "granitemoeshared": ("GraniteMoeSharedConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                                    "attention_multiplier": 0.05, "logits_scaling": 3.0,
                                                    "intermediate_size": 32, "num_local_experts": 4,
                                                    "num_experts_per_tok": 2, "shared_intermediate_size": 48}),
    # GLM: half of each 16-wide head rotates, in interleaved pairs; q/k/v biases (GLM-4 adds sandwich norms)
    "glm": ("GlmConfig", {"head_dim": 16}),
    "glm4": ("Glm4Config", {"head_dim": 16}),
    # OLMo 2: post-norm blocks, q/k norms over the whole projections; OLMo 3 adds a 6-token window on layer 0 (the
    # prompts are longer) with a RoPE of its own, and YaRN on the full layer only
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
                              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                                  "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                                     "factor": 4.0,
                                                                     "original_max_position_embeddings": 128}}}),
    # GPT-OSS: four experts of 32 (two a token), 16-wide heads, an 8-token window on layer 0 (the prompts are longer),
    # a swiglu_limit (0.5) that the random weights' gates and ups pass, attention sinks
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8,
                                 "intermediate_size": 32, "swiglu_limit": 0.5,
                                 "layer_types": ["sliding_attention", "full_attention"]}),
    # Command-R: parallel blocks, LayerNorms, interleaved RoPE, logits times logit_scale (per test: q/k norms)
    "cohere": ("CohereConfig", {}),
    # Command R7B's layout: an 8-token window on layers 0-2 (with RoPE), layer 3 global (NoPE), by the pattern 4
    "cohere2": ("Cohere2Config", {"num_hidden_layers": 4, "sliding_window": 8}),
}


def runs_float32_int16_codes(llm) -> bool:
    """Whether quantised layers of the engine's model run a float32 column-block kernel (int4 or int8 weights, AVX2
    CPUs without AVX-512), which rounds each row of x to 16-bit codes: logprobs then agree with float x's to a few
    1e-4 relative, not to float32 summation order."""
    return any(getattr(m, "int4_blocks", None) is not None or getattr(m, "int8_blocks", None) is not None
               for m in llm.llm_engine.runner.model.modules())


def build_tiny_model(folder: str, arch: str = "llama", tie: bool = False, seed: int = 0, **overrides) -> str:
    """A 2-layer random model of the given architecture, saved as a Hugging Face folder (float32)."""
    import transformers

    cls_name, extra = ARCH_CONFIGS[arch]
    defaults = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                    bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0, initializer_range=0.2)
    cfg = getattr(transformers, cls_name)(**{**defaults, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # Qwen2 has q/k/v biases; make them non-zero so that loading them is tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.2)
    if arch == "ernie4_5_moe":  # Transformers initialises the routers' correction bias to zeros: the test needs one
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.moe_statics.e_score_correction_bias.data.normal_(0, 0.3)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Returns build(arch, tie=False) -> folder, caching each built model for the whole session."""
    cache: dict[tuple, str] = {}

    def build(arch: str = "llama", tie: bool = False) -> str:
        key = (arch, tie)
        if key not in cache:
            cache[key] = build_tiny_model(str(tmp_path_factory.mktemp(f"{arch}{'-tied' if tie else ''}")), arch, tie)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def llama_dir(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llama_server(llama_dir):
    """A real server on the tiny llama with the default engine settings, one per test module."""
    from server_fixture import running_server

    with running_server(llama_dir) as server:
        yield server


@pytest.fixture
def isolated_gguf_cache(tmp_path, monkeypatch):
    """GGUF conversions go to a fresh cache per test; the built C++ kernels are shared (rebuilding them takes
    minutes)."""
    from folio import envs

    kernels = envs.cache_dir() / "torch_extensions"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "torch_extensions").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path / "cache"))


@contextlib.contextmanager
def prior_step_costs():
    """Speculation's policy learns what a step costs from this machine's timings. Tests that check that drafts
    get accepted must not hang on a noisy moment (a kernel built during a step, a loaded machine), so there the
    policy keeps its prior costs (a weight-bound step: guesses nearly free). The policy's own tests feed it
    costs explicitly."""
    from folio.spec_decode.speculator import Speculator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Speculator, "observe_step", lambda self, num_tokens, seconds: None)
        yield


@pytest.fixture
def steps_cost_the_prior():
    with prior_step_costs():
        yield


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client of the module's `server` fixture."""
    with server.http() as client:
        yield client


def hf_greedy(folder: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy continuation (the oracle), cut after EOS as an engine would stop."""
    return hf_greedy_logprobs(folder, prompt_ids, max_new_tokens)[0]


def hf_greedy_logprobs(folder: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """hf_greedy's tokens and the logprob of each, as generate computed it step by step: a finer check than the
    tokens where a tiny random model's argmax hardly moves (with a dynamic RoPE, a single forward over the whole
    sequence would rotate it for its full length instead)."""
    model = _hf_model(folder)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS_ID, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    tokens = tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens
    return tokens, [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(out.logits, tokens)]


_HF_MODELS: dict[str, object] = {}


def _hf_model(folder: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if folder not in _HF_MODELS:
        # multimodal checkpoints that AutoModelForCausalLM does not map (Mistral 3) generate text all the same
        causal = AutoConfig.from_pretrained(folder).model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        auto = AutoModelForCausalLM if causal else AutoModelForImageTextToText
        _HF_MODELS[folder] = auto.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF_MODELS[folder]


def hf_logprobs(folder: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of Transformers' logits at every position of ids: [len(ids), V]."""
    with torch.no_grad():
        logits = _hf_model(folder)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
