#!/usr/bin/env bash
# W1 on two physical cores of any machine (the machine class: 2 cores), folio against Transformers and
# the roofline, in one go. Useful on a bigger box (say, an AMX Xeon host) to measure what a 2-core slice does.
#
#   benchmarks/pinned_w1.sh [PYTHON] [WORKDIR]     (default: .venv/bin/python, /tmp/folio-w1)
#
# Prints the CPU model and whether it has AMX, makes the random Qwen2-0.5B and SmolLM2-135M models (seconds),
# then for each: `bench baseline` (Transformers sequential and static batch 64, folio) and `bench roofline --run`.
set -uo pipefail
PY=${1:-.venv/bin/python}
DIR=${2:-/tmp/folio-w1}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
grep -m1 "model name" /proc/cpuinfo
grep -q amx_bf16 /proc/cpuinfo && echo "AMX-BF16: yes" || echo "AMX-BF16: no"
# the first logical CPU of each of two distinct physical cores
CORES=$(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | head -2 | cut -d, -f1 | paste -sd,)
echo "pinned to CPUs $CORES"
W1="--dtype bfloat16 --num-prompts 64 --input-len 256 --output-len 128"
for arch in qwen2-0.5b smollm2-135m; do
  "$PY" -m folio bench make-model --arch $arch --out "$DIR/$arch" || exit 1
  echo "=== $arch: baseline"
  taskset -c "$CORES" "$PY" -m folio bench baseline --model "$DIR/$arch" $W1 --hf-batch-sizes 64 --hf-sequential-prompts 2
  echo "=== $arch: roofline"
  taskset -c "$CORES" "$PY" -m folio bench roofline --model "$DIR/$arch" $W1 --run
done
