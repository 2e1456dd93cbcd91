#!/usr/bin/env bash
# One GPU run, under 8 minutes in all (GPU_CHECK_BUDGET_S, default 460 s), everything under one output directory:
#   benchmarks/gpu_check.sh [OUT_DIR=gpu_results] [--dry-run]
# 1. pytest -m gpu (TE parity tests, TE actor tests; at most GPU_CHECK_PYTEST_S, default 150 s),
# 1b. pytest -m gpu tests/rollout/test_vllm_gpu.py when it exists (vLLM FP8 rollout vs our emulation), in its
#     own run (at most GPU_CHECK_VLLM_PYTEST_S, default 120 s) so a slow vLLM start cannot cut the TE results,
# 2. benchmarks/gpu_check.py with the time left (environment, TE vs emulation parity, 8B-shaped BF16 vs FP8
# train-step throughput, shadow-forward cost, vLLM BF16 vs FP8 generation throughput, vLLM FP8 log-probs vs
# our emulation, tiny GRPO on GPU); it skips what would not fit the deadline.
# Results: OUT_DIR/summary.md (tables) and OUT_DIR/results.json (everything, tracebacks included).
# Assumes the project is installed with the gpu extra (Transformer Engine) in the active Python ($PYTHON);
# the vLLM parts and tests also need vLLM's CUDA build (`pip install vllm`) and are skipped without it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_results}"
DRY=""
[ "${2:-}" = "--dry-run" ] || [ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
[ "${1:-}" = "--dry-run" ] && OUT="gpu_results"
PY="${PYTHON:-$(command -v python || command -v python3)}"
BUDGET="${GPU_CHECK_BUDGET_S:-460}"
mkdir -p "$OUT"
start=$(date +%s)
{ timeout 30 nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
rm -f "$OUT/pytest_gpu.txt" "$OUT/pytest_vllm_gpu.txt"
if [ -z "$DRY" ]; then
  timeout -k 10 "${GPU_CHECK_PYTEST_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/fp8/test_te_parity_gpu.py tests/models/test_te_gpu.py > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest -m gpu exit code $? after $(( $(date +%s) - start ))s" >> "$OUT/pytest_gpu.txt"
  if [ -f tests/rollout/test_vllm_gpu.py ]; then
    timeout -k 10 "${GPU_CHECK_VLLM_PYTEST_S:-120}" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
      tests/rollout/test_vllm_gpu.py > "$OUT/pytest_vllm_gpu.txt" 2>&1
    echo "pytest -m gpu (vLLM) exit code $? after $(( $(date +%s) - start ))s" >> "$OUT/pytest_vllm_gpu.txt"
  fi
fi
left=$(( BUDGET - ($(date +%s) - start) ))
[ "$left" -lt 90 ] && left=90
# gpu_check.py stops starting work 10 s before its deadline; the timeout is the backstop (SIGTERM: it
# records the running part and writes the summary; SIGKILL 10 s later)
timeout -k 10 "$left" "$PY" benchmarks/gpu_check.py --out "$OUT" --deadline-at $(( $(date +%s) + left - 10 )) $DRY \
  > "$OUT/gpu_check.log" 2>&1
rc=$?
echo "gpu_check.py exit code $rc, total $(( $(date +%s) - start ))s" | tee -a "$OUT/gpu_check.log"
exit $rc
