#!/usr/bin/env bash
# H200 validation of pyscore in one run (issues 6, 11): build the extension for sm_90a, run the CUDA tests (each
# kernel against the reference; tests/bench_gpu/test_cuda_engine.py: the engine's paths on the GPU, Qwen3 and the
# Qwen3.5 hybrid, against the fp32 CPU engine: MIS, SIS, the prefix cache, chunked prefill, branch points, prompt
# logprobs and decode steps), then the kernel benchmark, the
# in-process engine benchmark on random-weight Qwen3-0.6B-, Qwen3-8B- and Qwen3.5-4B-shaped models, and a short gRPC
# benchmark. Every stage runs under `timeout`, writes its JSON/log under $OUT before the next starts, and a
# failing stage does not stop the others. Stage limits add up to 9.7 min (env 15 s, build 110 (the CUDA module
# alone took 21 s on 2 cores here), tests 80, kernels 50, engine 0.6B 70, engine 8B 110, engine Qwen3.5-4B 100,
# gRPC 45), under the device tool's 10 minutes a command; expect about 5-6 min. The last thing printed is
# `python -m bench.gpu summary`'s table.
#
# $OUT ends with at most 10 files: build.log tests.log run.log summary.txt kernels.json engine-qwen3-0.6b.json
# engine-qwen3-8b.json engine-qwen3.5-4b.json grpc.json grpc.server.log.
#
# Usage:
#   bench/gpu_check.sh                  on the H200 machine (OUT set by the device tool)
#   bench/gpu_check.sh --only kernels,engine8b   rerun some stages (env build tests kernels engine06b engine8b
#                                       engine35 grpc); build is skipped when pyscore/_C_cuda*.so exists for this
#                                       python
#   bench/gpu_check.sh --cpu-dry-run    here, on the CPU: every stage but the CUDA build and kernel tests, at tiny
#                                       sizes (the engine-path tests run on the CPU, as in `make test`)
#
# Wheels (the device has no registry; pybind11 and pytest are on its image, grpcio-tools / health / reflection
# are not, and grpcio + protobuf travel as a set matched to the generated code). Once, here, in the repo root:
#   bench/fetch_wheels.sh               which runs:
#     echo /.whl/ >> .git/info/exclude
#     python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#       grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
#       protobuf==7.36.2 pybind11==3.1.0 gguf==0.19.0
# and the device call names `.whl` in carry; this script installs them first (below).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=gpu
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) MODE=cpu ;;
    --only) ONLY=",$2,"; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
RUNLOG=$OUT/run.log
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1
START=$(date +%s)
: >"$SUMMARY"

if [ "$MODE" = gpu ]; then
  PY=python3
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "wheel install FAILED" | tee -a "$SUMMARY"
  fi
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  # explicit: without _C_cuda the engine still runs on the GPU (torch reference attention); every host core
  SIZE=(--device cuda --threads "$(nproc)")
  REPS=(--reps 40 --warmup 3)
  GRPC_SIZE=(--device cuda)
else
  PY=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
  SIZE=(--tiny)
  REPS=(--reps 3 --warmup 1)
  GRPC_SIZE=(--tiny)
fi

want() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]; }

# stage NAME LIMIT_S LOG -- command...: runs under timeout, appends its output to LOG, records rc and time.
stage() {
  local name=$1 limit=$2 log=$3
  shift 4
  if ! want "$name"; then return 0; fi
  local t0 rc
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S): $*" | tee -a "$log"
  # bash -c so that the exported shell functions (env_info, build, tests) run under timeout too
  timeout -k 5 "$limit" bash -c '"$@"' _ "$@" >>"$log" 2>&1
  rc=$?
  local line
  line=$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(($(date +%s) - t0))" "$([ $rc = 124 ] && echo TIMEOUT)")
  echo "$line" | tee -a "$SUMMARY" "$log"
  rm -f "$OUT"/*.tmp
  return 0
}

env_info() {
  echo "mode $MODE, python $PY, OUT $OUT"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
  command -v nvcc >/dev/null && nvcc --version | tail -1
  "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "tokenizers", "grpc", "grpc_tools", "google.protobuf", "grpc_health",
             "grpc_reflection", "pybind11", "pytest", "prometheus_client", "numpy"):
    try:
        m = importlib.import_module(name)
        print(f"{name:18} {getattr(m, '__version__', '?'):12} {getattr(m, '__file__', '')}")
    except Exception as e:
        print(f"{name:18} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
}

build() {
  if [ "$MODE" = cpu ]; then
    echo "dry run: no build (the CUDA build needs the device); checking the existing modules import"
  elif ls pyscore/_C_cuda.cpython-"$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"*.so \
      >/dev/null 2>&1 && [ -n "$ONLY" ]; then
    echo "rerun: pyscore/_C_cuda already built for this python, not rebuilding"
  else
    "$PY" setup.py -q build_ext --inplace || return 1
  fi
  "$PY" -c "
from pyscore.ops import _ext
cuda = _ext.cuda_module()
print('_C', _ext.cpu_module() is not None, '| _C_cuda', cuda is not None and cuda.available(), _ext.import_error(_ext.CUDA_MODULE) or '')"
}

tests() {
  if [ "$MODE" = cpu ]; then
    "$PY" -m pytest -q -p no:cacheprovider tests/bench_gpu
  else
    "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/ops tests/bench_gpu
  fi
}

export MODE PY ONLY
export -f env_info build tests
stage env 15 "$RUNLOG" -- env_info
stage build 110 "$OUT/build.log" -- build
stage tests 80 "$OUT/tests.log" -- tests
stage kernels 50 "$RUNLOG" -- "$PY" -m bench.kernels "${SIZE[@]}" --json "$OUT/kernels.json"
# bench.engine as the kit runs it: Generate, SIS and MIS over 8 distinct token-id questions per count, no stock
# transformers, the JSON rewritten after every count
ENGINE=("$PY" -m bench.engine "${SIZE[@]}" "${REPS[@]}" --modes generate sis mis --questions 8 --no-stock)
stage engine06b 70 "$RUNLOG" -- "${ENGINE[@]}" --shape qwen3-0.6b --overhead --budget-s 55 \
  --out "$OUT/engine-qwen3-0.6b.json"
stage engine8b 110 "$RUNLOG" -- "${ENGINE[@]}" --shape qwen3-8b --overhead --budget-s 90 \
  --out "$OUT/engine-qwen3-8b.json"
# Qwen3.5-4B: hybrid (Gated DeltaNet + gated attention); its 256-dim attention heads take the CUDA-core attention
# path. No overhead probe.
stage engine35 100 "$RUNLOG" -- "${ENGINE[@]}" --shape qwen3.5-4b --budget-s 80 --out "$OUT/engine-qwen3.5-4b.json"
stage grpc 45 "$RUNLOG" -- "$PY" -m bench.gpu grpc "${GRPC_SIZE[@]}" --shape qwen3-0.6b --out "$OUT/grpc.json"

{
  echo "total $(($(date +%s) - START)) s"
  echo
  "$PY" -m bench.gpu summary "$OUT" 2>&1
} >>"$SUMMARY"
echo
cat "$SUMMARY"
