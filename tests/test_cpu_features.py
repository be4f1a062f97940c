"""The CPU description benchmarks print with their figures (folio.platforms.cpu_features.describe_cpu)."""

from __future__ import annotations

import pytest

from folio.platforms.cpu_features import cpu_description, describe_cpu


def _cpuinfo(vendor: str, family: int, model: int, name: str, flags: str) -> str:
    entry = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n" \
            f"model name\t: {name}\nflags\t\t: {flags}\n\n"
    return entry + entry.replace("processor\t: 0", "processor\t: 1")


@pytest.mark.parametrize("vendor,family,model,flags,want", [
    ("AuthenticAMD", 26, 2, "fpu avx2 avx512f avx512_bf16 avx512_vnni",
     "AMD EPYC (family 26 model 2: Zen 5), AVX512-BF16, AVX512-VNNI, AVX-512, AVX2, no AMX"),
    ("AuthenticAMD", 25, 17, "avx2 avx512f avx512_bf16 avx512_vnni",
     "AMD EPYC (family 25 model 17: Zen 4), AVX512-BF16, AVX512-VNNI, AVX-512, AVX2, no AMX"),
    ("AuthenticAMD", 25, 1, "avx2", "AMD EPYC (family 25 model 1: Zen 3), AVX2, no AMX"),
    ("GenuineIntel", 6, 143, "avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_int8",
     "Intel Xeon (family 6 model 143: Sapphire Rapids), AMX-BF16, AMX-INT8, AVX512-BF16, AVX512-VNNI, AVX-512, AVX2"),
    ("GenuineIntel", 6, 1, "avx2", "Intel Xeon (family 6 model 1), AVX2, no AMX"),
])
def test_the_generation_and_features_come_from_the_first_processor(vendor, family, model, flags, want):
    name = "AMD EPYC" if vendor == "AuthenticAMD" else "Intel Xeon"
    assert describe_cpu(_cpuinfo(vendor, family, model, name, flags)) == want


def test_no_x86_entry_describes_nothing():
    assert describe_cpu("processor\t: 0\nFeatures\t: fp asimd\n\n") == ""
    assert describe_cpu("") == ""
    assert isinstance(cpu_description(), str)
