# The two commands: `make playbook` and `make test`. Each creates or refreshes .venv, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch is pinned to the local CPU wheel here; the `reference` extra itself asks only for a compatible range.
TORCH := torch==2.13.0
export JAX_PLATFORMS ?= cpu
# Compiled programs persist across processes (tests, notebook kernels, CLI runs): compile once, reuse.
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/build/jax-cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0.5
export PYTHONHASHSEED := 0

.PHONY: playbook test venv lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[tpu,test,notebook,reference]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

venv: $(STAMP)

playbook: $(STAMP)
	$(PY) -m playbook.build --out build/playbook

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile  # two workers, a test file stays on one (its compiled fixtures shared)

lint: $(STAMP)
	$(PY) -m pip install --quiet ruff && $(VENV)/bin/ruff check qwen35_lib tests playbook notebooks

clean:
	rm -rf build .pytest_cache
