"""Architecture name (config.json `architectures`) -> model class. Adding a model = one file + one line here."""

from __future__ import annotations

from torch import nn

from folio.models.cohere import CohereForCausalLM
from folio.models.cohere2 import Cohere2ForCausalLM
from folio.models.deepseek_v2 import DeepseekV2ForCausalLM
from folio.models.ernie4_5 import Ernie4_5ForCausalLM
from folio.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from folio.models.exaone4 import Exaone4ForCausalLM
from folio.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from folio.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from folio.models.glm4_moe import Glm4MoeForCausalLM
from folio.models.granite import GraniteForCausalLM
from folio.models.gpt_oss import GptOssForCausalLM
from folio.models.granite_moe import GraniteMoeForCausalLM
from folio.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from folio.models.lfm2 import Lfm2ForCausalLM
from folio.models.lfm2_moe import Lfm2MoeForCausalLM
from folio.models.llama import LlamaForCausalLM
from folio.models.mixtral import MixtralForCausalLM
from folio.models.model_config import LANGUAGE_MODELS, ModelConfig
from folio.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
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
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeForCausalLM,  # the shared MLP: shared_intermediate_size
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,  # Granite 4.0-H: Mamba2 and attention layers
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,  # the router differs by its config (HF_DEFAULTS)
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
}
# multimodal checkpoints (Gemma 3, Mistral 3): their language model's class, text in and text out
MODEL_CLASSES.update({arch: MODEL_CLASSES[text_arch] for arch, (text_arch, _) in LANGUAGE_MODELS.items()})


def check_supported(architecture: str) -> None:
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported model architecture {architecture!r}; folio supports {', '.join(MODEL_CLASSES)}")


def build_model(cfg: ModelConfig, max_positions: int) -> nn.Module:
    check_supported(cfg.architecture)
    return MODEL_CLASSES[cfg.architecture](cfg, max_positions)
