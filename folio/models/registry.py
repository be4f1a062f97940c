"""Architecture name (config.json `architectures`) -> model class. Adding a model = one file + one line here."""

from __future__ import annotations

from torch import nn

from folio.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from folio.models.granite import GraniteForCausalLM
from folio.models.llama import LlamaForCausalLM
from folio.models.mixtral import MixtralForCausalLM
from folio.models.model_config import LANGUAGE_MODELS, ModelConfig
from folio.models.olmoe import OlmoeForCausalLM
from folio.models.phi3 import Phi3ForCausalLM
from folio.models.qwen2_moe import Qwen2MoeForCausalLM
from folio.models.qwen3 import Qwen3ForCausalLM
from folio.models.qwen3_moe import Qwen3MoeForCausalLM
from folio.models.smollm3 import SmolLM3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
# multimodal checkpoints (Gemma 3, Mistral 3): their language model's class, text in and text out
MODEL_CLASSES.update({arch: MODEL_CLASSES[text_arch] for arch, (text_arch, _) in LANGUAGE_MODELS.items()})


def check_supported(architecture: str) -> None:
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported model architecture {architecture!r}; folio supports {', '.join(MODEL_CLASSES)}")


def build_model(cfg: ModelConfig, max_positions: int) -> nn.Module:
    check_supported(cfg.architecture)
    return MODEL_CLASSES[cfg.architecture](cfg, max_positions)
