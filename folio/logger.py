"""folio's log setup: INFO lines on stderr by default, as vLLM does, so that start-up facts (KV cache size,
maximum concurrency, load time) are seen. FOLIO_CONFIGURE_LOGGING=0 leaves logging to the application;
FOLIO_LOGGING_LEVEL sets the level."""

from __future__ import annotations

import logging

from folio import envs


def configure_logging() -> None:
    logger = logging.getLogger("folio")
    if not envs.configure_logging() or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel((envs.logging_level() or "INFO").upper())
    logger.propagate = False
