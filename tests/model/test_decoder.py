"""The packed decoder equals stock transformers: logits at every position of a sequence (fp32, <= 1e-5
relative to the logit scale), for tiny random Qwen3 / Qwen2 / Llama (llama3 RoPE scaling) and the embedded
SmolLM2; bf16 within 2x torch's own bf16 error."""

from __future__ import annotations

import pytest
import torch

from pyscore.model.decoder import Decoder
from pyscore.model.loading import load_model
from pyscore.model.packing import Group, pack
from tests.helpers import load_reference, make_model_dir

TEXT = "Context: the order 1234 was shipped on Monday. Proposed answer: cancel the order? Yes"


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def tiny(request, tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    return path, load_reference(path)


def our_logits(path, dtype, ids, backend="auto"):
    m = load_model(path, dtype, torch.device("cpu"))
    dec = Decoder(m.cfg, m.weights, m.rotary, backend)
    batch = pack([Group(prefix=[], items=[ids], readouts=[list(range(len(ids)))])])
    return (dec.hidden_at(batch).float() @ m.weights.lm_head.float().T), m


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_fp32_logits_match_transformers(tiny, backend):
    path, ref = tiny
    ids = load_model(path, torch.float32, torch.device("cpu")).tokenizer(TEXT)["input_ids"]
    ours, _ = our_logits(path, torch.float32, ids, backend)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    diff = (ours - expected).abs().max().item()
    assert diff <= 1e-5 * max(1.0, expected.abs().max().item()), f"max diff {diff}"


def test_bf16_logits_within_torch_bf16_error(tiny):
    path, ref = tiny
    ids = load_model(path, torch.float32, torch.device("cpu")).tokenizer(TEXT)["input_ids"]
    ours, _ = our_logits(path, torch.bfloat16, ids)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        torch_bf16 = load_reference(path).to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    ours_err = (ours - expected).abs().max().item()
    torch_err = (torch_bf16 - expected).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3, f"ours {ours_err} vs torch bf16 {torch_err}"


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = load_model(smollm2_dir, torch.float32, torch.device("cpu")).tokenizer(TEXT)["input_ids"]
    ours, m = our_logits(smollm2_dir, torch.float32, ids)
    assert m.cfg.num_layers == 30 and m.cfg.vocab_size == 49152
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    diff = (ours - expected).abs().max().item()
    assert diff <= 1e-5 * max(1.0, expected.abs().max().item()), f"max diff {diff}"


def test_attention_is_planned_once_per_forward_pass(tiny, monkeypatch):
    """Decoder.hidden_at validates the segment table and plans attention once and hands the plan to every layer."""
    import pyscore.model.decoder as decoder_module

    made, runs = [], []

    class CountingPlan(decoder_module.AttentionPlan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def run(self, q, k, v, scale=None):
            runs.append(self)
            return super().run(q, k, v, scale)

    monkeypatch.setattr(decoder_module, "AttentionPlan", CountingPlan)
    path, _ = tiny
    m = load_model(path, torch.float32, torch.device("cpu"))
    dec = Decoder(m.cfg, m.weights, m.rotary)
    batch = pack([Group(prefix=[5, 6, 7], items=[[8, 9], [10]], readouts=[[1], [0]]), Group([], [[3, 4]], [[1]])])
    dec.hidden_at(batch)
    assert len(made) == 1 and runs == made * m.cfg.num_layers
