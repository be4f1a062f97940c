"""benchmarks/decode_threads_bench.py runs end to end on a tiny model, restarting a finished request mid-block."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_threads_bench.py"


def test_reports_each_scheme_on_either_threads(llama_dir):
    result = subprocess.run([sys.executable, str(BENCH), "--model", llama_dir, "--dtype", "float32", "--schemes",
                             "none", "int8", "--rounds", "2", "--block", "5", "--drop", "1", "--output-len", "3"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    assert [line[0] for line in lines] == ["none", "int8"]
    assert "2 rounds of 4 decode steps" in result.stdout
