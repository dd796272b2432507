"""Devices and dtypes at start-up: a GPU that torch sees but pyscore cannot use is said loudly, and float16 on
the CPU (no fp16 kernels there: every op runs its PyTorch reference) is correct, only slow, and says so."""

from __future__ import annotations

import logging

import pytest
import torch

from pyscore.engine import Engine, resolve_device
from pyscore.ops import _ext
from pyscore.types import GenerateRequest, ScoreRequest
from tests.helpers import load_reference, make_model_dir
from tests.reference_scoring import max_abs_diff, reference_scores

QUERY = "Context: the order 1234 was shipped on Monday and is in transit.\nQuestion: what should the agent do?"
ITEMS = [" Proposed answer: tell the customer the order is on its way.", " A", " Proposed answer: cancel it."]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_gpu_pyscore_cannot_use_is_said_loudly(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(_ext, "cuda_status", lambda: (False, "CUDA off: `_C_cuda` failed to import: no such file"))
    with caplog.at_level(logging.WARNING):
        assert resolve_device("auto") == torch.device("cpu")
    said = warnings_of(caplog)
    assert any("2 CUDA device(s)" in m and "no such file" in m and "CPU" in m for m in said), said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resolve_device("cpu") == torch.device("cpu")  # asked for: nothing to warn about
    assert warnings_of(caplog) == []


def test_float16_on_cpu_is_correct_and_says_it_is_slow(tmp_path, caplog):
    path = make_model_dir(tmp_path, "qwen3")
    with caplog.at_level(logging.WARNING):
        e = Engine.from_pretrained(path, dtype="float16", device="cpu", threads=2)
    assert any("float16" in m and "bfloat16" in m for m in warnings_of(caplog)), warnings_of(caplog)
    labels = [5, 9, 17]
    query = e.prepare_score(ScoreRequest(QUERY, ITEMS, label_token_ids=labels)).query
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    reference = load_reference(path)
    expected = reference_scores(reference, query, items, labels)
    torch_err = max_abs_diff(reference_scores(reference.to(torch.float16), query, items, labels), expected)
    for mode in ("sis", "mis"):
        ours = e.score(QUERY, ITEMS, label_token_ids=labels, mode=mode).scores
        assert max_abs_diff(ours, expected) <= 2 * torch_err + 1e-4, (mode, max_abs_diff(ours, expected), torch_err)
    assert len(e.generate(GenerateRequest(prompt=QUERY, max_tokens=4)).logprobs) in range(1, 5)
