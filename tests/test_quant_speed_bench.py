"""benchmarks/quant_speed_bench.py's step-by-step mode runs end to end on a tiny model: every run's decode steps are
measured (prompts left out), including when a workload finishes and starts again mid-run."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "quant_speed_bench.py"


def run_bench(model: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), "--model", model, "--runs", "float32", "bfloat16",
                           "--max-num-seqs", "1", "--num-prompts", "1", "--input-len", "8",
                           "--kv-cache-memory", str(1 << 24), *extra], capture_output=True, text=True, timeout=600)


def test_decode_steps_reports_each_run(llama_dir):
    # 3 output tokens: 2 decode steps per pass, so 7 steps each start the workload over three times
    result = run_bench(llama_dir, "--output-len", "3", "--decode-steps", "7")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("  ") and " decode " in line]
    assert [line.split()[0] for line in lines] == ["float32", "bfloat16"]
    assert "x1.00 (paired steps x1.00)" in lines[0]
    assert "7 decode steps each" in result.stdout


def test_decode_steps_refuses_a_workload_without_decode_steps(llama_dir):
    result = run_bench(llama_dir, "--output-len", "1", "--decode-steps", "2")
    assert result.returncode != 0
    assert "no decode steps" in result.stderr
