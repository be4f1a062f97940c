"""Every C++ kernel in folio/csrc builds on the CPU that runs the tests. A kernel that fails to build only logs a
warning and leaves its callers on their fallback, whose results the other tests accept: without this test a build
broken for one CPU family (a header included only under another family's #if) passes every other test there while
that machine loses the kernel."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest

import folio
from folio import envs
from folio.csrc_build import CSRC, CppKernel

FOLIO = Path(folio.__file__).resolve().parent


def _kernels() -> list[CppKernel]:
    """The CppKernel of every module that declares one."""
    kernels = []
    for path in sorted(FOLIO.rglob("*.py")):
        if "CppKernel(" in path.read_text() and path.name != "csrc_build.py":
            module = importlib.import_module(".".join(path.relative_to(FOLIO.parent).with_suffix("").parts))
            kernels += [value for value in vars(module).values() if isinstance(value, CppKernel)]
    return kernels


KERNELS = _kernels()


def test_every_source_has_its_kernel():
    assert {kernel.source.name for kernel in KERNELS} == {path.name for path in CSRC.glob("*.cpp")}


@pytest.mark.skipif(envs.disable_cpu_kernels() or shutil.which("c++") is None,
                    reason="kernels disabled, or no C++ compiler")
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.source.stem)
def test_builds_on_this_cpu(kernel: CppKernel):
    assert kernel.load() is not None, kernel.error
