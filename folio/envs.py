"""folio's environment variables: the one module that reads them, each with what it does.

Each is a function, read at the call, so a variable set after import (a test, a launcher) still counts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def cache_dir() -> Path:
    """FOLIO_CACHE_DIR: where built C++ kernels and GGUF files converted to tensors are kept
    (default ~/.cache/folio)."""
    return Path(os.environ.get("FOLIO_CACHE_DIR") or Path.home() / ".cache" / "folio")


def disable_cpu_kernels() -> bool:
    """FOLIO_DISABLE_CPU_KERNELS=1: build no C++ kernel; every caller runs its torch reference code."""
    return os.environ.get("FOLIO_DISABLE_CPU_KERNELS") == "1"


def attention_backend() -> Optional[str]:
    """FOLIO_ATTENTION_BACKEND=cpu_paged|torch_sdpa: force an attention backend (unset: the fastest that works)."""
    return os.environ.get("FOLIO_ATTENTION_BACKEND") or None


def configure_logging() -> bool:
    """FOLIO_CONFIGURE_LOGGING=0: leave logging to the application (no handler on the "folio" logger)."""
    return os.environ.get("FOLIO_CONFIGURE_LOGGING", "1") != "0"


def logging_level() -> Optional[str]:
    """FOLIO_LOGGING_LEVEL: the "folio" logger's level. Unset: INFO, and the terminal commands other than
    `folio serve` quiet it to WARNING so that their output stands alone."""
    return os.environ.get("FOLIO_LOGGING_LEVEL")


def api_key() -> Optional[str]:
    """FOLIO_API_KEY: the key `folio serve` requires and `folio bench serve` sends (unset: none)."""
    return os.environ.get("FOLIO_API_KEY")
