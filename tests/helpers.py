"""Tiny random models built in code (Qwen3, Qwen2, Llama, Qwen3.5; causal LM and sequence classification, and the
Qwen3.5 image-text-to-text checkpoint) with a small byte-level BPE tokenizer trained on the spot, saved as ordinary
Hugging Face directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.tiny_tokenizer import make_tokenizer

# What the reference path (and any op served by torch) promises where the kernel path is bitwise: a request's
# scores alone vs packed with others, and warm vs cold, differ by at most this (absolute, on a probability). The
# guarantees page and the proto state these numbers; measured: 2.4e-6 fp32 on SmolLM2, 3.6e-3 bf16 on a SmolLM2-wide
# model.
REFERENCE_TOL = {"float32": 1e-5, "bfloat16": 1e-2}

# Qwen3.5 at toy size: 3 Gated DeltaNet layers then 1 gated full-attention layer, 4/2 attention heads of 16 (half of
# each rotates), 2 key / 4 value linear heads of 16, conv kernel 4.
QWEN3_5_TEXT = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=1, num_position_embeddings=16)


def tiny_config(arch: str, vocab_size: int, classifier: bool = False, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3_5Config, Qwen3_5TextConfig, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  eos_token_id=2, bos_token_id=1, pad_token_id=0)
    if arch == "qwen3":
        cfg = Qwen3Config(head_dim=32, tie_word_embeddings=True, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=False, **common)
    elif arch == "llama":
        cfg = LlamaConfig(head_dim=16, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 128}, **common)
    elif arch == "qwen3_5":
        cfg = Qwen3_5TextConfig(tie_word_embeddings=False, **dict(common, num_hidden_layers=4), **QWEN3_5_TEXT)
    elif arch == "qwen3_5_vl":  # the image-text-to-text checkpoint: the same language model nested, plus vision
        text = dict(common, num_hidden_layers=4, tie_word_embeddings=True, **QWEN3_5_TEXT)
        cfg = Qwen3_5Config(text_config=text, vision_config=QWEN3_5_VISION, tie_word_embeddings=True)
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
        return cfg
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    name = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama", "qwen3_5": "Qwen3_5"}[arch]
    if arch == "qwen3_5" and classifier:
        name = "Qwen3_5Text"
    cfg.architectures = [f"{name}For{'SequenceClassification' if classifier else 'CausalLM'}"]
    if classifier:  # three named classes, or one (a cross-encoder's relevance head) with num_labels=1
        cfg.id2label = {0: "bad", 1: "neutral", 2: "good"} if overrides.get("num_labels", 3) == 3 else {
            i: f"class_{i}" for i in range(overrides["num_labels"])}
        cfg.num_labels = len(cfg.id2label)
        cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    return cfg


def make_model_dir(path: Path, arch: str, classifier: bool = False, seed: int = 0,
                   save_dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A saved random tiny model with a trained tokenizer, its tensors stored in `save_dtype`; returns the
    directory."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    cfg = tiny_config(arch, vocab_size=len(tok) + 8, classifier=classifier, **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    if arch == "qwen3_5_vl":
        auto = AutoModelForImageTextToText
    model = auto.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; make activations big enough for meaningful comparisons
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            if arch.startswith("qwen3_5") and name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0, 0.1)  # zero-centred: the norm scales by (1 + w), ~1 like the others' w
    model.to(save_dtype).save_pretrained(path)
    return path


def load_reference(path: Path):
    """The stock transformers model (fp32, sdpa) for a saved directory: its own architecture's class."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    cfg = AutoConfig.from_pretrained(path)
    auto = (AutoModelForSequenceClassification if cfg.architectures[0].endswith("SequenceClassification")
            else AutoModelForImageTextToText if cfg.architectures[0].endswith("ForConditionalGeneration")
            else AutoModelForCausalLM)
    return auto.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of their dtype (fp32 or bf16), elementwise: the count of representable
    values between them (0 = bitwise equal; +0 and -0 count as equal)."""
    assert a.dtype == b.dtype and a.dtype in (torch.float32, torch.bfloat16)

    def ordered(x: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits -> monotonic integers
        if x.dtype == torch.bfloat16:
            bits, magnitude = x.view(torch.int16).long(), 0x7FFF
        else:
            bits, magnitude = x.view(torch.int32).long(), 0x7FFFFFFF
        return torch.where(bits < 0, -(bits & magnitude), bits)

    return (ordered(a) - ordered(b)).abs()


# The CPU kernel paths an op test runs: the hardware's own tier, AVX2 + FMA forced, the portable scalar code.
CPU_ISAS = ["avx512", "avx2", "portable"]


def force_cpu_isa(monkeypatch, isa: str) -> str:
    """Makes the CPU kernels take `isa`'s path (one of CPU_ISAS) for the rest of the test; skips "avx2" on a CPU
    without AVX2 + FMA + F16C and checks that the launchers really dispatch to it."""
    from pyscore.ops import _ext

    if isa == "portable":
        monkeypatch.setenv("PYSCORE_DISABLE_AVX512", "1")
    elif isa == "avx2":
        module = _ext.cpu_module()
        if module is None or not module.cpu_features()["avx2"]:
            pytest.skip("needs pyscore._C on a CPU with AVX2 + FMA + F16C")
        monkeypatch.setenv("PYSCORE_CPU_TIER", "avx2")
        assert module.cpu_features()["path"] == "avx2"
    return isa


def force_cpu_tier(monkeypatch, tier: str) -> None:
    """Forces the CPU kernels to `tier` (PYSCORE_CPU_TIER) for the rest of the test; skips unless this CPU runs it."""
    from pyscore.ops import _ext

    if tier not in _ext.runnable_cpu_tiers():
        pytest.skip(f"needs a CPU that runs tier {tier}")
    monkeypatch.setenv("PYSCORE_CPU_TIER", tier)


def outputs_at_tiers(monkeypatch, run, tiers=("avx512", "avx512bf16", "avx2")) -> dict[str, torch.Tensor]:
    """run() with the CPU kernels forced to each tier in turn (PYSCORE_CPU_TIER); skips unless this CPU runs them
    all (one with AVX512-BF16)."""
    from pyscore.ops import _ext

    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16 (to run tiers " + ", ".join(tiers) + ")")
    out = {}
    for tier in tiers:
        monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
        out[tier] = run()
    return out


def on_device(monkeypatch, device: str) -> str:
    """A test's device parameter: "cpu-avx2" / "cpu-portable" force that CPU path (force_cpu_isa) and run on "cpu";
    any other device is returned as it is."""
    if device.startswith("cpu-"):
        force_cpu_isa(monkeypatch, device.removeprefix("cpu-"))
        return "cpu"
    return device


def count_passes(e, monkeypatch) -> list[int]:
    """The tokens each forward pass of `e` computes, in order (the list fills as they run)."""
    passes: list[int] = []
    real = e.decoder.hidden_at

    def counted(batch, **kw):
        passes.append(int(batch.tokens.numel()))
        return real(batch, **kw)

    monkeypatch.setattr(e.decoder, "hidden_at", counted)
    return passes
