"""Prompt builders (exact strings), the setwise marker choice and the decisions read back."""

from __future__ import annotations

import math

import pytest

from bench import prompts
from bench.dataset import Question

Q = Question(id="q", source="unit", state_json='{"order": 1234}', question="What next?",
             options=["Track it.", "Refund it.", "Close it."], target=[0.0, 1.0, 0.0])


def test_pointwise():
    p = prompts.pointwise(Q)
    assert p.query == 'Context:\n{"order": 1234}\n\nQuestion: What next?\n'
    assert p.items == [
        "Proposed answer: Track it.\nIs this proposed answer correct? Answer Yes or No.",
        "Proposed answer: Refund it.\nIs this proposed answer correct? Answer Yes or No.",
        "Proposed answer: Close it.\nIs this proposed answer correct? Answer Yes or No.",
    ]


def test_fused_choice():
    assert prompts.fused_choice(Q) == (
        'Context:\n{"order": 1234}\n\nQuestion: What next?\n\n'
        "Options:\nA) Track it.\nB) Refund it.\nC) Close it.\n\n"
        "Choose the single correct option above. Your entire response must be exactly one letter: A, B or C.")
    assert prompts.letter_list(2) == "A or B"


def test_setwise():
    s = prompts.setwise(Q, "<m>")
    assert s.query == ('Context:\n{"order": 1234}\n\nQuestion: What next?\n\n'
                       "For each candidate answer below, decide whether it is correct. Respond with Yes or No at "
                       "each marker.\n\nA) Track it.\nB) Refund it.\nC) Close it.\n\n")
    assert s.item == "Scores: A)<m> B)<m> C)<m>"
    with pytest.raises(ValueError, match="at most 26"):
        prompts.lettered_options(["x"] * 27)


def test_pick_marker_takes_a_special_token_that_is_not_chat_control():
    vocab = {"<|im_end|>": 2, "<|reserved_special_token_0|>": 7}

    def tokenize(text):
        if text in vocab:
            return [vocab[text]], [text]
        return list(range(len(text))), list(text)  # anything else: several plain tokens

    order = ("<|im_end|>", "<empty_output>", "<|reserved_special_token_0|>")
    assert prompts.pick_marker(tokenize, ["<|im_end|>"], order) == "<|reserved_special_token_0|>"
    # A single token whose string differs from the candidate is an ordinary word piece, not a special token.
    assert prompts.pick_marker(lambda t: ([5], ["x"]) if t == "<a>" else ([1], [t]), [], ("<a>", "<b>")) == "<b>"
    with pytest.raises(ValueError, match="--marker"):
        prompts.pick_marker(tokenize, ["<|im_end|>"], ("<|im_end|>", "<none>"))


def test_decisions():
    assert prompts.yes_score([("ĠYes", -0.5), (" yes", -0.2), ("No", -0.1)]) == -0.2
    assert prompts.yes_score([("No", -0.1)]) == -math.inf
    assert prompts.best_letter([(" B", -1.0), ("C", -0.5), ("Ġ", -0.1), ("D", -0.01)], 3) == 2
    assert prompts.best_letter([("maybe", -0.1)], 3) is None
    assert prompts.argmax([0.2, 0.7, 0.7]) == 1
