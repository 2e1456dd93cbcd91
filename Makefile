# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is installed explicitly first so pip never resolves a multi-GB CUDA build on CPU machines.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv install install-test demo test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q "torch>=2.5"
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m nemo_fp8rl.demo

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(PIP) install -q ruff && $(VENV)/bin/ruff check nemo_fp8rl tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
