"""The platform folio runs on (folio.platforms.interface): the CPU today."""

from __future__ import annotations

import functools

from folio.platforms.interface import Platform


@functools.cache
def current_platform() -> Platform:
    """The platform of this process. A CUDA platform would be chosen here, when torch sees a GPU."""
    from folio.platforms.cpu import CpuPlatform

    return CpuPlatform()
