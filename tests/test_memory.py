"""folio.memory: the available-memory reading, and freed memory kept for reuse instead of faulted in again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from folio import memory


def test_available_memory_is_positive():
    assert memory.available_memory_bytes() > 0


def test_user_malloc_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert memory.keep_freed_memory() is False


# In a fresh process: glibc serves a thread from another arena when the main one is busy, and a 64 MiB block
# never fits there, so threads left running by other tests (servers, engines) would make this measure them.
# Now and then a small allocation takes the head of the freed block and the next one grows the heap instead
# (measured: one allocation in three or four, until the heap holds two such blocks), so the median of eight
# is what is asserted: a fresh mapping per allocation would fault every page in every time.
_FAULTS_OF_A_REUSED_BLOCK = """
import resource, torch
from folio import memory
assert memory.keep_freed_memory() is True

def faults_of_a_64mib_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20, dtype=torch.float32)  # written through: every page is touched, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_a_64mib_tensor()  # the heap grows once
print(sorted(faults_of_a_64mib_tensor() for _ in range(8))[4])
"""


def run_fresh(script: str) -> list[str]:
    """The words a script prints, run in a fresh process without the user's malloc settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return out.stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_large_blocks_are_reused_without_page_faults():
    assert int(run_fresh(_FAULTS_OF_A_REUSED_BLOCK)[-1]) < 1000  # a fresh mapping would fault all 16384 pages in


# A checkpoint of eight 8 MiB tensors read as the loader reads it, each tensor used and dropped: the most the
# process's resident memory grows by meanwhile. One handle for the whole file kept every page read resident
# until the end (64 MiB); a handle per tensor keeps only the tensor in use.
_RESIDENT_GROWTH_WHILE_READING = """
import sys, torch
from safetensors.torch import save_file
from folio.loader.model_loader import _iter_safetensors

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

path = sys.argv[1]
save_file({f"t{i}": torch.full((2 << 20,), float(i)) for i in range(8)}, path)
start, most = resident(), 0
for name, tensor in _iter_safetensors([path]):
    assert float(tensor[-1]) == float(name[1:])
    tensor.sum()  # reads every page
    del tensor
    most = max(most, resident() - start)
print(most)
"""


def test_reading_a_checkpoint_keeps_only_the_tensor_in_use_resident(tmp_path):
    out = subprocess.run([sys.executable, "-c", _RESIDENT_GROWTH_WHILE_READING, str(tmp_path / "w.safetensors")],
                         capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert int(out.stdout.split()[-1]) < 24 << 20  # one tensor (8 MiB) and change; the whole file is 64 MiB


# Freed memory kept for reuse stays resident; released once (as after loading), it goes back to the kernel.
# Many 8 MiB blocks (under the 1 GiB threshold: from the heap), freed in an order that leaves no free top alone.
_RESIDENT_AFTER_RELEASE = """
import torch
from folio import memory

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

assert memory.keep_freed_memory() is True
start = resident()
blocks = [torch.ones(2 << 20) for _ in range(32)]  # 256 MiB, every page written
keep = blocks[-1]
del blocks
kept = resident() - start
assert memory.release_freed_memory() is True
print(kept, resident() - start)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_released_memory_leaves_the_process():
    kept, released = (int(v) for v in run_fresh(_RESIDENT_AFTER_RELEASE)[-2:])
    assert kept > 200 << 20  # the freed blocks stayed resident
    assert released < 64 << 20  # only the block still alive (8 MiB) and small change remain
