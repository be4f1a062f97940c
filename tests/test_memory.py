"""folio.memory: the available-memory reading, and freed memory kept for reuse instead of faulted in again."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from folio import memory


def test_available_memory_is_positive():
    assert memory.available_memory_bytes() > 0


def test_user_malloc_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert memory.keep_freed_memory() is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_large_blocks_are_reused_without_page_faults(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert memory.keep_freed_memory() is True

    def faults_of_a_64mib_tensor() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 << 20, dtype=torch.float32)  # written through: every page is touched, then freed
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_a_64mib_tensor()  # the heap grows once
    # a fresh mapping would fault all 16384 of its 4 KiB pages in again
    assert faults_of_a_64mib_tensor() < 1000
