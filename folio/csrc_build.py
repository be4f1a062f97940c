"""Build-at-first-use machinery shared by folio's C++ kernels (folio/csrc/*.cpp).

A kernel is compiled with `torch.utils.cpp_extension.load` into $FOLIO_CACHE_DIR (default ~/.cache/folio)
/torch_extensions/<name>_<hash>, the hash covering the source, the flags, torch, Python and the CPU's
feature flags (-march=native code must not reach another CPU). A later process imports the built library
directly (no compiler, no ninja). `CppKernel.load()` returns None, after one logged warning, when the build
fails or FOLIO_DISABLE_CPU_KERNELS=1: callers then use their torch reference code.

Same behaviour as folio.attention.cpu_paged's own helpers, generalised to any source file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from folio import envs
from folio.platforms import current_platform
from folio.platforms.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# A build lock older than this is taken to be left over from a killed build.
STALE_LOCK_S = 15 * 60


def cache_root() -> Path:
    """Where built kernels live: $FOLIO_CACHE_DIR (default ~/.cache/folio) / torch_extensions."""
    return envs.cache_dir() / "torch_extensions"


def build_key(source: Path, cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """Hash of everything the built library depends on (the source, the headers beside it): -march=native ties it
    to this CPU's features."""
    h = hashlib.sha256()
    headers = b"".join(path.read_bytes() for path in sorted(Path(source).parent.glob("*.h")))  # "#include"d
    for part in (Path(source).read_bytes(), headers, " ".join(list(cflags) + list(ldflags)).encode(),
                 torch.__version__.encode(), sys.version.encode(), platform.machine().encode(),
                 (cpu_flags() or platform.processor()).encode(), os.environ.get("CXX", "c++").encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _import_built(name: str, folder: Path):
    path = folder / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_and_load(ext_name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str], what: str = "kernel",
                   verbose: bool = False):
    """Import the cached build of `source`, or build it (raises on a build failure)."""
    name = f"{ext_name}_{build_key(source, cflags, ldflags)}"
    folder = cache_root() / name
    if (folder / "ok").exists() and (folder / f"{name}.so").exists():
        return _import_built(name, folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    try:
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()  # torch's FileBaton would wait for it forever
    except OSError:
        pass
    from torch.utils import cpp_extension

    start = time.perf_counter()
    logger.info("building the %s in %s (first use only)", what, folder)
    module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(cflags),
                                extra_ldflags=list(ldflags), build_directory=str(folder), verbose=verbose,
                                with_cuda=False)
    (folder / "ok").write_text(f"{time.perf_counter() - start:.1f} s\n")
    logger.info("built the %s in %.1f s", what, time.perf_counter() - start)
    return module


class CppKernel:
    """One lazily built extension: `load()` builds once per process (thread-safe) and remembers failure."""

    def __init__(self, ext_name: str, source: Path, what: str, fallback: str, cflags: Sequence[str] = ()) -> None:
        """cflags: this kernel's own compiler flags, after the platform's."""
        self.ext_name, self.source, self.what, self.fallback = ext_name, Path(source), what, fallback
        self.cflags = tuple(cflags)
        self._lock = threading.Lock()
        self._ext: Any = None
        self._tried = False
        self.error: Optional[str] = None

    def load(self, verbose: bool = False):
        if self._tried:  # fast path: no lock once settled
            return self._ext
        with self._lock:
            if not self._tried:
                if envs.disable_cpu_kernels():
                    self.error = "disabled by FOLIO_DISABLE_CPU_KERNELS=1"
                else:
                    try:
                        cflags, ldflags = current_platform().kernel_build_flags()
                        self._ext = build_and_load(self.ext_name, self.source, tuple(cflags) + self.cflags, ldflags,
                                                   self.what, verbose)
                        self._use_decode_threads()
                    except Exception as exc:  # a compiler error, no ninja, a read-only cache dir...
                        self.error = f"{type(exc).__name__}: {exc}"
                if self.error is not None:
                    logger.debug("%s build error:\n%s", self.what, self.error)
                    logger.warning("%s unavailable (%s); %s", self.what,
                                   self.error.strip().splitlines()[0][:500], self.fallback)
                self._tried = True
            return self._ext

    def _use_decode_threads(self) -> None:
        """Hand a kernel built with folio/csrc/parallel.h the decode threads' entry points (else its loops stay
        on OpenMP): folio.platforms.decode_threads."""
        if hasattr(self._ext, "use_decode_threads"):
            from folio.platforms import decode_threads  # it builds its own kernel through this class

            entry = decode_threads.entry_points()
            if entry is not None:
                self._ext.use_decode_threads(entry)
