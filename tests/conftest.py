"""Shared test setup: CUDA-marked tests are skipped unless pyscore._C_cuda imports and sees a GPU; torch
threads are pinned so timings and OpenMP pools do not oversubscribe the 2-core CI machine."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


def cuda_available() -> bool:
    from pyscore.ops import _ext

    module = _ext.cuda_module()
    return bool(module is not None and module.available() and torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, a CUDA torch build and pyscore._C_cuda")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2 GGUF converted (once, cached) to a safetensors directory."""
    from pyscore.model.loading import resolve_model_dir

    path, _ = resolve_model_dir(None)
    return path
