#!/usr/bin/env bash
# The fused KV-injection CUDA kernel (csrc/kv_inject.cu) on a lent GPU, in one short run (~3-5 min with
# the installs): its tests (against the PyTorch reference in float32 / bfloat16 / float16, a bad position,
# DFlash output == the target's), its time against the PyTorch path (build_scripts/bench_kv_inject.py),
# and an end-to-end bench with --cuda-kernels on vs off. Results and logs go to $OUT (default ./gpu_out).
#
# Usage (repository root, a CUDA torch installed, nvcc on PATH; PYTHON: default python):
#   bash build_scripts/gpu_check_kv_inject.sh
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python}
cli() { "$PYTHON" -c 'from dflash_trt.cli import main; main()' "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
"$PYTHON" -m pytest -q -p no:cacheprovider tests/ops/test_kv_inject_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -5
for dtype in float32 bfloat16; do
  "$PYTHON" build_scripts/bench_kv_inject.py --device cuda --dtype "$dtype" --reps 100 \
      --out "$OUT/kv_inject_$dtype.json" 2>&1 | tee "$OUT/kv_inject_$dtype.log"
done
for kernels in off on; do
  cli bench --device cuda --dtype bfloat16 --dataset humaneval --num-prompts 10 --max-tokens 256 \
      --modes dflash,ar --cuda-kernels "$kernels" --profile --out "$OUT/bench_cuda_kernels_$kernels" \
      > "$OUT/bench_cuda_kernels_$kernels.log" 2>&1
  tail -8 "$OUT/bench_cuda_kernels_$kernels.log"
done
