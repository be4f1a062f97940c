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


def has_avx512() -> bool:
    """AVX-512 F and BW, which the kernels' 16-lane paths need."""
    return {"avx512f", "avx512bw"} <= set(cpu_flags().split())


def has_avx512_vnni() -> bool:
    """AVX512-VNNI (vpdpbusd: 64 int8 products an instruction), which oneDNN's int8 GEMMs use without AMX."""
    return "avx512_vnni" in cpu_flags().split()


# (first model, last model) of each AMD family-25 generation: Zen 3 (Milan, Vermeer, Cezanne...) and Zen 4 (Genoa,
# Raphael, Phoenix...) share the family number
_ZEN4_MODELS_OF_FAMILY_25 = ((0x10, 0x1F), (0x60, 0x7F), (0x90, 0xAF))
# Intel family 6 server models whose matrix units differ
_INTEL_FAMILY_6 = {0x55: "Skylake/Cascade Lake", 0x6A: "Ice Lake", 0x6C: "Ice Lake", 0x8F: "Sapphire Rapids",
                   0xCF: "Emerald Rapids", 0xAD: "Granite Rapids", 0xAE: "Granite Rapids"}


def _generation(vendor: str, family: int, model: int) -> str:
    if vendor == "AuthenticAMD":
        if family == 26:
            return "Zen 5"
        if family == 25:
            return "Zen 4" if any(lo <= model <= hi for lo, hi in _ZEN4_MODELS_OF_FAMILY_25) else "Zen 3"
        if family == 23:
            return "Zen or Zen 2"
    if vendor == "GenuineIntel" and family == 6:
        return _INTEL_FAMILY_6.get(model, "")
    return ""


@functools.cache
def cpu_description() -> str:
    """The CPU as benchmarks print it next to their figures, which depend on it (`describe_cpu` of this machine's
    /proc/cpuinfo); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return describe_cpu(f.read())
    except OSError:
        return ""


def describe_cpu(cpuinfo: str) -> str:
    """Model name, family and model numbers with the generation they name where known (AMD's family 25 holds Zen 3
    and Zen 4, told apart by the model; 26 is Zen 5), and the features folio's kernels choose their paths by, from
    the first processor of a /proc/cpuinfo text; "" without an x86 entry."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's entry is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "cpu family" not in fields:
        return ""
    family, model = int(fields["cpu family"]), int(fields.get("model", "0"))
    generation = _generation(fields.get("vendor_id", ""), family, model)
    flags = fields.get("flags", "").split()
    features = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("amx_int8", "AMX-INT8"),
                                        ("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX512-VNNI"),
                                        ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags]
    if "amx_bf16" not in flags:
        features.append("no AMX")
    name = fields.get("model name", "unknown CPU")
    return f"{name} (family {family} model {model}{': ' + generation if generation else ''}), {', '.join(features)}"
