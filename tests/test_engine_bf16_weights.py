"""fp32 serving of a bf16 checkpoint holds its projections, embedding and LM head in bf16 at the tiers whose linear
and label read-out kernels widen them exactly (pyscore.ops.linear.holds_bf16_weights; tiers avx2, avx512 and
avx512bf16, forced here on a CPU that runs them): MIS and SIS scores, greedy tokens with their logprobs (decode
steps) and prompt logprobs are bitwise those of the same engine holding fp32 weights (PYSCORE_FP32_WEIGHTS=1), and
match the transformers reference, with a tied head (the Qwen3 model) and an untied one (Qwen3.5); the memory plan
counts those matrices at 2 bytes each and the linear and label paths say what is held. Elsewhere (other tiers, an
fp32 checkpoint, bf16 serving) nothing is held in bf16 under fp32."""

from __future__ import annotations

import pytest
import torch

from pyscore.engine import Engine
from pyscore.model.checkpoint import Checkpoint
from pyscore.model.weights import held_in_bf16
from pyscore.ops import tiers
from pyscore.types import GenerateRequest, ScoreRequest
from tests.helpers import force_cpu_isa, force_cpu_tier, load_reference, make_model_dir
from tests.reference_scoring import max_abs_diff, reference_scores
from tests.test_engine_scores import ITEMS, QUERY

PROMPT = "the order was shipped and the customer asked where it is"


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def bf16_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(f"bf16_{request.param}"), request.param,
                          save_dtype=torch.bfloat16)


def engine(path, dtype: str = "float32") -> Engine:
    return Engine.from_pretrained(path, dtype=dtype, device="cpu", threads=2)


def answers(e: Engine) -> tuple:
    labels = [e.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("Yes", "No")]
    mis = e.score(QUERY, ITEMS, label_token_ids=labels, mode="mis")
    sis = e.score(QUERY, ITEMS, label_token_ids=labels, mode="sis")
    gen = e.generate(GenerateRequest(prompt=PROMPT, max_tokens=8, top_logprobs=3, prompt_logprobs=2,
                                     bypass_prefix_cache=True))
    return (mis.scores, sis.scores, gen.token_ids, [(t.logprob, t.top) for t in gen.logprobs],
            [(t.logprob, t.top) for t in gen.prompt_logprobs[1:]], labels)  # the first: NaN, no context


def held_dtypes(e: Engine) -> set[torch.dtype]:
    """The dtypes the projections, the embedding and the LM head are held in."""
    w = e.decoder.w
    return {*(p.dtype for p in w.projections()), w.embed.dtype, w.lm_head.dtype}


@pytest.mark.parametrize("tier", ["avx2", "avx512", "avx512bf16"])
def test_bf16_weights_are_bitwise_fp32_weights(bf16_dir, monkeypatch, tier):
    force_cpu_tier(monkeypatch, tier)
    assert tier in tiers.BF16_WEIGHT_TIERS
    held = engine(bf16_dir)
    assert held.decoder.bf16_weights and held.decoder.dtype == torch.float32
    assert held_dtypes(held) == {torch.bfloat16}
    ops = held.info().ops
    assert "held in bf16" in ops["linear"] and "LM head held in bf16" in ops["label_logprobs"]
    monkeypatch.setenv("PYSCORE_FP32_WEIGHTS", "1")
    wide = engine(bf16_dir)
    assert not wide.decoder.bf16_weights and held_dtypes(wide) == {torch.float32}
    got, want = answers(held), answers(wide)
    assert got == want  # every score, token and logprob, bit for bit

    specs = Checkpoint(bf16_dir).shapes()
    held_values = sum(spec.nbytes // 2 for name, spec in specs.items() if held_in_bf16(name))
    assert held_values > sum(spec.nbytes // 2 for name, spec in specs.items() if "embed_tokens" in name) > 0
    assert wide.memory.weight_bytes - held.memory.weight_bytes == 2 * held_values

    mis, *_, labels = got
    query = held.prepare_score(ScoreRequest(QUERY, ITEMS, label_token_ids=labels)).query
    items = [held.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    expected = reference_scores(load_reference(bf16_dir), query, items, labels, apply_softmax=False)
    assert max_abs_diff(mis, expected) < 1e-5


def test_nothing_is_held_in_bf16_elsewhere(bf16_dir, tmp_path, monkeypatch):
    force_cpu_isa(monkeypatch, "portable")  # tier generic: linear is torch's there
    assert not engine(bf16_dir).decoder.bf16_weights
    monkeypatch.delenv("PYSCORE_DISABLE_AVX512")
    force_cpu_isa(monkeypatch, "avx2")
    served_bf16 = engine(bf16_dir, "bfloat16")
    assert not served_bf16.decoder.bf16_weights and served_bf16.decoder.dtype == torch.bfloat16
    fp32_dir = make_model_dir(tmp_path / "fp32", "qwen3")  # an fp32 checkpoint: bf16 would round it
    fp32_served = engine(fp32_dir)
    assert not fp32_served.decoder.bf16_weights and held_dtypes(fp32_served) == {torch.float32}
