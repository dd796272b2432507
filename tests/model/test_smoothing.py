"""SmoothQuant at int8 load (pyscore.model.smoothing) on every family: the fold is exact in real arithmetic (a float
model with arbitrary factors folded in scores as before), the factors are floored at their quantile, calibration
sees every projection, and an int8 load is smoothed and the same at every load."""

from __future__ import annotations

import pytest
import torch

import pyscore.model.smoothing as smoothing
from pyscore.engine import Engine
from pyscore.model.checkpoint import Checkpoint
from pyscore.model.weights import layer_reader
from tests.helpers import make_model_dir
from tests.test_engine_scores import ITEMS, QUERY


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def scores(e: Engine) -> list[list[float]]:
    labels = [e.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("Yes", "No")]
    return e.score(QUERY, ITEMS, label_token_ids=labels, mode="mis").scores


def test_the_fold_keeps_the_float_model_s_scores(model_dir):
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, prefix_cache=False)
    before = scores(e)
    read = layer_reader(e.cfg, Checkpoint(model_dir).get, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(e.decoder.w.layers):
        hidden, inner = layer.input_norm.shape[0], layer.down.in_features
        source = read(i)
        smoothing.fold(source, {"input": torch.exp(torch.randn(hidden, generator=g)),
                                "gate_up": torch.exp(torch.randn(hidden, generator=g)),
                                "down": torch.exp(torch.randn(inner, generator=g))})
        assert not torch.equal(source.post_norm, layer.post_norm)
        e.decoder.replace_layer(i, source)
    torch.testing.assert_close(torch.tensor(scores(e)), torch.tensor(before), rtol=1e-4, atol=1e-5)


def test_factors_are_floored_at_their_quantile():
    amax_x = torch.tensor([100.0, 1.0, 0.01, 0.0, 5.0, 2.0, 3.0, 4.0])
    s = smoothing.factors(amax_x, torch.ones(3, 8))
    raw = amax_x.clamp_min(1e-5) ** smoothing.ALPHA
    assert torch.equal(s, raw.clamp_min(raw.quantile(smoothing.FLOOR)))
    assert s[0] > s[4] > s[1] and s[1] == s[2] == s[3]  # the quiet channels all raised to the floor


def test_an_int8_load_is_smoothed_and_the_same_every_time(model_dir, monkeypatch):
    first = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, quantize="int8")
    again = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, quantize="int8")
    plain = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2)
    pairs = zip(first.decoder.w.layers, again.decoder.w.layers, strict=True)
    assert all(torch.equal(a.post_norm, b.post_norm) for a, b in pairs)
    assert scores(first) == scores(again)
    assert not torch.equal(first.decoder.w.layers[0].post_norm, plain.decoder.w.layers[0].post_norm)
    assert first.model.read_layer is None  # the checkpoint's second pass is dropped once done
    assert "SmoothQuant" in first.info().ops["linear"]

    monkeypatch.setattr("pyscore.model.smoothing.smooth", lambda *args, **kwargs: None)
    unsmoothed = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, quantize="int8")
    assert scores(unsmoothed) != scores(first)


def test_calibration_sees_every_projection(model_dir, monkeypatch):
    monkeypatch.setattr("pyscore.model.smoothing.smooth", lambda *args, **kwargs: None)
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, quantize="int8")
    tokens = e.tokenizer(smoothing.CALIBRATION[0])["input_ids"]
    amax = smoothing.calibrate(e.decoder, [tokens])
    projections = e.decoder.w.projections()
    assert set(amax) == {id(w) for w in projections}
    assert all(amax[id(w)].shape == (w.in_features,) and amax[id(w)].max() > 0 for w in projections)


def test_a_short_context_model_calibrates_on_each_text_s_start(tmp_path):
    short = make_model_dir(tmp_path / "short", "llama", max_position_embeddings=16)
    e = Engine.from_pretrained(short, dtype="float32", device="cpu", threads=2, quantize="int8")
    assert e.cfg.max_position_embeddings == 16 and "SmoothQuant" in e.info().ops["linear"]
