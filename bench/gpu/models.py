"""Random-weight Qwen3-shaped engines built in memory: the published Qwen3-0.6B and Qwen3-8B shapes (and a tiny
one for CPU tests) with weights drawn on the target device, so the H200 run needs neither a model hub nor 16 GB
of files. Latency does not depend on weight values; the scale keeps bf16 activations finite.

`RandomEngine` is a drop-in for the server's hidden `--engine` flag:
`python -m server --engine bench.gpu.models:RandomEngine --model qwen3-0.6b`."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pyscore.engine import Engine, resolve_device, resolve_dtype, set_threads
from pyscore.model.config import ModelConfig
from pyscore.model.loading import LoadedModel
from pyscore.model.rope import Rotary, inverse_frequencies
from pyscore.model.weights import build_weights


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int = 40960

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies through (the layers; not the embedding or the LM head)."""
        attn = (self.q_heads + 2 * self.kv_heads + self.q_heads) * self.head_dim * self.hidden  # qkv + o
        return self.layers * (attn + 3 * self.hidden * self.intermediate)

    @property
    def weight_bytes_bf16(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return 2 * (self.matmul_params + embed)


SHAPES = {
    # config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B
    "qwen3-0.6b": Shape(hidden=1024, layers=28, q_heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                        vocab=151936, tied=True),
    "qwen3-8b": Shape(hidden=4096, layers=36, q_heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      vocab=151936, tied=False),
    # CPU tests: head_dim 64 so the CUDA kernel's tensor-core path takes it too
    "tiny": Shape(hidden=128, layers=2, q_heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=1024,
                  tied=True, max_positions=2048),
}


def qwen3_config(shape: Shape):
    """A transformers Qwen3Config with the shape's numbers (rope theta 1e6 and eps 1e-6 as in Qwen3)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                      intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied,
                      max_position_embeddings=shape.max_positions, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def random_getter(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """name -> random tensor of the HF state dict, drawn directly on `device` in `dtype`. Weights have std
    1/sqrt(fan_in) (unit-variance outputs behind each RMSNorm, logits of unit scale), norms are ones, no biases."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hd, hq, hkv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (hq * hd, h), "k_proj": (hkv * hd, h), "v_proj": (hkv * hd, h), "o_proj": (h, hq * hd),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}

    def randn(rows: int, cols: int, std: float) -> torch.Tensor:
        w = torch.empty(rows, cols, dtype=dtype, device=device)
        return w.normal_(0.0, std, generator=generator)

    def get(name: str) -> torch.Tensor | None:
        leaf = name.rsplit(".", 2)
        if name.endswith(".bias"):
            return None
        if name.endswith("norm.weight"):
            size = hd if leaf[-2] in ("q_norm", "k_norm") else h
            return torch.ones(size, dtype=dtype, device=device)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return randn(cfg.vocab_size, h, h**-0.5)  # logits of unit scale behind the final norm
        rows, cols = shapes[leaf[-2]]
        return randn(rows, cols, cols**-0.5)

    return get


def tiny_tokenizer():
    """The tests' byte-level BPE (a few hundred tokens): requests are token ids, the tokenizer only serves the
    engine's text paths (warm-up, decoding generated tokens)."""
    from tests.helpers import make_tokenizer

    return make_tokenizer(Path(tempfile.mkdtemp(prefix="pyscore-random-tok-")))


def build_random_model(shape_name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LoadedModel:
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; expected one of {', '.join(SHAPES)}")
    hf = qwen3_config(SHAPES[shape_name])
    cfg = ModelConfig.from_hf(hf)
    with torch.inference_mode():
        weights = build_weights(cfg, random_getter(cfg, dtype, device, seed), dtype, device)
    inv_freq, scaling = inverse_frequencies(hf, cfg.head_dim)
    rotary = Rotary(inv_freq, scaling, cfg.max_position_embeddings, device)
    return LoadedModel(name=f"random-{shape_name}", path=Path(f"random:{shape_name}"), cfg=cfg, hf_config=hf,
                       tokenizer=tiny_tokenizer(), weights=weights, rotary=rotary)


def build_random_engine(shape_name: str, *, device: str = "auto", dtype: str | torch.dtype = "auto",
                        max_batch_tokens: int = 8192, seed: int = 0) -> Engine:
    dev = resolve_device(device)
    return Engine(build_random_model(shape_name, resolve_dtype(dtype, dev), dev, seed), max_batch_tokens)


class RandomEngine(Engine):
    """`Engine.from_pretrained` with the model argument read as a shape name (default qwen3-0.6b)."""

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
                        device: str = "auto", threads: int | None = None, max_batch_tokens: int = 8192,
                        op_backend: str = "auto") -> RandomEngine:
        set_threads(threads)
        dev = resolve_device(device)
        loaded = build_random_model(str(model or "qwen3-0.6b"), resolve_dtype(dtype, dev), dev)
        return cls(loaded, max_batch_tokens, op_backend)
