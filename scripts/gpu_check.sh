#!/usr/bin/env bash
# The device check: run it whenever a session is lent the device machine, whatever issue it works on, and put
# its figures in the closing note.
#
# That machine is an H200 whose host CPU is a Xeon with AMX-BF16/INT8. folio has no CUDA code yet, so this
# checks the host: the C++ kernels' AVX-512 paths against their references (a development machine may have
# AVX2 only, CI's CPU varies), then the figures of issues 13 and 15 on two pinned physical cores, the slice
# those issues measure: the roofline, W1 with its peak memory, long-query attention, batch-1 decode and W1 of
# the weight schemes, then the decode-sized matmul benchmarks that set the AMX thresholds. Every part has a time
# limit, cut to what is left before DEADLINE_S (said in the log), so the whole ends within it. KERNELS_ONLY=1
# stops after the kernel tests: a first, short call that shows the kernels build there before the long one.
#
# Before the call, here, once per session (nothing can be installed there, and the device lacks gguf and
# llguidance, which every engine needs):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl gguf==0.19.0 llguidance==1.9.1
# The calls: device `run` with command "KERNELS_ONLY=1 bash scripts/gpu_check.sh", carry [".whl"], then at once,
# while the machine is warm (its kernels built), "bash scripts/gpu_check.sh", timeout_s 590. The log also comes
# back as $OUT/gpu_check.log.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/folio-check}
mkdir -p "$WORK"
exec > >(tee "${OUT:-$WORK}/gpu_check.log") 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export FOLIO_CACHE_DIR=${FOLIO_CACHE_DIR:-$WORK/cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:$WORK/site
fi

section() { echo; echo "=== $* (at ${SECONDS} s)"; }
# part CAP_S COMMAND...: the command under a time limit, cut to the time left before the deadline (the benchmarks
# print each figure as they go, so a cut run still reports some), or a note that under a minute is left
part() {
  local cap=$1; shift
  local left=$(( DEADLINE_S - SECONDS ))
  if (( left < 60 && left < cap )); then echo "skipped, ${left} s left before the deadline: $*"; return; fi
  (( cap > left )) && { echo "(limited to the ${left} s left)"; cap=$left; }
  timeout "$cap" "$@" || echo "(exit $? after at most ${cap} s: $*)"
}

section machine
grep -m1 "model name" /proc/cpuinfo
echo "logical CPUs: $(nproc)"
for flag in avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8; do
  grep -qw "$flag" /proc/cpuinfo && echo "  $flag: yes" || echo "  $flag: no"
done
command -v nvidia-smi >/dev/null && nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, '- ATen CPU capability', torch.backends.cpu.get_cpu_capability())"
# the kernels' compiler against torch's (a kernel's refusal of bad input crashed there once: see the last part)
echo "kernels built by: $(c++ --version | head -1)"
$PY -c "import torch; print(*[l.strip() for l in torch.__config__.show().splitlines() if 'GCC' in l or 'ABI' in l], sep='\n')"
# the first logical CPU of each of two distinct physical cores
CORES=$(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | head -2 | cut -d, -f1 | paste -sd,)
PIN=(taskset -c "$CORES")
echo "figures pinned to CPUs $CORES"

section "kernels: built side by side on every core"
builds=()
for module in folio.attention.cpu_paged folio.attention.flash_prefill folio.models.quant_kernels \
    folio.models.small_batch_gemm folio.models.fused_moe folio.models.fused_ops folio.sample.sampling_ops \
    folio.models.int4_blocks folio.models.rescored_head \
    folio.structured_output.token_mask; do
  part 240 $PY -c "import $module as m; k = m.KERNEL; print('$module:', 'built' if k.load() else k.error)" &
  builds+=($!)
done
wait "${builds[@]}"  # (a bare wait would wait for the log's tee too)

section "kernel tests against their references"
$PY -c "import xdist" 2>/dev/null && SPREAD=(-n 8) || SPREAD=()
# KERNEL_TESTS: other test ids instead (e.g. a former call's failures, to save its time)
TESTS=(${KERNEL_TESTS:-tests/test_quant_kernels.py tests/test_small_batch_gemm.py tests/test_cpu_paged_attention.py
  tests/test_sliding_window.py tests/test_flash_prefill.py tests/test_sdpa_prefill.py tests/test_onednn_int8.py
  tests/test_fused_moe.py tests/test_fused_ops.py tests/test_kv_cache_8bit.py tests/test_int4_blocks.py
  tests/test_rescored_head.py tests/test_decode_threads.py})
part 150 $PY -m pytest -q -p no:cacheprovider "${SPREAD[@]}" "${TESTS[@]}"

[[ ${KERNELS_ONLY:-0} == 1 ]] && { section "done (KERNELS_ONLY)"; exit 0; }

section "W1 on the 0.5B Qwen2 (default settings): the roofline, throughput and peak memory"
MODEL=$WORK/qwen2-0.5b
part 60 $PY -m folio bench make-model --arch qwen2-0.5b --out "$MODEL"
W1=(--num-prompts 64 --input-len 256 --output-len 128)
part 60 "${PIN[@]}" $PY -m folio bench roofline --model "$MODEL" "${W1[@]}"
part 150 "${PIN[@]}" $PY -m folio bench throughput --model "$MODEL" "${W1[@]}"  # with its step breakdown

section "batch-1 decode of the 0.5B Qwen2, weight schemes against bf16, engine steps interleaved (issue 13: int8 1.7x, int4 2.5x)"
part 100 "${PIN[@]}" $PY benchmarks/quant_speed_bench.py --model "$MODEL" --max-num-seqs 1 --num-prompts 2 \
  --input-len 32 --output-len 128 --kv-cache-memory 268435456 --runs bfloat16 bfloat16:int4 bfloat16:int8 \
  --decode-steps 300

section "W1 of the int8 schemes against bf16 (issue 13: int8 1.3x)"
part 150 "${PIN[@]}" $PY benchmarks/quant_speed_bench.py --model "$MODEL" "${W1[@]}" \
  --runs bfloat16 bfloat16:int8 bfloat16:int8 bfloat16

section "long-query (prefill) attention, one Qwen2-0.5B layer; bf16 and int8 caches; where the path starts to win (sets flash_prefill's AMX rules)"
part 90 "${PIN[@]}" $PY benchmarks/attention_bench.py --long-queries --shapes Qwen2-0.5B
part 60 "${PIN[@]}" $PY benchmarks/attention_bench.py --long-queries --kv-cache-dtype int8 --shapes Qwen2-0.5B
part 60 "${PIN[@]}" $PY benchmarks/attention_bench.py --long-queries --query-lens 16,24,32,64 --shapes Qwen2-0.5B,Qwen3-0.6B

section "batch-1 decode on the decode threads against OpenMP"
part 60 "${PIN[@]}" $PY benchmarks/decode_threads_bench.py --model "$MODEL" --schemes none int4 int8 --rounds 12

section "decode-sized bf16 matmuls: the small-batch kernel and the tiles against oneDNN (AMX: sets small_batch_gemm.MAX_ROWS_AMX, TILE_ROWS_AMX)"
part 60 "${PIN[@]}" $PY benchmarks/small_batch_gemm_bench.py --skip-engine --rounds 1 --rows 1 4 8 16 32 64

section "decode-sized int4 matmuls: the column-block kernel, the row-major one, the dequantised GEMM (AMX: int4_blocks.MAX_ROWS)"
part 60 "${PIN[@]}" $PY benchmarks/int4_blocks_bench.py --rows 1,4,16,32,64 --rounds 1 --round-s 0.3

section "one layer's matmul: bf16, the W8A8 kernel, the tiles, oneDNN's int8 GEMM (AMX-INT8; sets MIN_ROWS_AMX, TILE_ROWS_AMX), int16 activations, w8a16"
part 60 "${PIN[@]}" $PY benchmarks/int8_gemm_bench.py --rounds 3 --round-s 0.1
part 90 "${PIN[@]}" $PY benchmarks/int8_gemm_bench.py --shapes 1152x896,896x896,9728x896,896x4864 --copies 24 \
  --rows 1,4,8,16,32,64 --rounds 2 --round-s 0.2

section "oneDNN's int8 GEMM at W1's decode batch: which implementation (at 64 rows it ran slower than bf16 there)"
ONEDNN_VERBOSE=1 part 60 "${PIN[@]}" $PY benchmarks/int8_gemm_bench.py --shapes 896x4864 --rows 64 --rounds 1 \
  --round-s 0.05 | grep -E "^onednn_verbose,.*,exec," | cut -d, -f4-7 | sort | uniq -c | sort -rn | head -8

section "where a kernel's refusal of bad shapes crashed there (on torch 2.11 + the image's compiler): a backtrace"
part 60 cuda-gdb -q -batch -ex run -ex bt --args $PY -m pytest -q -p no:cacheprovider -p no:xdist \
  tests/test_quant_kernels.py::test_bad_shapes_are_refused 2>&1 | grep -E "^#|SIG|passed|failed" | head -30

section "done"
