#!/usr/bin/env bash
# One GPU run, under 8 minutes, everything under one output directory:
#   benchmarks/gpu_check.sh [OUT_DIR=gpu_results] [--dry-run]
# 1. pytest -m gpu (TE parity tests, TE actor tests), 2. benchmarks/gpu_check.py (environment, TE vs
# emulation parity, 8B-shaped BF16 vs FP8 train-step throughput, shadow-forward cost, tiny GRPO on GPU).
# Assumes the project is installed with the gpu extra (Transformer Engine) in the active Python.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_results}"
DRY=""
[ "${2:-}" = "--dry-run" ] || [ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
[ "${1:-}" = "--dry-run" ] && OUT="gpu_results"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
start=$(date +%s)
{ nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
if [ -z "$DRY" ]; then
  timeout 240 "$PY" -m pytest -q -m gpu tests/fp8/test_te_parity_gpu.py tests/models/test_te_gpu.py \
    > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest -m gpu exit code $?" >> "$OUT/pytest_gpu.txt"
fi
timeout 300 "$PY" benchmarks/gpu_check.py --out "$OUT" $DRY > "$OUT/gpu_check.log" 2>&1
rc=$?
echo "gpu_check.py exit code $rc, total $(( $(date +%s) - start ))s" | tee -a "$OUT/gpu_check.log"
exit $rc
