"""Every invalid score or generate request raises InvalidArgument / FailedPrecondition naming its field,
before any model work."""

from __future__ import annotations

import math

import pytest

from pyscore.engine import Engine
from pyscore.errors import FailedPrecondition, InvalidArgument
from pyscore.types import GenerateRequest, ScoreRequest
from tests.helpers import make_model_dir


@pytest.fixture(scope="module")
def e(tmp_path_factory):
    return Engine.from_pretrained(make_model_dir(tmp_path_factory.mktemp("m"), "qwen3"), dtype="float32",
                                  device="cpu", threads=2)


@pytest.fixture(scope="module")
def clf(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("c"), "qwen2", classifier=True)
    return Engine.from_pretrained(path, dtype="float32", device="cpu", threads=2)


Q, ITEMS = "Context: the order", [" Yes it is", " No"]
SCORE_CASES = [
    (dict(query="", items=ITEMS, labels=["Yes"]), InvalidArgument, "query"),
    (dict(query=[], items=[[5]], labels=["Yes"]), InvalidArgument, "query_token_ids"),
    (dict(query=Q, items=[[5, 6]], labels=["Yes"]), InvalidArgument, "item_token_ids"),
    (dict(query=[5, 6], items=ITEMS, labels=["Yes"]), InvalidArgument, "items"),
    (dict(query=Q, items=[" a", [5]], labels=["Yes"]), InvalidArgument, "items"),
    (dict(query=Q, items=["", " b"], labels=["Yes"]), InvalidArgument, "items[0]"),
    (dict(query=[5], items=[[5], [10**6]], labels=["Yes"]), InvalidArgument, "item_token_ids[1]"),
    (dict(query=[-1], items=[[5]], labels=["Yes"]), InvalidArgument, "query_token_ids"),
    (dict(query=Q, items=ITEMS), InvalidArgument, "label_token_ids"),
    (dict(query=Q, items=ITEMS, label_token_ids=[-3]), InvalidArgument, "label_token_ids"),
    (dict(query=Q, items=ITEMS, label_token_ids=[10**6]), InvalidArgument, "label_token_ids"),
    (dict(query=Q, items=ITEMS, label_token_ids=[5, 5]), InvalidArgument, "label_token_ids"),
    (dict(query=Q, items=ITEMS, labels=["Yes", "Yes"]), InvalidArgument, "labels"),
    (dict(query=Q, items=ITEMS, labels=["Proposed answer"]), InvalidArgument, "labels[0]"),
    (dict(query=Q, items=ITEMS, labels=["Yes"], label_token_ids=[5]), InvalidArgument, "labels"),
    (dict(query=Q, items=ITEMS, labels=["Yes"], mode="fast"), InvalidArgument, "mode"),
    (dict(query=Q, items=ITEMS, labels=["Yes"], mode="mis", item_first=True), FailedPrecondition, "mode"),
    (dict(query=Q, items=ITEMS, labels=["Yes"], score_extraction_token="Proposed answer"), InvalidArgument,
     "score_extraction_token"),
    (dict(query=Q, items=[" a <|marker|>", " b"], labels=["Yes"], score_extraction_token="<|marker|>"),
     InvalidArgument, "items[1]"),
    (dict(query=Q + "<|marker|>", items=[" a <|marker|>"], labels=["Yes"], score_extraction_token="<|marker|>"),
     InvalidArgument, "score_extraction_token"),
    (dict(query=Q, items=[" order" * 600], labels=["Yes"]), InvalidArgument, "items[0]"),
]


@pytest.mark.parametrize(("kwargs", "error", "field"), SCORE_CASES)
def test_bad_score_request_names_field(e, kwargs, error, field):
    with pytest.raises(error) as info:
        e.prepare_score(ScoreRequest(**kwargs))
    assert info.value.field == field, str(info.value)
    assert isinstance(e.score_batch([ScoreRequest(**kwargs)])[0], error)


def test_classifier_labels_are_class_indices_or_names(clf):
    with pytest.raises(InvalidArgument, match="label_token_ids"):
        clf.prepare_score(ScoreRequest(Q, ITEMS, label_token_ids=[3]))
    with pytest.raises(InvalidArgument, match="labels"):
        clf.prepare_score(ScoreRequest(Q, ITEMS, labels=["excellent"]))
    assert clf.prepare_score(ScoreRequest(Q, ITEMS, labels=["neutral"])).labels == [1]
    with pytest.raises(FailedPrecondition, match="model"):
        clf.start_generation(GenerateRequest(prompt="hi"))


GENERATE_CASES = [
    (dict(), "prompt"),
    (dict(prompt="a", prompt_token_ids=[5]), "prompt"),
    (dict(prompt="a", max_tokens=0), "max_tokens"),
    (dict(prompt="a", max_tokens=10**6), "max_tokens"),
    (dict(prompt="a", temperature=-1.0), "temperature"),
    (dict(prompt="a", temperature=math.nan), "temperature"),
    (dict(prompt="a", top_p=0.0), "top_p"),
    (dict(prompt="a", top_p=1.5), "top_p"),
    (dict(prompt="a", top_k=-1), "top_k"),
    (dict(prompt="a", top_logprobs=21), "top_logprobs"),
    (dict(prompt="a", stop=["x"] * 1000), "stop"),
    (dict(prompt="a", stop_token_ids=[5, 10**6]), "stop_token_ids"),
    (dict(prompt="a", stop_token_ids=[-1]), "stop_token_ids"),
    (dict(prompt="a", stop_token_ids=[5] * 129), "stop_token_ids"),  # MAX_STOP_TOKEN_IDS, though every id is good
    (dict(prompt_token_ids=[10**6]), "prompt_token_ids"),
    (dict(prompt_token_ids=[5], apply_chat_template=True), "apply_chat_template"),
]


@pytest.mark.parametrize(("kwargs", "field"), GENERATE_CASES)
def test_bad_generate_request_names_field(e, kwargs, field):
    with pytest.raises(InvalidArgument) as info:
        e.start_generation(GenerateRequest(**kwargs))
    assert info.value.field == field, str(info.value)


def test_chat_template_missing_is_failed_precondition(e):
    template, e.tokenizer.chat_template = e.tokenizer.chat_template, None
    try:
        with pytest.raises(FailedPrecondition, match="apply_chat_template"):
            e.start_generation(GenerateRequest(prompt="hi", apply_chat_template=True))
    finally:
        e.tokenizer.chat_template = template
