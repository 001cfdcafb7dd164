#!/usr/bin/env bash
# One GPU lend's checks, in the order they matter, each with its own time limit, each log kept under $OUT.
# Run on the GPU machine from the repo root, with .gpu carried (../shared/gpu/prepare.sh):
#   source .gpu/device_setup.sh; bash bench/gpu_lend.sh kernels   # the GPU tests, then bench/gpu.py (~9 min)
#   source .gpu/device_setup.sh; bash bench/gpu_lend.sh modes     # LoRA, determinism, speculation, grammars (~5 min)
# A feature whose whole-model test fails (fused kernels, FP8) is left out of the benchmark after it, so one
# broken kernel does not cost the lend's other figures.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
run() {  # run LIMIT NAME COMMAND...: its output to the screen and to $out/NAME.log; returns its status
  local limit=$1 name=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  return "$rc"
}

gate() {  # a feature whose whole-model test fails on this GPU is left out of the benchmarks after it. Only the
  # whole-model tests decide: the first lend lost its fused and FP8 figures to unit tests whose tolerances were
  # the CPU's, not to broken kernels.
  fused=""; quant="none,fp8"
  run 90 gate-fused python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py \
    -k "a_model_with_the_fused_kernels" || fused="--no-fused-kernels"
  run 60 gate-fp8 python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py \
    -k "fp8_weights_with_the_fused_kernels" || quant="none"
}

case "${1:-kernels}" in
kernels)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  run 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_fp8.py \
    tests/test_cuda_graphs.py tests/test_lora_graphs.py tests/test_step_ahead.py ${LEND_TESTS:-}
  gate
  run "${GPU_BENCH_SECONDS:-330}" gpu python3 bench/gpu.py --models llama-1b --hf-batches 256 --quantizations "$quant" \
    --split "${GPU_SPLIT:-8:512:auto:on:auto,8:512:2:off:2}" --serve-rounds 4 $fused --out "$out"
  ;;
short)   # what matters most when a lend has under ten minutes left: the gates, bench/gpu.py, LoRA
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  gate
  run "${GPU_BENCH_SECONDS:-280}" gpu python3 bench/gpu.py --models llama-1b --hf-batches 256 --quantizations "$quant" \
    --split "${GPU_SPLIT:-8:512:auto:on:auto}" --serve-rounds 2 $fused --out "$out"
  run "${LORA_SECONDS:-80}" lora env STEPWIRE_EXECUTOR_DEVICE=cuda python3 bench/lora.py --rounds 1
  ;;
modes)
  run 100 lora env STEPWIRE_EXECUTOR_DEVICE=cuda python3 bench/lora.py --rounds 1
  run 90 determinism-1 python3 bench/determinism.py --device cuda --rounds 1
  run 90 determinism-2 python3 bench/determinism.py --device cuda --rounds 1
  run 90 determinism-3 python3 bench/determinism.py --device cuda --rounds 1
  run 120 spec python3 bench/spec_gpu.py --device cuda
  run 60 structured python3 bench/structured.py --device cuda --rounds 1
  ;;
esac
