"""A fake `pyscore.engine.Engine` for the server tests: the exact Engine API, no model (nanochat tests its
engine against a mock model the same way). Only the plumbing is under test here; the rules are the real ones:
Score requests are prepared by `pyscore.scoring.prepare_score` and generations are validated, stopped and
streamed by `pyscore.generation` (validate_generate, Generation), both over `FakeTokenizer`.

Tokens are whitespace-separated words with ids from crc32 (BOS first when special tokens are added); a token
decodes as " word". A score is a fixed function of the query's, the item's and the label's token ids, so a
request's scores can never depend on its batch-mates; generation emits a fixed token sequence derived from
the prompt (or from `seed` when sampling). Every `run_prepared` and `step` call is recorded, and `pause()`
holds the engine worker at the start of the next call, so tests can pile requests up behind it
deterministically.

Magic inputs: query "boom" fails that request alone inside `run_prepared` (RuntimeError); prompt "boom"
makes `step` raise for the whole step. Env FAKE_ENGINE_DELAY_S adds a sleep to every model call (for the
subprocess tests, which cannot reach `pause()`), slept in "layers" of LAYER_S between which the decision that
`set_boundary` installs is asked, as the real decoder asks it between layers. Generations are admitted against a
KV ledger of `kv_tokens` in pages of `kv_page_tokens` (pyscore.model.kv_store.Reservations, the real store's).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import threading
import time
import zlib
from typing import Any

from pyscore.errors import PassInterrupted
from pyscore.gen_validate import render_chat
from pyscore.generation import Generation, validate_generate
from pyscore.model.kv_store import Reservations
from pyscore.scoring import ModelTraits, PreparedScore, prepare_score
from pyscore.types import (
    Boundary,
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
SPECIAL = {BOS: "<s>", EOS: "</s>"}
LAYER_S = 0.01  # a model call's delay is slept in steps of this, checking the interrupt between them


def word_id(word: str) -> int:
    """A word's id; special-looking tokens (`<empty_output>`) get ids below the words', as added tokens do, so
    that a setwise marker never collides with a word of the query."""
    if word.startswith("<") and word.endswith(">") and len(word) > 2:
        return EOS + 1 + zlib.crc32(word.encode()) % (FIRST_WORD_ID - EOS - 1)
    return FIRST_WORD_ID + zlib.crc32(word.encode()) % (VOCAB - FIRST_WORD_ID)


class FakeTokenizer:
    """The slice of a Hugging Face tokenizer that pyscore.scoring and pyscore.generation use."""

    chat_template = None
    eos_token_id = EOS

    def __init__(self) -> None:
        self._words: dict[int, str] = dict(SPECIAL)

    def encode_words(self, text: str) -> list[int]:
        """Words on whitespace; a special-looking token (`<empty_output>`) is split off the text around it, as
        real tokenizers do."""
        words = re.sub(r"(<[^<>\s]+>)", r" \1 ", text).split()
        ids = [word_id(w) for w in words]
        for i, w in zip(ids, words, strict=True):
            self._words.setdefault(i, w)
        return ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        if isinstance(text, list):
            return {"input_ids": [self(t, add_special_tokens)["input_ids"] for t in text]}
        return {"input_ids": [BOS] * add_special_tokens + self.encode_words(text)}

    def word(self, token_id: int) -> str:
        return self._words.get(token_id, f"w{token_id}")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.word(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(" " + self.word(i) for i in ids if not (skip_special_tokens and i in SPECIAL))


class FakeEngine:
    def __init__(self, name: str = "fake-smollm2", *, delay_s: float = 0.0, tokenizer: FakeTokenizer | None = None,
                 kv_tokens: int = 65536, kv_page_tokens: int = 1) -> None:
        self.model_name = name
        self.delay_s = delay_s
        self.tokenizer = tokenizer or FakeTokenizer()
        self.traits = ModelTraits(tokenizer=self.tokenizer, vocab_size=VOCAB, max_context=MAX_CONTEXT,
                                  is_classifier=False, num_labels=0, id2label={})
        self.batches: list[list[str]] = []  # tags of each run_prepared call, in call order
        self.steps: list[int] = []  # number of unfinished generations advanced by each step call
        self.calls = 0
        self.fail_next_run = False  # run_prepared raises for the whole batch once
        self._gate = threading.Event()
        self._gate.set()
        self._let_through = 0  # model calls still allowed through after pause(after=...)
        self._entered = threading.Event()
        self.kv = Reservations(kv_tokens, kv_page_tokens)
        self.decide: Any = None  # set_boundary's decision, asked every LAYER_S of a model call's delay
        self.between: Any = None

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                        threads: int | None = None, max_batch_tokens: int = 8192,
                        prefix_cache: bool = True, max_running_generations: int = 64, kv_cache_mb: float | None = None,
                        prefill_chunk_tokens: int | None = None, quantize: str | None = None) -> FakeEngine:
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
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end:  # "layers": a pass stops between them when asked to, as the decoder's does
            decision = Boundary.CONTINUE if self.decide is None else self.decide()
            if decision is Boundary.STOP:
                raise PassInterrupted("the fake pass was interrupted")
            if decision is Boundary.YIELD and self.between is not None:
                self.between()
            time.sleep(min(LAYER_S, max(0.0, end - time.monotonic())))

    # -- API -----------------------------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        return ModelInfo(name=self.model_name, architecture="FakeForCausalLM", kind="causal_lm", vocab_size=VOCAB,
                         max_context=MAX_CONTEXT, dtype="float32", device="cpu",
                         special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, ops={"fake_op": "python"})

    def prefix_cache_stats(self) -> None:
        return None  # no prefix cache

    def kv_store_stats(self) -> None:
        return None  # no KV store

    def check_kv(self, generation: Generation) -> None:
        self.kv.check(len(generation.prompt) + generation.request.max_tokens)

    def reserve_kv(self, generation: Generation) -> bool:
        generation.reservation = generation.reservation or self.kv.take(
            len(generation.prompt) + generation.request.max_tokens)
        return generation.reservation is not None

    def kv_tokens_reserved(self) -> int:
        return self.kv.reserved

    def set_boundary(self, decide: Any, between: Any = None) -> None:
        self.decide, self.between = decide, between

    def plan_chunks(self, prepared: PreparedScore) -> None:
        return None  # no prefix cache, so no chunked prefill: a long request runs alone as one pass

    def advance_chunked(self, prepared: PreparedScore, plan: Any) -> None:
        raise AssertionError("the fake engine plans no chunks")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        ids = self.tokenizer(text, add_special_tokens)["input_ids"]
        return ids, self.tokenizer.convert_ids_to_tokens(ids)

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_pieces(self, ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(ids)

    def render_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                    add_generation_prompt: bool = True, *, add_special_tokens: bool = False) -> list[int]:
        return render_chat(self.tokenizer, messages, template_kwargs, add_generation_prompt,
                           add_special_tokens=add_special_tokens)

    def prepare_score(self, request: ScoreRequest) -> PreparedScore:
        return prepare_score(request, self.traits)

    def run_prepared(self, prepared: list[PreparedScore]) -> list[ScoreResult | Exception]:
        self._model_call()
        self.batches.append([self._tag(p) for p in prepared])
        if self.fail_next_run:
            self.fail_next_run = False
            raise RuntimeError("injected failure of the whole batch")
        return [self._score_one(p) for p in prepared]

    @staticmethod
    def _tag(p: PreparedScore) -> str:
        """What the batch log records: the query text, or "ids:<first id>"."""
        return p.request.query if isinstance(p.request.query, str) else f"ids:{p.request.query[0]}"

    def _score_one(self, p: PreparedScore) -> ScoreResult | Exception:
        if self._tag(p) == "boom":
            return RuntimeError("injected failure of one request")
        # read-out offsets count from the item's start (an item_first one reads past its end: the whole item)
        rows = [[self._row(p.query, item[: offset + 1], p.labels, p.request) for offset in offsets]
                for item, offsets in zip(p.items, p.readouts, strict=True)]
        return ScoreResult(scores=rows, label_token_ids=list(p.labels), mode=p.mode,
                           usage=Usage(prompt_tokens=p.prompt_tokens,
                                       computed_tokens=p.computed_tokens if p.items else 0))

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
    def start_generation(self, request: GenerateRequest) -> Generation:
        prompt = validate_generate(request, self.tokenizer, VOCAB, MAX_CONTEXT)
        return Generation(request=request, prompt=prompt, tokenizer=self.tokenizer, eos_ids=frozenset({EOS}),
                          generator=None)

    def step(self, generations: list[Generation]) -> None:
        self._model_call()
        active = [g for g in generations if not g.finished]
        self.steps.append(len(active))
        if any(g.request.prompt == "boom" for g in active):
            raise RuntimeError("injected failure of a generation step")
        for g in active:
            if g.request.prompt_logprobs is not None and g.prompt_logprobs is None:  # its prefill
                g.prompt_logprobs = self._prompt_logprobs(g.prompt, g.request.prompt_logprobs)[
                    g.request.prompt_logprobs_start:]
            g.append(*self._next_token(g))

    def _prompt_logprobs(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """A made-up logprob per prompt token, a function of the token and the one before (the first NaN)."""
        word = self.tokenizer.word
        out = [TokenLogprob(prompt[0], word(prompt[0]), float("nan"))]
        for before, token in itertools.pairwise(prompt):
            logprob = -(((token + 3 * before) % 89) / 10.0) - 0.01
            out.append(TokenLogprob(token, word(token), logprob,
                                    [TopLogprob(token + k, word(token + k), logprob - k) for k in range(top)]))
        return out

    def _next_token(self, g: Generation) -> tuple[int, TokenLogprob]:
        n, req = g.computed, g.request
        base = random.Random(f"{req.seed}:{n}").randrange(VOCAB) if req.temperature > 0 else sum(g.prompt) + 7 * n
        token_id = FIRST_WORD_ID + base % (VOCAB - FIRST_WORD_ID)
        logprob = -((token_id % 97) / 10.0) - 0.01
        word = self.tokenizer.word
        top = [TopLogprob(token_id + k, word(token_id + k), logprob - k) for k in range(req.top_logprobs)]
        return token_id, TokenLogprob(token_id, word(token_id), logprob, top)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        gen = self.start_generation(request)
        while not gen.finished:
            self.step([gen])
        return gen.result()
