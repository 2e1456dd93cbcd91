#!/usr/bin/env bash
# The one command a lent H200 runs (repo root, `.whl` carried):   bash benchmarks/gpu/run.sh
# CPU dry run of every part's code path (tiny shapes, the checkout's Python):   bash benchmarks/gpu/run.sh --dry-run
# (or DRY_RUN=1). Results go to $OUT (default gpu_results/): summary.md, results.json, run.log,
# pytest_gpu.txt, nvidia-smi.txt, tracebacks.txt (when a part raised) - few files, so all come back.
# 1. installs .whl/*.whl (benchmarks/gpu/prepare.sh builds them on a CPU machine with PyPI) with
#    pip --no-index --no-deps --target and puts the target on PYTHONPATH (skipped when .whl is absent),
#    after the checkout itself (its nemo_fp8rl wins over the project wheel's, which may be older);
# 2. runs benchmarks/gpu/runner.py: every part in its own process with its own timeout, all parts within
#    GPU_CHECK_BUDGET_S seconds; the default is runner.py's budget table (PARTS: the caps of the parts
#    that can run here, 510 s on the H200, read with `runner.py --print-budget`); summary.md and
#    results.json are rewritten after each part, so a run cut short keeps what was measured.
# Environment: PYTHON (default: the checkout's .venv/bin/python when it exists, as after `make test`;
# else python3), OUT, GPU_CHECK_BUDGET_S, GPU_CHECK_PARTS (comma list).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=""
[ "${1:-}" = "--dry-run" ] || [ "${DRY_RUN:-0}" = "1" ] && DRY="--dry-run"
OUT="${OUT:-gpu_results}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
start=$(date +%s)
mkdir -p "$OUT"
{ timeout 30 nvidia-smi || echo "nvidia-smi: not available"; } > "$OUT/nvidia-smi.txt" 2>&1
{
  if [ -n "$DRY" ]; then
    echo "dry run: using this Python's packages (the .whl/ wheels are for the GPU machine's Python 3.12)"
  elif ls .whl/*.whl > /dev/null 2>&1; then
    SITE="${GPU_CHECK_SITE:-/tmp/gpu_check_site}"
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
      && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" && export PATH="$SITE/bin:$PATH" \
      && echo "installed $(ls .whl/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - start ))s" \
      || echo "pip install of .whl/ failed: the parts run with this Python's own packages"
  else
    echo "no .whl/ wheels (benchmarks/gpu/prepare.sh makes them): using this Python's packages"
  fi
  # the checkout's nemo_fp8rl comes first: the project wheel in .whl/ may be older than the tree
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  PARTS_ARG=(${GPU_CHECK_PARTS:+--parts "$GPU_CHECK_PARTS"})
  BUDGET="${GPU_CHECK_BUDGET_S:-$("$PY" benchmarks/gpu/runner.py --print-budget $DRY "${PARTS_ARG[@]}")}"
  if ! [ "$BUDGET" -gt 0 ] 2> /dev/null; then
    echo "no parts budget: runner.py --print-budget said '$BUDGET' (PYTHON=$PY; GPU_CHECK_BUDGET_S takes whole seconds)"
    exit 1
  fi
  echo "python $PY, parts budget ${BUDGET}s"
  # the runner keeps its own deadline; the timeout is the backstop: on its SIGTERM the runner stops the running
  # part (which saves what it has), writes the summary and exits 143 (runner.py's docstring)
  timeout -k 10 $(( BUDGET + 30 )) "$PY" benchmarks/gpu/runner.py --out "$OUT" --budget-s "$BUDGET" $DRY \
    "${PARTS_ARG[@]}"
  rc=$?
  echo "runner exit code $rc, total $(( $(date +%s) - start ))s"
  exit $rc
} 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
