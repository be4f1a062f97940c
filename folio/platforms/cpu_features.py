"""The CPU's feature flags, read once from /proc/cpuinfo: the default dtype and the kernel build key both
depend on them, and they cannot change while the process runs."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> str:
    """The feature flags line of /proc/cpuinfo ('flags' on x86, 'Features' on Arm), space-separated in the
    kernel's order; "" where there is none (another OS, a sandbox)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def has_fast_bf16() -> bool:
    """AMX or AVX512-BF16 make bf16 matmuls fast; without them bf16 is emulated and slower than fp32."""
    return not {"amx_bf16", "avx512_bf16"}.isdisjoint(cpu_flags().split())


def has_amx() -> bool:
    """AMX-BF16 tiles, which oneDNN's bf16 GEMMs use."""
    return "amx_bf16" in cpu_flags().split()


def has_amx_int8() -> bool:
    """AMX-INT8 tiles, which oneDNN's int8 GEMMs use."""
    return "amx_int8" in cpu_flags().split()


def has_avx512_vnni() -> bool:
    """AVX512-VNNI (vpdpbusd: 64 int8 products an instruction), which oneDNN's int8 GEMMs use without AMX."""
    return "avx512_vnni" in cpu_flags().split()
