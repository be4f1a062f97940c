"""Architecture name (config.json `architectures`) -> model class. Adding a model = one file + one line here."""

from __future__ import annotations

from torch import nn

from folio.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from folio.models.llama import LlamaForCausalLM
from folio.models.model_config import ModelConfig
from folio.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its language model: text in, text out
}


def check_supported(architecture: str) -> None:
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported model architecture {architecture!r}; folio supports {', '.join(MODEL_CLASSES)}")


def build_model(cfg: ModelConfig, max_positions: int) -> nn.Module:
    check_supported(cfg.architecture)
    return MODEL_CLASSES[cfg.architecture](cfg, max_positions)
