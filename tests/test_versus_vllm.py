"""benchmarks/versus_vllm.py's worker protocol, on folio's side: a resident engine answers each pass through vLLM's
offline calls (token-id prompts, greedy, ignore_eos, no detokenisation), which folio keeps. (vLLM's side needs its
CPU build in a venv of its own: not in CI.)"""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "versus_vllm.py"


@pytest.fixture(scope="module")
def versus_vllm():
    spec = importlib.util.spec_from_file_location("versus_vllm", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_folio_worker_runs_passes_of_exactly_the_asked_tokens(versus_vllm, llama_dir):
    args = argparse.Namespace(model=llama_dir, dtype="float32", input_len=8, output_len=5)
    worker = versus_vllm.Worker("folio", sys.executable, args, {})
    idle = versus_vllm.Worker("folio", sys.executable, args, {})  # stands for the other engine, loaded and idle
    try:
        vocab = versus_vllm.vocab_size(llama_dir)
        for seed in (1, 2):  # the engine stays loaded between passes
            batch = versus_vllm.prompts(seed, argparse.Namespace(input_len=8, num_prompts=3), vocab)
            assert len(batch) == 3 and all(len(p) == 8 and max(p) < vocab for p in batch)
            assert worker.run(batch, 5, idle) > 0
        assert len(idle.busy_while_idle) == 2 and min(idle.busy_while_idle) >= 0 and not worker.busy_while_idle
    finally:
        worker.close()
        idle.close()
    assert worker.process.returncode == 0 and idle.process.returncode == 0


def test_the_driver_needs_vllms_interpreter(llama_dir, monkeypatch, versus_vllm):
    monkeypatch.setattr(sys, "argv", ["versus_vllm.py", "--model", llama_dir])
    with pytest.raises(SystemExit) as exit_info:
        versus_vllm.main()
    assert exit_info.value.code == 2


def test_the_roofline_figure_is_folio_bench_roofline_bound_for_the_workload(versus_vllm, llama_dir, monkeypatch,
                                                                              capsys):
    """--roofline: the bound of `folio bench roofline` for the same workload and measured limits (here fixed)."""
    import torch

    from folio.bench import roofline

    limits = argparse.Namespace(bandwidth_gb_s=10.0, peak_gflops={"bfloat16": 100.0})
    monkeypatch.setattr(roofline, "measure_limits", lambda *args, **kwargs: limits)
    args = argparse.Namespace(model=llama_dir, dtype="bfloat16", num_prompts=6, input_len=8, output_len=5)
    cost = roofline.model_cost(roofline.read_model_config(llama_dir), torch.bfloat16)
    want = roofline.workload_bound(cost, 6, 8, 5, 6, 2048, 10.0, 100.0).output_tokens_per_s
    assert versus_vllm.workload_bound(args) == pytest.approx(want)
    assert f"at most {want:.1f} output tok/s" in capsys.readouterr().out
