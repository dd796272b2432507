"""GGUF -> a Hugging Face directory (config, fp32 safetensors, tokenizer), converted once and cached by the loader.

Tensor by tensor: the model's names and shapes come from its transformers class built on the meta device (no
memory), the GGUF is memory-mapped by gguf's reader, and each tensor is de-quantized, put in transformers' layout
(`TensorProcessor`, e.g. Llama's q/k permutation undone) and written before the next is read; the pages of the
mapping read so far are dropped after each. The values are transformers' own GGUF loading's, bit for bit; only the
memory differs: one tensor instead of the whole de-quantized model (the SmolLM2 GGUF: ~0.5 GB -> ~0.1 GB)."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from pyscore.model.checkpoint import TensorSpec, write_safetensors

ROWS_PER_SLAB = 4096


def convert_gguf(gguf: Path, out: Path) -> None:
    """Writes config.json, model.safetensors (fp32) and the tokenizer of `gguf` to `out` (atomically: a
    half-written cache is never picked up)."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    reader = GGUFReader(gguf)
    processor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)(
        config=config.to_dict())
    reader.fields.clear()  # the parsed metadata (a vocabulary's worth of small arrays): AutoConfig has read it
    hf_name = get_gguf_hf_weights_map(skeleton, processor)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    expected = {k: v for k, v in skeleton.state_dict().items() if not (tied and k == "lm_head.weight")}
    sources = {hf_name[t.name]: t for t in reader.tensors if hf_name.get(t.name) in expected}
    if missing := sorted(expected.keys() - sources.keys()):
        raise ValueError(f"{gguf.name} lacks tensors the {type(skeleton).__name__} needs: {missing[:5]}")
    specs = [TensorSpec(name, torch.float32, tuple(expected[name].shape)) for name in sorted(sources)]

    def tensor_of(spec: TensorSpec) -> torch.Tensor:
        t = sources[spec.name]
        values = processor.process(weights=_dequantize(t, dequantize), name=t.name, tensor_key_mapping=hf_name,
                                   parsed_parameters={}).weights
        tensor = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(spec.shape)
        _drop_mapped_pages(reader.data)
        return tensor

    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["architectures"] = [type(skeleton).__name__]
    config_dict["dtype"] = "float32"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        write_safetensors(tmp / "model.safetensors", specs, tensor_of, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2))
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dequantize(t, dequantize) -> np.ndarray:
    """gguf's `dequantize`, a slab of rows at a time: its temporaries for a whole embedding (several times the
    result) would be the conversion's peak. Quantization blocks never span rows, so the values are the same."""
    data = t.data
    if data.ndim < 2 or len(data) <= ROWS_PER_SLAB:
        return dequantize(data, t.tensor_type)
    first = dequantize(data[:ROWS_PER_SLAB], t.tensor_type)
    out = np.empty((len(data), *first.shape[1:]), dtype=first.dtype)
    out[:ROWS_PER_SLAB] = first
    for start in range(ROWS_PER_SLAB, len(data), ROWS_PER_SLAB):
        out[start:start + ROWS_PER_SLAB] = dequantize(data[start:start + ROWS_PER_SLAB], t.tensor_type)
    return out


def _drop_mapped_pages(data: np.ndarray) -> None:
    """Takes the pages of a read-only file mapping out of the resident set (they stay in the page cache, and a
    later read maps them back): what is read through a mapping otherwise stays resident until it is unmapped."""
    mapped = getattr(data, "_mmap", None)
    if isinstance(mapped, mmap.mmap) and hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_DONTNEED)
