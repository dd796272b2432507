#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with the cp312 manylinux wheels that bench/gpu_check.sh
# installs on the H200 machine, which has no registry access. One version of each: two stop the whole install.
# grpcio, grpcio-tools and protobuf travel as one matched set (the generated code checks the runtime's version),
# so the device's own grpcio/protobuf are shadowed rather than trusted. pytest is already on the device image.
# Usage: bench/fetch_wheels.sh [python]   (run from anywhere; writes <repo>/.whl)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
PKGS=(grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
      protobuf==7.36.2 pybind11==3.1.0 gguf==0.19.0)
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PKGS[@]}"
ls -l .whl | awk 'NR > 1 {printf "%9d  %s\n", $5, $9}'
du -sh .whl
