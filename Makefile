# The two commands: `make playbook` and `make test`. Each creates or refreshes .venv, then runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch is pinned to the local CPU wheel here; the `reference` extra itself asks only for a compatible range.
TORCH := torch==2.13.0
export JAX_PLATFORMS ?= cpu
# No persistent JAX compile cache by default: jaxlib 0.10.2 segfaulted now and then while serializing a CPU
# executable into it (compilation_cache.put_executable_and_time), killing a test worker. Set
# JAX_COMPILATION_CACHE_DIR yourself to trade that risk for faster reruns.
export PYTHONHASHSEED := 0
# Python caches each module's bytecode beside it on first import; an environment that sets PYTHONDONTWRITEBYTECODE
# (this CI image does) makes every process compile jax, torch, transformers and this package from source again
# (workers, notebook kernels, CLI and TPU7x-compile children): the CLI tests' 84 items took 60 s that way, 38 s not.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: playbook test venv lint sweep clean

# --no-compile: pip would byte-compile every installed module (jupyterlab, torch, transformers, ...), about a minute
# of this 2-core machine's install; Python compiles the modules a process imports, once, on first use.
PIP := $(PY) -m pip install --quiet --no-compile
# The project and its extras are installed by uv (itself from PyPI, by pip): on this 2-core machine, from a clean
# clone with cold caches, `make venv` took 39 s against pip's 80 s, to the same packages. torch comes first, by
# pip, which reads pip.conf (where a machine keeps its local CPU wheel; uv does not read it) and uv keeps the
# installed torch, which satisfies the `reference` extra. `make test UV=` installs everything with pip.
UV ?= $(VENV)/bin/uv
INSTALL := $(if $(UV),$(UV) pip install --quiet --python $(PY),$(PIP))

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip $(if $(UV),uv)
	$(PIP) "$(TORCH)"
	$(INSTALL) -e ".[tpu,test,notebook,reference]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

venv: $(STAMP)

playbook: $(STAMP)
	$(PY) -m playbook.build --out build/playbook

# Two workers over tests/ and the notebooks (testpaths; nbmake runs each .ipynb once), each on its own share of the
# cores with every process it starts (conftest.py's _own_cores). worksteal hands each worker a contiguous half of the
# items (a file mostly stays on one, its compiled fixtures shared) and, after a crash, reports it and goes on
# (loadfile waited forever for the crashed worker's file: the CI timeout). A crashed worker fails the run.
# build/test.log keeps the output; build/test-times.xml every item's seconds (junit), to find what to cut
# when the run nears CI's 15 minutes.
# jemalloc, where installed (Debian's libjemalloc2; .ci/run installs it), for the test processes and every process they
# start: XLA's and libtpu's compiles spend about a tenth of their time in glibc's malloc and free. Measured on this
# 2-core machine, each variant pinned to its own core and then swapped: test_engine with test_decoder 51.8 / 54.0 s
# against 54.9 / 57.7 s, a TPU7x step compile 15.4 / 15.8 s against 16.9 / 18.1 s; the whole clean-clone `.ci/run`
# 746 s against 922 s the run before (user CPU 22m14 against 27m56). Nothing computed changes. Its heap in transparent
# huge pages (MALLOC_CONF, unless set): the same pairs 4-20% shorter again in 4 of 4; the whole run with it (and
# tests/conftest.py's GC thresholds) took 790 s, within this host's spread from run to run.
JEMALLOC := $(firstword $(wildcard /usr/lib/*/libjemalloc.so.2 /usr/lib/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2))
MALLOC_CONF ?= thp:always,metadata_thp:always
PRELOAD := $(if $(JEMALLOC),LD_PRELOAD="$(strip $(JEMALLOC) $(LD_PRELOAD))" MALLOC_CONF="$(MALLOC_CONF)")

test: $(STAMP) lint
	@mkdir -p build
	$(PRELOAD) $(PY) -m pytest -q -n 2 --dist worksteal --junitxml=build/test-times.xml 2>&1 | tee build/test.log; exit $${PIPESTATUS[0]}

# The ahead-of-time sweep: every stage's engine steps compiled for TPU7x-8 at the serving shape (512 requests,
# whole-context FP8 KV pools), from this CPU; resumable, and long at full depth (see qwen35_lib/aot/sweep.py).
sweep: $(STAMP)
	$(PY) -m qwen35_lib.aot sweep --json data/aot/tpu7x-8.json $(SWEEP_ARGS)

# ruff, and the import layers of pyproject.toml's import-linter contract (config, plan, weights -> kernels -> model ->
# parallel -> engine -> analysis -> apps: nothing imports a layer above its own).
lint: $(STAMP)
	$(VENV)/bin/ruff check conftest.py qwen35_lib tests playbook notebooks
	$(VENV)/bin/lint-imports

clean:
	rm -rf build .pytest_cache
