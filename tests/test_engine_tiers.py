"""The engine on every CPU tier this machine runs (forced with PYSCORE_CPU_TIER; an AVX-512 machine also runs the
avx2 and avx512 tiers' code): the production path of each tier (pyscore/ops/tiers.py) scores like the transformers
reference, and keeps the exactness guarantees that the tier table promises. Where every row-mixing op of a tier
(attention, the label read-out) is our kernel, MIS = SIS, warm = cold and alone = with batch-mates hold bitwise
(linear's torch path is batch-invariant by its fixed-height calls). Run with torch forced to a lower ISA too
(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2) to see an AVX2 machine's torch under
the same promises."""

from __future__ import annotations

import pytest
import torch

from pyscore.engine import Engine
from pyscore.ops import _ext, tiers
from pyscore.types import ScoreRequest
from tests.helpers import load_reference, make_model_dir
from tests.reference_scoring import max_abs_diff, reference_scores
from tests.test_engine_scores import ITEMS, QUERY, STRANGERS

# The ops whose torch version mixes rows (a dense [T, T] softmax, a GEMM over the read-out rows): where one of them is
# torch's at a tier, its scores can move with batch-mates by rounding.
ROW_MIXING_OPS = ("prefix_item_attention", "decode_attention", "label_logprobs")


def exact(tier: str, dtype: torch.dtype) -> bool:
    """Whether the tier's production path promises bitwise batch invariance (every row-mixing op is our kernel)."""
    return all(tiers.cpu_choice(op, tier, dtype).path == "kernel" for op in ROW_MIXING_OPS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # SmolLM2's widths (K = 576 and 1536: AMX-sized, and where oneDNN's row blocking was seen to move bits)
    return make_model_dir(tmp_path_factory.mktemp("tiers"), "qwen3", hidden_size=576, intermediate_size=1536,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64)


@pytest.fixture(params=_ext.runnable_cpu_tiers() if _ext.cpu_module() else [])
def tier(request, monkeypatch):
    monkeypatch.setenv("PYSCORE_CPU_TIER", request.param)
    assert _ext.cpu_tier() == request.param
    return request.param


def engine(path, dtype: str, **kw) -> Engine:
    return Engine.from_pretrained(path, dtype=dtype, device="cpu", threads=2, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_tier_scores_like_transformers(model_dir, tier, dtype):
    e = engine(model_dir, dtype)
    labels = [e.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("Yes", "No")]
    result = e.score(QUERY, ITEMS, label_token_ids=labels, apply_softmax=True)
    query = e.prepare_score(ScoreRequest(QUERY, ITEMS, label_token_ids=labels)).query
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    reference = load_reference(model_dir)
    expected = reference_scores(reference, query, items, labels, apply_softmax=True)
    tol = 1e-5
    if dtype == "bfloat16":  # the house rule: within 2x torch's own bf16 error
        torch_bf16 = reference_scores(reference.to(torch.bfloat16), query, items, labels, apply_softmax=True)
        tol = 2 * max_abs_diff(torch_bf16, expected) + 1e-4
    assert max_abs_diff(result.scores, expected) <= tol, (tier, max_abs_diff(result.scores, expected), tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_tier_keeps_its_exactness_promise(model_dir, tier, dtype):
    e = engine(model_dir, dtype)
    bitwise = exact(tier, e.decoder.dtype)
    tol = 0.0 if bitwise else (1e-6 if dtype == "float32" else 2e-3)

    def same(a, b, what):
        assert max_abs_diff(a.scores, b.scores) <= tol, (tier, what, max_abs_diff(a.scores, b.scores))

    sis, mis = (e.score(QUERY, ITEMS, labels=["Yes", "No"], mode=m) for m in ("sis", "mis"))
    same(sis, mis, "MIS = SIS")
    target = ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=True)
    alone = e.score_batch([target])[0]
    for k in (0, 2, len(STRANGERS)):
        same(alone, e.score_batch([*STRANGERS[:k], target, *STRANGERS[k:]])[k], f"with {k} strangers before")
    long_query = QUERY * 4  # whole cache blocks
    cold = e.score(long_query, ITEMS, labels=["Yes"], bypass_prefix_cache=True)
    e.score(long_query, ITEMS, labels=["Yes"])
    warm = e.score(long_query, ITEMS, labels=["Yes"])
    assert warm.usage.cached_tokens > 0
    same(cold, warm, "warm = cold")


def test_the_start_up_facts_name_the_tier(model_dir, tier):
    e = engine(model_dir, "auto")
    info = e.info()
    assert info.cpu_tier == tier
    expected_dtype = _ext.default_cpu_dtype()[0]
    assert info.dtype == str(expected_dtype).removeprefix("torch.")
    for op, path in info.ops.items():
        choice = tiers.cpu_choice(op, tier, expected_dtype)
        assert path.startswith("kernel" if choice.path == "kernel" else "torch"), (op, path)


@pytest.mark.skipif(_ext.cpu_module() is None, reason="needs pyscore._C")
@pytest.mark.parametrize(("name", "value", "known"), [("PYSCORE_CPU_TIER", "avx-2", "generic, avx2, avx512"),
                                                      ("PYSCORE_BF16_DOT", "dpbf", "dpbf16, widen"),
                                                      ("PYSCORE_OP_BACKEND", "referense", "auto, reference")])
def test_a_misspelt_switch_is_refused_before_the_model_loads(monkeypatch, tmp_path, name, value, known):
    # The kernels read an unknown value as unset: a typo would run the default under a bench or a deployment that
    # believes it forced another. The check runs before the load (the model path does not exist).
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{value}' is not one of {known}"):
        Engine.from_pretrained(str(tmp_path / "no-such-model"), device="cpu")


@pytest.mark.skipif(_ext.cpu_module() is None, reason="needs pyscore._C")
def test_a_tier_this_cpu_cannot_run_is_logged_and_the_cpu_tier_runs(monkeypatch, caplog, model_dir):
    runnable = _ext.runnable_cpu_tiers()
    above = next(t for t in tiers.TIERS if t not in runnable)  # amx here, or neon on x86, avx2 on aarch64
    monkeypatch.setenv("PYSCORE_CPU_TIER", above)
    with caplog.at_level("WARNING", logger="pyscore.ops._ext"):
        e = Engine.from_pretrained(str(model_dir), device="cpu", dtype="float32")
    expected = runnable[-1] if (above == "neon") == (runnable[-1] == "neon") else "generic"
    assert e.info().cpu_tier == expected
    assert f"PYSCORE_CPU_TIER={above}: this CPU cannot run that tier" in caplog.text, caplog.text
    monkeypatch.setenv("PYSCORE_CPU_TIER", runnable[0])
    caplog.clear()
    _ext.check_switches()  # a runnable tier: nothing to say
    assert "PYSCORE_CPU_TIER" not in caplog.text
