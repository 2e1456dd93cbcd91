#!/usr/bin/env bash
# Run on a CPU machine with PyPI access, in the checkout, before the GPU check:   bash benchmarks/gpu/prepare.sh
# Fills the ignored folder .whl/ with what the H200 image lacks (it has Python 3.12, torch, numpy,
# transformers, safetensors, tokenizers, pyyaml, psutil, matplotlib, tensorboard, pytest, hypothesis,
# triton; no network): the cp312 manylinux wheels of megatron-core, hydra-core, omegaconf, math-verify,
# latex2sympy2_extended and torchao, a pure wheel of antlr4-python3-runtime built from its sdist (PyPI
# has no wheel of 4.9.3), and this project's own wheel. Nothing the image already has: a carried copy
# would come first on PYTHONPATH and shadow the image's own (run.sh installs with --no-deps). Not
# `packaging`: megatron-core 0.16.1 declares packaging>=24.2 but imports only packaging.version
# (Version, parse), which every packaging release since 20.0 has; the image's copy (transformers, pytest
# and matplotlib require it) serves, and the env part checks that it imports. Checks the wheels total
# <= 20 MiB (the device machine takes 64 MiB of working tree in all) and lists each file with its size.
# Idempotent: a wheel already in .whl/ is kept; the project wheel is rebuilt every time.
# Environment: PYTHON (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
W=.whl
LIMIT_MIB=20
mkdir -p "$W"
rm -f "$W"/packaging-*.whl  # an older prepare.sh shipped it: it would shadow the image's own copy
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
BINARY=(megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0
        torchao==0.17.0)
need=()
for spec in "${BINARY[@]}"; do
  name="${spec%%==*}"; ver="${spec##*==}"
  # wheel file names use underscores for dashes
  ls "$W/${name//-/_}-$ver-"*.whl > /dev/null 2>&1 || need+=("$spec")
done
if [ "${#need[@]}" -gt 0 ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$W" "${need[@]}"
fi
if ! ls "$W"/antlr4_python3_runtime-4.9.3-*.whl > /dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$W" antlr4-python3-runtime==4.9.3
fi
rm -f "$W"/nemo_fp8rl-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$W" .
# one version of each distribution: two would stop the --target install on the GPU machine
dups=$(ls "$W"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "error: .whl/ holds several versions of: $dups; delete the old ones and rerun" >&2
  exit 1
fi
total=0
for f in "$W"/*.whl; do
  size=$(stat -c %s "$f")
  total=$(( total + size ))
  awk -v s="$size" -v n="$(basename "$f")" 'BEGIN { printf "%10.2f MiB  %s\n", s / 1048576, n }'
done
awk -v s="$total" -v l="$LIMIT_MIB" 'BEGIN { printf "%10.2f MiB  total (limit %d MiB)\n", s / 1048576, l }'
if [ "$total" -gt $(( LIMIT_MIB * 1048576 )) ]; then
  echo "error: .whl/ is over $LIMIT_MIB MiB; it travels with the working tree (64 MiB in all)" >&2
  exit 1
fi
echo "ready: run the device command 'bash benchmarks/gpu/run.sh' with carry ['.whl']"
