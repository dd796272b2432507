"""A fake `pyscore.engine.Engine` for the server tests: the exact Engine API, no model (nanochat tests its
engine against a mock model the same way). Only the plumbing is under test here.

Tokens are whitespace-separated words with ids from crc32. A score is a fixed function of the query's, the
item's and the label's token ids, so a request's scores can never depend on its batch-mates; generation
emits a fixed token sequence derived from the prompt (or from `seed` when sampling). Every `run_prepared`
and `step` call is recorded, and `pause()` holds the engine worker at the start of the next call, so tests
can pile requests up behind it deterministically.

Magic inputs: query "boom" fails that request alone inside `run_prepared` (RuntimeError); prompt "boom"
makes `step` raise for the whole step. Env FAKE_ENGINE_DELAY_S adds a sleep to every model call (for the
subprocess tests, which cannot reach `pause()`).
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

from pyscore.errors import FailedPrecondition, InvalidArgument
from pyscore.types import (
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    ScoreRequest,
    ScoreResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

VOCAB = 1000
BOS, EOS = 1, 2
FIRST_WORD_ID = 10
MAX_CONTEXT = 512
MAX_TOP_LOGPROBS = 20  # as pyscore.generation


def word_id(word: str) -> int:
    return FIRST_WORD_ID + zlib.crc32(word.encode()) % (VOCAB - FIRST_WORD_ID)


@dataclass
class PreparedScore:
    request: ScoreRequest
    query_ids: list[int]
    item_ids: list[list[int]]
    label_ids: list[int]
    marker_id: int | None
    mode: str
    computed_tokens: int
    prompt_tokens: int
    tag: str  # what the batch log records: the query text, or "ids:<first id>"

    @property
    def num_items(self) -> int:
        return len(self.item_ids)


@dataclass
class FakeGeneration:
    request: GenerateRequest
    prompt: list[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = "length"
    error: Exception | None = None  # as pyscore.generation.Generation: set when this sequence alone failed
    _text: str = ""
    _sent_tokens: int = 0
    _sent_chars: int = 0
    _rng: random.Random | None = None

    def take_delta(self) -> tuple[list[int], list[TokenLogprob], str]:
        """New tokens since the last call, their logprobs, and the text that can no longer change (text
        that might turn out to begin a stop string is held back until it cannot)."""
        holdback = 0 if self.finished else max((len(s) - 1 for s in self.request.stop), default=0)
        safe = self._text[: max(self._sent_chars, len(self._text) - holdback)]
        delta = (self.token_ids[self._sent_tokens :], self.logprobs[self._sent_tokens :], safe[self._sent_chars :])
        self._sent_tokens, self._sent_chars = len(self.token_ids), len(safe)
        return delta

    def result(self) -> GenerateResult:
        n = len(self.prompt)
        return GenerateResult(text=self._text, token_ids=list(self.token_ids), logprobs=list(self.logprobs),
                              finish_reason=self.finish_reason,  # type: ignore[arg-type]
                              usage=Usage(prompt_tokens=n, computed_tokens=n + len(self.token_ids)))


class FakeEngine:
    def __init__(self, name: str = "fake-smollm2", *, delay_s: float = 0.0) -> None:
        self.model_name = name
        self.delay_s = delay_s
        self.batches: list[list[str]] = []  # tags of each run_prepared call, in call order
        self.steps: list[int] = []  # number of unfinished generations advanced by each step call
        self.calls = 0
        self.fail_next_run = False  # run_prepared raises for the whole batch once
        self._gate = threading.Event()
        self._gate.set()
        self._let_through = 0  # model calls still allowed through after pause(after=...)
        self._entered = threading.Event()
        self._words: dict[int, str] = {BOS: "<s>", EOS: "</s>"}

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                        threads: int | None = None, max_batch_tokens: int = 8192,
                        prefix_cache_mb: float = 0.0) -> FakeEngine:
        return cls(model or "fake-smollm2", delay_s=float(os.environ.get("FAKE_ENGINE_DELAY_S", "0")))

    # -- test controls -------------------------------------------------------------------------------------
    def pause(self, after: int = 0) -> None:
        """The next model call (or, with `after`, the one after that many more) blocks at its start until
        resume()."""
        self._let_through = after
        self._entered.clear()
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def wait_entered(self, timeout: float = 10.0) -> bool:
        """Wait until a model call is blocked by pause()."""
        return self._entered.wait(timeout)

    def _model_call(self) -> None:
        self.calls += 1
        if self._let_through and not self._gate.is_set():
            self._let_through -= 1
        else:
            self._entered.set()
            if not self._gate.wait(timeout=30):
                raise RuntimeError("fake engine left paused")
        if self.delay_s:
            time.sleep(self.delay_s)

    # -- API -----------------------------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        return ModelInfo(name=self.model_name, architecture="FakeForCausalLM", kind="causal_lm", vocab_size=VOCAB,
                         max_context=MAX_CONTEXT, dtype="float32", device="cpu",
                         special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, ops={"fake_op": "python"})

    def prefix_cache_stats(self) -> None:
        return None  # no prefix cache

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        words = text.split()
        ids = [word_id(w) for w in words]
        for i, w in zip(ids, words, strict=True):
            self._words.setdefault(i, w)
        if add_special_tokens:
            return [BOS, *ids], ["<s>", *words]
        return ids, words

    def _token(self, token_id: int) -> str:
        return self._words.get(token_id, f"w{token_id}")

    def _check_ids(self, ids: list[int], name: str) -> None:
        bad = [i for i in ids if not 0 <= i < VOCAB]
        if bad:
            raise InvalidArgument(name, f"token id {bad[0]} is outside the vocabulary [0, {VOCAB})")

    def _single_token(self, text: str, name: str) -> int:
        ids, _ = self.tokenize(text, add_special_tokens=False)
        if len(ids) != 1:
            raise InvalidArgument(name, f"{text!r} is {len(ids)} tokens, not exactly one")
        return ids[0]

    def prepare_score(self, request: ScoreRequest) -> PreparedScore:
        if isinstance(request.query, str):
            if not request.query:
                raise InvalidArgument("query", "must not be empty")
            query_ids = self.tokenize(request.query)[0]
            tag = request.query
        else:
            if not request.query:
                raise InvalidArgument("query", "must not be empty")
            self._check_ids(request.query, "query_token_ids")
            query_ids, tag = list(request.query), f"ids:{request.query[0]}"
        item_ids: list[list[int]] = []
        for item in request.items:
            if isinstance(item, str) != isinstance(request.query, str):
                raise InvalidArgument("items", "query and items must both be text or both be token ids")
            if isinstance(item, str):
                item_ids.append(self.tokenize(item, add_special_tokens=False)[0])
            else:
                self._check_ids(item, "item_token_ids")
                item_ids.append(list(item))
        if request.label_token_ids:
            self._check_ids(request.label_token_ids, "label_token_ids")
            label_ids = list(request.label_token_ids)
        elif request.labels:
            label_ids = [self._single_token(label, "labels") for label in request.labels]
        else:
            raise InvalidArgument("labels", "give labels or label_token_ids (a causal LM has no default labels)")
        if len(set(label_ids)) != len(label_ids):
            raise InvalidArgument("labels", "duplicate labels")
        marker_id = None
        if request.score_extraction_token:
            marker_id = self._single_token(request.score_extraction_token, "score_extraction_token")
            for i, ids in enumerate(item_ids):
                if marker_id not in ids:
                    raise InvalidArgument("items", f"item {i} has no score_extraction_token")
        if request.mode not in ("auto", "sis", "mis"):
            raise InvalidArgument("mode", f"unknown mode {request.mode!r}")
        if request.mode == "mis" and request.item_first:
            raise FailedPrecondition("mode", "MIS shares the query as a prefix, which item_first makes a suffix")
        mode = request.mode
        if mode == "auto":  # as pyscore.scoring
            mode = "sis" if request.item_first else "mis"
        if any(len(query_ids) + len(ids) > MAX_CONTEXT for ids in item_ids):
            raise InvalidArgument("items", f"query + item exceeds the model's context of {MAX_CONTEXT} tokens")
        prompt = sum(len(query_ids) + len(ids) for ids in item_ids)
        computed = len(query_ids) + sum(map(len, item_ids)) if mode == "mis" and item_ids else prompt
        return PreparedScore(request, query_ids, item_ids, label_ids, marker_id, mode, computed, prompt, tag)

    def run_prepared(self, prepared: list[PreparedScore]) -> list[ScoreResult | Exception]:
        self._model_call()
        self.batches.append([p.tag for p in prepared])
        if self.fail_next_run:
            self.fail_next_run = False
            raise RuntimeError("injected failure of the whole batch")
        return [self._score_one(p) for p in prepared]

    def _score_one(self, p: PreparedScore) -> ScoreResult | Exception:
        if p.tag == "boom":
            return RuntimeError("injected failure of one request")
        rows: list[list[list[float]]] = []
        for ids in p.item_ids:
            ends = [i + 1 for i, t in enumerate(ids) if t == p.marker_id] if p.marker_id is not None else [len(ids)]
            rows.append([self._row(p.query_ids, ids[:end], p.label_ids, p.request) for end in ends])
        return ScoreResult(scores=rows, label_token_ids=p.label_ids, mode=p.mode,  # type: ignore[arg-type]
                           usage=Usage(prompt_tokens=p.prompt_tokens, computed_tokens=p.computed_tokens))

    @staticmethod
    def _row(query: list[int], item: list[int], labels: list[int], request: ScoreRequest) -> list[float]:
        order = 1 if request.item_first else 0
        logits = [((sum(query) * 31 + sum(item) * 17 + label * 13 + len(item) + order) % 1000) / 100 - 5
                  for label in labels]
        m = max(logits)
        log_z = m + math.log(sum(math.exp(x - m) for x in logits)) + (0.0 if request.apply_softmax else 3.0)
        return [math.exp(x - log_z) for x in logits]

    def score_batch(self, requests: list[ScoreRequest]) -> list[ScoreResult | Exception]:
        prepared: list[PreparedScore | Exception] = []
        for r in requests:
            try:
                prepared.append(self.prepare_score(r))
            except Exception as e:
                prepared.append(e)
        ran = iter(self.run_prepared([p for p in prepared if isinstance(p, PreparedScore)]))
        return [p if isinstance(p, Exception) else next(ran) for p in prepared]

    def score(self, query: str | list[int], items: list[str] | list[list[int]], **kw: object) -> ScoreResult:
        result = self.score_batch([ScoreRequest(query=query, items=items, **kw)])[0]  # type: ignore[arg-type]
        if isinstance(result, Exception):
            raise result
        return result

    # -- generation ----------------------------------------------------------------------------------------
    def start_generation(self, request: GenerateRequest) -> FakeGeneration:
        if request.apply_chat_template:
            raise FailedPrecondition("apply_chat_template", "this model's tokenizer has no chat template")
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgument("prompt", "give prompt or prompt_token_ids, not both")
        if request.prompt_token_ids:
            self._check_ids(request.prompt_token_ids, "prompt_token_ids")
            ids = list(request.prompt_token_ids)
        elif request.prompt:
            ids = self.tokenize(request.prompt)[0]
        else:
            raise InvalidArgument("prompt", "must not be empty")
        if request.max_tokens < 0:
            raise InvalidArgument("max_tokens", "must be >= 0")
        if len(ids) + request.max_tokens > MAX_CONTEXT:
            raise InvalidArgument("max_tokens", f"prompt + max_tokens exceeds the context of {MAX_CONTEXT}")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if request.temperature < 0:
            raise InvalidArgument("temperature", "must be >= 0")
        rng = random.Random(request.seed) if request.temperature > 0 else None
        gen = FakeGeneration(request, ids, request.max_tokens, _rng=rng)
        gen.finished = request.max_tokens == 0
        return gen

    def step(self, generations: list[FakeGeneration]) -> None:
        self._model_call()
        active = [g for g in generations if not g.finished]
        self.steps.append(len(active))
        if any(g.request.prompt == "boom" for g in active):
            raise RuntimeError("injected failure of a generation step")
        for g in active:
            self._advance(g)

    def _advance(self, g: FakeGeneration) -> None:
        n = len(g.token_ids)
        base = g._rng.randrange(VOCAB) if g._rng else sum(g.prompt) + 7 * n
        token_id = FIRST_WORD_ID + base % (VOCAB - FIRST_WORD_ID)
        logprob = -((token_id % 97) / 10.0) - 0.01
        top = [TopLogprob(token_id + k, self._token(token_id + k), logprob - k) for k in range(g.request.top_logprobs)]
        g.token_ids.append(token_id)
        g.logprobs.append(TokenLogprob(token_id, self._token(token_id), logprob, top))
        g._text += " " + self._token(token_id)
        for s in g.request.stop:
            if s and s in g._text:
                g._text = g._text[: g._text.index(s)]
                g.finished, g.finish_reason = True, "stop"
                return
        if len(g.token_ids) >= g.max_tokens:
            g.finished, g.finish_reason = True, "length"

    def generate(self, request: GenerateRequest) -> GenerateResult:
        gen = self.start_generation(request)
        while not gen.finished:
            self.step([gen])
        return gen.result()
