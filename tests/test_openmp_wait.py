"""folio sets how long GNU OpenMP's threads spin at a barrier (folio.openmp_wait) when it is imported before
torch and the user chose nothing; it leaves the user's choice and an OpenMP already loaded alone."""

from __future__ import annotations

import os
import subprocess
import sys

from folio import openmp_wait


def spin_count_after(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env={**clean, **env}, capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_importing_folio_first_sets_the_spin_count():
    assert spin_count_after("import folio") == openmp_wait.SPIN_COUNT
    assert spin_count_after("import folio", GOMP_SPINCOUNT="77") == "77"
    assert spin_count_after("import folio", OMP_WAIT_POLICY="ACTIVE") == "None"
    assert spin_count_after("import torch, folio") == "None"  # OpenMP read its settings as torch loaded


def test_the_users_choice_and_a_loaded_openmp_are_left_alone(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "torch" in sys.modules and not openmp_wait.set_default_spin()  # the tests load torch first
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.delitem(sys.modules, "torch")  # as if folio came first (put back after the test)
    assert openmp_wait.set_default_spin() and os.environ["GOMP_SPINCOUNT"] == openmp_wait.SPIN_COUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert not openmp_wait.set_default_spin() and os.environ["GOMP_SPINCOUNT"] == "5"
