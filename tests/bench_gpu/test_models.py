"""The random-weight engines of bench/models.py: published shapes, finite scores, MIS = SIS and the server hook, all at
tiny sizes on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from bench.models import SHAPES, RandomEngine, build_random_engine, hf_config, id_questions, labels_for
from pyscore.model.config import ModelConfig


@pytest.fixture(scope="module")
def engine32():
    return build_random_engine("tiny", device="cpu", dtype="float32")


@pytest.mark.parametrize("name, layers, params_b", [("qwen3-0.6b", 28, 0.440), ("qwen3-8b", 36, 6.946)])
def test_shapes_match_the_published_configs(name, layers, params_b):
    shape = SHAPES[name]
    cfg = ModelConfig.from_hf(hf_config(shape))
    assert (cfg.num_layers, cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size) == (layers, 128, 8, 151936)
    assert cfg.qk_norm and cfg.tie_word_embeddings == (name == "qwen3-0.6b")
    assert shape.matmul_params / 1e9 == pytest.approx(params_b, rel=1e-3)


@pytest.mark.parametrize("name, linear, attention", [("qwen3.5-0.8b", 18, 6), ("qwen3.5-4b", 24, 8)])
def test_hybrid_shapes_match_the_published_configs(name, linear, attention):
    from transformers import AutoModelForCausalLM

    hf = hf_config(SHAPES[name])
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_types.count("linear_attention") == linear
    assert cfg.layer_types[3::4] == ("full_attention",) * attention
    assert (cfg.head_dim, cfg.rotary_dims, cfg.vocab_size, cfg.linear.conv_channels) == (
        256, 64, 248320, 6144 if name == "qwen3.5-0.8b" else 8192)
    with torch.device("meta"):  # transformers' own layers, no memory: their matrices are the matmul weights
        model = AutoModelForCausalLM.from_config(hf)
    matrices = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    assert SHAPES[name].matmul_params == matrices


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_hybrid_engine_mis_equals_sis(dtype):
    engine = build_random_engine("tiny-qwen3.5", device="cpu", dtype=dtype)
    labels = labels_for(engine.cfg.vocab_size)
    for q in id_questions(5, 2, engine.cfg.vocab_size, tiny=True):
        mis = engine.score(q.query, q.items, label_token_ids=labels, mode="mis", apply_softmax=True)
        sis = engine.score(q.query, q.items, label_token_ids=labels, mode="sis", apply_softmax=True)
        values = [v for item in mis.scores for v in item[0]]
        assert all(math.isfinite(v) for v in values) and max(values) - min(values) > 1e-3
        for a, b in zip(mis.scores, sis.scores, strict=True):
            assert a[0] == pytest.approx(b[0], abs=1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_engine_scores_are_finite_and_mis_equals_sis(dtype, engine32):
    engine = engine32 if dtype == "float32" else build_random_engine("tiny", device="cpu", dtype=dtype)
    labels = labels_for(engine.cfg.vocab_size)
    for q in id_questions(5, 2, engine.cfg.vocab_size, tiny=True):
        mis = engine.score(q.query, q.items, label_token_ids=labels, mode="mis", apply_softmax=True)
        sis = engine.score(q.query, q.items, label_token_ids=labels, mode="sis", apply_softmax=True)
        values = [v for item in mis.scores for v in item[0]]
        assert all(math.isfinite(v) for v in values) and len(values) == 2 * len(q.items)
        assert max(values) - min(values) > 1e-3  # random weights still discriminate between items
        tol = 1e-5 if dtype == "float32" else 2e-2
        for a, b in zip(mis.scores, sis.scores, strict=True):
            assert a[0] == pytest.approx(b[0], abs=tol)


def test_random_engine_is_a_server_engine():
    engine = RandomEngine.from_pretrained("tiny", dtype="float32", device="cpu", threads=1, max_batch_tokens=256)
    assert engine.info().name == "random-tiny" and engine.max_batch_tokens == 256
    ids, _ = engine.tokenize("Hello world", add_special_tokens=False)
    assert engine.score(ids, [ids], label_token_ids=ids[:1]).scores
