"""Random-weight engines built in memory, and the token-id questions they are asked: the published Qwen3-0.6B /
1.7B / 4B / 8B shapes, the hybrid Qwen3.5-0.8B and Qwen3.5-4B shapes (3 Gated DeltaNet layers to 1 gated attention
layer), and tiny ones for CPU tests, with weights drawn on the target device, so the H200 run needs neither a model
hub nor 16 GB of files. Latency does not depend on weight values; the scale keeps bf16 activations finite.

Questions are random token ids with the lengths Qwen3's tokenizer gives the pointwise Open-Jev-like prompts of the
bench suite (bench/prompts.py `pointwise`): a query of 270-350 tokens (context + question) and one item of 25-40
tokens per candidate. A random-weight model reads any ids the same way, and ids keep the real tokenizer out.

`RandomEngine` is a drop-in for the server's hidden `--engine` flag:
`python -m server --engine bench.models:RandomEngine --model qwen3-0.6b`."""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pyscore.engine import Engine, resolve_device, resolve_dtype, set_threads
from pyscore.model.config import ModelConfig
from pyscore.model.loading import LoadedModel
from pyscore.model.rope import Rotary, inverse_frequencies
from pyscore.model.weights import build_weights


@dataclass(frozen=True)
class LinearShape:
    """Qwen3.5's Gated DeltaNet layers: key / value heads, their dim, the conv kernel; every `interval`-th layer is
    (gated) full attention."""

    k_heads: int
    v_heads: int
    head_dim: int = 128
    conv_kernel: int = 4
    interval: int = 4


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
    linear: LinearShape | None = None

    @property
    def num_linear(self) -> int:
        return 0 if self.linear is None else self.layers - self.layers // self.linear.interval

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies through (the layers; not the embedding or the LM head)."""
        gate = self.q_heads if self.linear else 0  # Qwen3.5's q_proj also yields the output gate
        attn = (2 * self.q_heads + 2 * self.kv_heads + gate) * self.head_dim * self.hidden  # qkv (+ gate) + o
        mixers = (self.layers - self.num_linear) * attn
        if self.linear:
            lin = self.linear
            value = lin.v_heads * lin.head_dim
            width = 2 * lin.k_heads * lin.head_dim + 2 * value + 2 * lin.v_heads  # in_proj qkv, z, b, a
            mixers += self.num_linear * (width + value) * self.hidden  # + out_proj
        return mixers + self.layers * 3 * self.hidden * self.intermediate


SHAPES = {
    # config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B
    "qwen3-0.6b": Shape(hidden=1024, layers=28, q_heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                        vocab=151936, tied=True),
    "qwen3-8b": Shape(hidden=4096, layers=36, q_heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      vocab=151936, tied=False),
    # config.json of Qwen/Qwen3-1.7B and Qwen/Qwen3-4B (bench.memory's checkpoints)
    "qwen3-1.7b": Shape(hidden=2048, layers=28, q_heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                        vocab=151936, tied=True),
    "qwen3-4b": Shape(hidden=2560, layers=36, q_heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                      vocab=151936, tied=True),
    # config.json of Qwen/Qwen3.5-0.8B and Qwen/Qwen3.5-4B (text_config)
    "qwen3.5-0.8b": Shape(hidden=1024, layers=24, q_heads=8, kv_heads=2, head_dim=256, intermediate=3584,
                          vocab=248320, tied=True, linear=LinearShape(k_heads=16, v_heads=16)),
    "qwen3.5-4b": Shape(hidden=2560, layers=32, q_heads=16, kv_heads=4, head_dim=256, intermediate=9216,
                        vocab=248320, tied=True, linear=LinearShape(k_heads=16, v_heads=32)),
    # CPU tests: head_dim 64 so the CUDA kernel's tensor-core path takes it too
    "tiny": Shape(hidden=128, layers=2, q_heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=1024,
                  tied=True, max_positions=2048),
    "tiny-qwen3.5": Shape(hidden=128, layers=4, q_heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=1024,
                          tied=True, max_positions=2048, linear=LinearShape(k_heads=2, v_heads=4, head_dim=32)),
}


def hf_config(shape: Shape):
    """The transformers config of a shape: Qwen3 (rope theta 1e6) or, with linear layers, Qwen3.5 text (rope theta
    1e7, a quarter of each head rotating); eps 1e-6 in both, as published."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied,
                  max_position_embeddings=shape.max_positions, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    lin = shape.linear
    if lin is None:
        cfg = Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        cfg.architectures = ["Qwen3ForCausalLM"]
        return cfg
    cfg = Qwen3_5TextConfig(
        **common, linear_num_key_heads=lin.k_heads, linear_num_value_heads=lin.v_heads,
        linear_key_head_dim=lin.head_dim, linear_value_head_dim=lin.head_dim, linear_conv_kernel_dim=lin.conv_kernel,
        layer_types=["full_attention" if (i + 1) % lin.interval == 0 else "linear_attention"
                     for i in range(shape.layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def random_getter(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """name -> random tensor of the HF state dict (`model.` prefix), drawn directly on `device` in `dtype`, None for
    names it does not hold. Weights have std 1/sqrt(fan_in) (unit-variance outputs behind each RMSNorm, logits of
    unit scale), norms are unit scales (zero-centred norms: zeros), no biases; Qwen3.5's decay parameters as
    transformers initialises them."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hd, hq, hkv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_rows = (2 if cfg.attn_output_gate else 1) * hq * hd
    shapes = {"q_proj": (q_rows, h), "k_proj": (hkv * hd, h), "v_proj": (hkv * hd, h), "o_proj": (h, hq * hd),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    lin = cfg.linear
    if lin is not None:
        value = lin.num_v_heads * lin.v_dim
        shapes.update(in_proj_qkv=(lin.conv_channels, h), in_proj_z=(value, h), in_proj_b=(lin.num_v_heads, h),
                      in_proj_a=(lin.num_v_heads, h), out_proj=(h, value))

    def randn(*size: int, std: float) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device).normal_(0.0, std, generator=generator)

    def get(name: str) -> torch.Tensor | None:
        if not name.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head")):
            return None
        leaf = name.rsplit(".", 2)
        if name.endswith(".bias"):
            return None
        if name.endswith("linear_attn.norm.weight"):
            return torch.ones(lin.v_dim, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            size = hd if leaf[-2] in ("q_norm", "k_norm") else h
            return (torch.zeros if cfg.zero_centred_norm else torch.ones)(size, dtype=dtype, device=device)
        if name.endswith("conv1d.weight"):
            return randn(lin.conv_channels, 1, lin.conv_kernel, std=lin.conv_kernel**-0.5)
        if name.endswith("A_log"):
            return torch.empty(lin.num_v_heads, device=device).uniform_(1.0, 16.0, generator=generator).log()
        if name.endswith("dt_bias"):
            return torch.ones(lin.num_v_heads, device=device)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return randn(cfg.vocab_size, h, std=h**-0.5)  # logits of unit scale behind the final norm
        rows, cols = shapes[leaf[-2]]
        return randn(rows, cols, std=cols**-0.5)

    return get


def tiny_tokenizer():
    """The tests' byte-level BPE (a few hundred tokens): requests are token ids, the tokenizer only serves the
    engine's text paths (warm-up, decoding generated tokens)."""
    from bench.tiny_tokenizer import make_tokenizer

    return make_tokenizer(Path(tempfile.mkdtemp(prefix="pyscore-random-tok-")))


def build_random_model(shape_name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                       cpu_draws: bool = False, quantize: str | None = None) -> LoadedModel:
    """cpu_draws: draw the weights in fp32 on the CPU and load them onto `device` in `dtype` as a checkpoint's would be
    (fp32 norms stay fp32): every device and dtype then holds the same values, rounded, which the GPU tests compare
    against the fp32 CPU engine. Otherwise they are drawn on `device` in `dtype` (fast for big shapes). quantize:
    as Engine.from_pretrained's ("int8": the projections in int8)."""
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; expected one of {', '.join(SHAPES)}")
    hf = hf_config(SHAPES[shape_name])
    cfg = ModelConfig.from_hf(hf)
    draw = (torch.float32, torch.device("cpu")) if cpu_draws else (dtype, device)
    with torch.inference_mode():
        weights = build_weights(cfg, random_getter(cfg, *draw, seed), dtype, device, quantize=quantize)
    inv_freq, scaling = inverse_frequencies(hf, cfg.rotary_dims)
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
                        device: str = "auto", threads: int | None = None, quantize: str | None = None,
                        **engine_args: Any) -> RandomEngine:
        set_threads(threads)
        dev = resolve_device(device)
        loaded = build_random_model(str(model or "qwen3-0.6b"), resolve_dtype(dtype, dev), dev, quantize=quantize)
        return cls(loaded, **engine_args)


# --- token-id questions --------------------------------------------------------------------------------------------
CANDIDATE_COUNTS = (2, 5, 9, 16)  # the study's buckets (bench/dataset.py BUCKETS)
YES_NO = (9454, 2753)  # Qwen3's " Yes" / " No"; any ids below the vocabulary would do


@dataclass
class IdQuestion:
    query: list[int]
    items: list[list[int]]


def id_questions(num_items: int, count: int, vocab: int, seed: int = 0, tiny: bool = False) -> list[IdQuestion]:
    """`count` distinct seeded questions of `num_items` candidates: queries of 270-350 tokens, items of 25-40
    (`tiny`: 20-30 and 3-6, for CPU tests)."""
    query_tokens, item_tokens = ((20, 30), (3, 6)) if tiny else ((270, 350), (25, 40))
    low = min(1000, vocab // 2)  # skip the low ids, where tokenizers keep their special tokens

    def ids(rng: random.Random, lengths: tuple[int, int]) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(rng.randint(*lengths))]

    rngs = [random.Random(seed * 1000 + 17 * num_items + i) for i in range(count)]
    return [IdQuestion(ids(rng, query_tokens), [ids(rng, item_tokens) for _ in range(num_items)]) for rng in rngs]


def labels_for(vocab: int) -> list[int]:
    return list(YES_NO) if vocab > max(YES_NO) else [vocab // 3, vocab // 2]
