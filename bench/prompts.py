"""Prompt builders of the four scoring formulations, and the decision each one reads back:
- pointwise (generate, sis, mis): a shared query and one Yes/No item per option; the decision is the option
  with the highest Yes score;
- log-likelihood (loglik, lm-evaluation-harness's multiple choice): the context, then each option as its
  continuation; the decision is the option whose tokens have the highest summed log-probability;
- fused choice: one chat-templated prompt with lettered options; the decision is the best available letter
  among the first generated token's top log-probabilities;
- setwise: one item listing every option and ending in one marker token per option; one Yes/No row per marker.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from bench.dataset import Question

LETTERS = string.ascii_uppercase
YES, NO = "Yes", "No"
SETWISE_INSTRUCTION = ("For each candidate answer below, decide whether it is correct. "
                       "Respond with Yes or No at each marker.")
# Special tokens that some tokenizer families reserve and that no ordinary text contains (SmolLM2 / StarCoder,
# Llama 3, Qwen2/3). The chat-control tokens (bos/eos/pad/unk, <|im_start|>, ...) are never chosen: they do
# occur in chat-templated text.
MARKER_CANDIDATES = (
    "<empty_output>", "<jupyter_output>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|fim_pad|>", "<|box_start|>", "<|quad_start|>", "<gh_stars>", "<issue_closed>",
)


def context(q: Question) -> str:
    return f"Context:\n{q.state_json}\n\nQuestion: {q.question}\n"


def lettered_options(options: Sequence[str]) -> str:
    if len(options) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options can be lettered, got {len(options)}")
    return "\n".join(f"{LETTERS[i]}) {option}" for i, option in enumerate(options))


def letter_list(n: int) -> str:
    """'A or B', 'A, B or C', ..."""
    letters = list(LETTERS[:n])
    return letters[0] if n == 1 else f"{', '.join(letters[:-1])} or {letters[-1]}"


@dataclass
class Pointwise:
    """One query shared by every item (what MIS computes once); the Generate path sends query + item."""

    query: str
    items: list[str]


def pointwise(q: Question) -> Pointwise:
    items = [f"Proposed answer: {option}\nIs this proposed answer correct? Answer Yes or No." for option in q.options]
    return Pointwise(query=context(q), items=items)


@dataclass
class Loglikelihood:
    """One context and one continuation per option (each starts with a space, so its tokens follow the
    context's at the same boundary whichever option it is)."""

    context: str
    continuations: list[str]


def loglikelihood(q: Question) -> Loglikelihood:
    return Loglikelihood(context=f"{context(q)}Answer:", continuations=[f" {option}" for option in q.options])


def fused_choice(q: Question) -> str:
    """The user message of the Fused-Choice prompt; the chat template is applied by the target."""
    return (f"{context(q)}\nOptions:\n{lettered_options(q.options)}\n\n"
            f"Choose the single correct option above. Your entire response must be exactly one letter: "
            f"{letter_list(q.num_candidates)}.")


@dataclass
class Setwise:
    """One Score request: the query, and one item that ends with one marker per option."""

    query: str
    item: str


def setwise(q: Question, marker: str) -> Setwise:
    query = f"{context(q)}\n{SETWISE_INSTRUCTION}\n\n{lettered_options(q.options)}\n\n"
    item = "Scores:" + "".join(f" {LETTERS[i]}){marker}" for i in range(q.num_candidates))
    return Setwise(query=query, item=item)


def pick_marker(tokenize: Callable[[str], tuple[list[int], list[str]]], special_tokens: Iterable[str],
                candidates: Sequence[str] = MARKER_CANDIDATES) -> str:
    """The first candidate that the tokenizer keeps as one token of its own (an added special token: its
    token string is the candidate itself) and that is not one of the model's chat-control tokens.
    `tokenize(text)` tokenizes without special tokens; `special_tokens` are the model's bos/eos/pad/unk."""
    control = set(special_tokens)
    for candidate in candidates:
        if candidate in control:
            continue
        ids, tokens = tokenize(candidate)
        if len(ids) == 1 and tokens == [candidate]:
            return candidate
    raise ValueError(f"none of {list(candidates)} is a single special token of this tokenizer; "
                     "pass --marker with one that is")


def normalize_token(token: str) -> str:
    """A token string as the word it spells: byte-level BPE and sentencepiece space marks dropped."""
    return token.replace("Ġ", " ").replace("▁", " ").strip()


def yes_score(top: Iterable[tuple[str, float]]) -> float:
    """The Yes log-probability among a position's top alternatives ((token, logprob) pairs); -inf when absent
    (then the option ranks last: the model did not consider Yes among its top choices)."""
    values = [lp for token, lp in top if normalize_token(token).lower() == "yes"]
    return max(values, default=-math.inf)


def best_letter(top: Iterable[tuple[str, float]], num_options: int) -> int | None:
    """The index of the most likely option letter among the top alternatives, or None when no letter is."""
    letters = {LETTERS[i]: i for i in range(num_options)}
    best: tuple[float, int] | None = None
    for token, lp in top:
        i = letters.get(normalize_token(token))
        if i is not None and (best is None or lp > best[0]):
            best = (lp, i)
    return None if best is None else best[1]


def argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (ties keep option order)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))
