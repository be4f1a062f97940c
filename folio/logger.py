"""folio's log setup: INFO lines on stderr by default, as vLLM does, so that start-up facts (KV cache size,
maximum concurrency, load time) are seen. FOLIO_CONFIGURE_LOGGING=0 leaves logging to the application;
FOLIO_LOGGING_LEVEL sets the level."""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    logger = logging.getLogger("folio")
    if os.environ.get("FOLIO_CONFIGURE_LOGGING", "1") == "0" or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("FOLIO_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
