"""Where a benchmark sends its questions. Every target turns one question into one decision along a path
(`generate`, `sis`, `mis`, `fused`, `setwise`, `loglik`) and knows nothing of load generation. `loglik` is
lm-evaluation-harness's multiple choice: each option's continuation tokens' summed log-probability after the
context, from the prompt's own logprobs (OpenAI's echo with logprobs, one request of every option's token-id
prompt; over gRPC one Generate with prompt_logprobs per option, all in flight at once); the texts are tokenized
by the target's own tokenizer (its /tokenize, or Tokenize), once per target and text:

- `GrpcTarget` (`HOST:PORT` or `grpc://HOST:PORT`): our pyscore.v1.Scorer; all five paths. Its prefix cache
  is used as `prefix_cache` says (`cache_options`): by default with a fresh salt per question dispatch, the
  same rule as vLLM's below.
- `OpenAIHTTPTarget` (`openai-http://HOST:PORT`): vLLM / SGLang / llama.cpp OpenAI-compatible servers:
  `generate` = one one-token /v1/completions with logprobs per candidate, all in flight at once;
  `fused` = one one-token /v1/chat/completions with top_logprobs.
- `VLLMHTTPTarget` (`vllm-http://HOST:PORT`): vLLM driven fairly: `sis` / `mis` = its /generative_scoring (our
  Score's request shape), `generate` / `fused` as above, every request of one question dispatch carrying one
  fresh `cache_salt` (a repetition never hits an earlier repetition's cache; one question's candidates still
  share the query's cached blocks); /metrics token counters for what usage does not say.
- `SGLangScoreTarget` (`sglang-score-http://HOST:PORT`): SGLang's /v1/score for `sis` / `mis` (whether SGLang
  runs multi-item scoring is decided by its launch flags, not by the request).
- `PyscoreHTTPTarget` (`pyscore-http://HOST:PORT`): our own HTTP front door (`--http-port`): the five paths with
  GrpcTarget's requests as JSON (/v1/score, /v1/completions, /v1/chat/completions) and its prefix-cache rule;
  against GrpcTarget on the same server it measures what HTTP adds per call.
- `InProcessTarget` (`inprocess`): pyscore.engine.Engine in this process, no gRPC (the service layer's cost).
- `ReplayTarget` (overload, soak, fleet runs): our gRPC server sent recorded requests (`Case`s) verbatim; an
  answer is correct when it equals the case's answer alone.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partialmethod
from typing import Any

from bench import prompts
from bench.dataset import Question

PATHS = ("generate", "sis", "mis", "fused", "setwise", "loglik")
PREFIX_CACHE_MODES = ("dispatch", "shared", "off")
GENERATE_TOP_LOGPROBS = 5
FUSED_TOP_LOGPROBS = 20


@dataclass
class Decision:
    """The chosen option (None when the answer named no option), the token accounting where known, and the
    server-side timing where the target reports it."""

    choice: int | None
    calls: int = 1
    prompt_tokens: int = 0
    computed_tokens: int = 0
    server_queue_ms: float | None = None
    server_compute_ms: float | None = None
    correct: bool | None = None  # set by targets that judge the answer themselves (ReplayTarget)
    diff: float | None = None  # ReplayTarget: largest |answer - answer alone| of a Score


def usage_decision(choice: int | None, usages: Sequence[Any], timed: bool) -> Decision:
    """A Decision from the pyscore Usage of each call it took: tokens summed; with `timed` (a server's usages),
    its queue wait and compute time, the longest of the calls (they run at once)."""
    return Decision(choice, calls=len(usages), prompt_tokens=sum(u.prompt_tokens for u in usages),
                    computed_tokens=sum(u.computed_tokens for u in usages),
                    server_queue_ms=max(u.queue_s for u in usages) * 1e3 if timed and usages else None,
                    server_compute_ms=max(u.compute_s for u in usages) * 1e3 if timed and usages else None)


@dataclass
class TargetInfo:
    model: str
    label_token_ids: list[int] = field(default_factory=list)  # Yes, No
    marker: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


class TargetError(RuntimeError):
    """A request failed at the target (HTTP status, malformed answer)."""


class Target:
    """Base: `open()` once, then `decide(path, question)` from many tasks at once, then `close()`; or
    `async with target:` for the open and the close."""

    spec = ""
    paths: tuple[str, ...] = ()

    def __init__(self, *, marker: str | None = None, timeout: float | None = 120.0) -> None:
        self.marker = marker
        self.timeout = timeout
        self.info = TargetInfo(model="")

    def check_path(self, path: str) -> None:
        if path not in self.paths:
            raise ValueError(f"target {self.spec} does not serve path {path!r} (it serves {', '.join(self.paths)})")

    async def open(self) -> TargetInfo:
        raise NotImplementedError

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> Target:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def decide(self, path: str, q: Question) -> Decision:
        self.check_path(path)
        return await getattr(self, f"_{path}")(q)


class OurPaths:
    """The five paths for targets with our API (gRPC, our HTTP front door, the engine in process), written once
    over two calls each target makes its own way: `_score_call` (a Score with the Yes/No label ids and
    apply_softmax; the fields the path adds) and `_top_call` (one one-token generation, chat-templated or not:
    its first token's top alternatives and Usage). Every question dispatch carries one
    `cache_options(self.prefix_cache)`: `_generate`'s one-token generations share it, as vLLM's completions of one
    question share their cache_salt."""

    info: TargetInfo
    marker: str | None
    prefix_cache = "dispatch"
    timed = False  # the results' Usage carries a server's queue wait and compute time

    def __init__(self, *args: Any, prefix_cache: str = "dispatch", **kw: Any) -> None:
        super().__init__(*args, **kw)
        cache_options(prefix_cache)  # refuses an unknown mode now, not at the first question
        self.prefix_cache = prefix_cache
        self.tokens = TokenCache(self._tokenize)

    async def _score_call(self, query: str, items: list[str], **fields: Any) -> Any:
        raise NotImplementedError

    async def _top_call(self, prompt: str, chat: bool, top: int, cache: dict[str, Any]) -> tuple[list, Any]:
        raise NotImplementedError

    async def _tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    async def _prompt_logprobs_call(self, ids: list[int], start: int, cache: dict[str, Any]
                                    ) -> tuple[list[float], Any]:
        """One one-token generation of `ids` with the logprobs of its tokens from `start` on (prompt_logprobs_start:
        the context before it may come from the prefix cache): (them, its Usage)."""
        raise NotImplementedError

    async def _loglik(self, q: Question) -> Decision:
        start, ids = await loglik_prompts(q, self.tokens)
        cache = cache_options(self.prefix_cache)
        answers = await asyncio.gather(*(self._prompt_logprobs_call(i, start, cache) for i in ids))
        return usage_decision(loglik_choice([lps for lps, _ in answers]), [u for _, u in answers], self.timed)

    async def _score(self, q: Question, mode: str) -> Decision:
        p = prompts.pointwise(q)
        r = await self._score_call(p.query, p.items, mode=mode)
        return usage_decision(pointwise_choice([rows[0] for rows in r.scores]), [r.usage], self.timed)

    _sis = partialmethod(_score, mode="sis")
    _mis = partialmethod(_score, mode="mis")

    async def _generate(self, q: Question) -> Decision:
        p = prompts.pointwise(q)
        cache = cache_options(self.prefix_cache)  # one question dispatch: its candidates share the query's blocks
        answers = await asyncio.gather(*(self._top_call(p.query + item, False, GENERATE_TOP_LOGPROBS, cache)
                                         for item in p.items))
        return usage_decision(generate_choice([top for top, _ in answers]), [u for _, u in answers], self.timed)

    async def _fused(self, q: Question) -> Decision:
        top, usage = await self._top_call(prompts.fused_choice(q), True, FUSED_TOP_LOGPROBS,
                                          cache_options(self.prefix_cache))
        return usage_decision(prompts.best_letter(top, q.num_candidates), [usage], self.timed)

    async def _setwise(self, q: Question) -> Decision:
        assert self.marker is not None
        s = prompts.setwise(q, self.marker)
        r = await self._score_call(s.query, [s.item], score_extraction_token=self.marker)
        rows = r.scores[0]
        if len(rows) != q.num_candidates:
            raise TargetError(f"setwise: {len(rows)} marker rows for {q.num_candidates} options")
        return usage_decision(pointwise_choice(rows), [r.usage], self.timed)


def tops_of(result: Any) -> list[tuple[str, float]]:
    """A GenerateResult's first-token top alternatives as (token, logprob)."""
    return [(t.token, t.logprob) for t in result.logprobs[0].top] if result.logprobs else []


def cache_options(mode: str) -> dict[str, Any]:
    """The request fields of one question dispatch to our server or engine, by prefix-cache mode: "dispatch"
    (default) a fresh prefix_cache_salt, the fair match of VLLMHTTPTarget's cache_salt (a repetition never hits an
    earlier one's blocks; one question's candidates share theirs); "shared" the cache as any client gets it;
    "off" bypass_prefix_cache (every call cold)."""
    if mode not in PREFIX_CACHE_MODES:
        raise ValueError(f"prefix_cache must be one of {PREFIX_CACHE_MODES}, got {mode!r}")
    if mode == "off":
        return {"bypass_prefix_cache": True}
    return {"prefix_cache_salt": uuid.uuid4().hex} if mode == "dispatch" else {}


# --- decisions from what the model returned ---------------------------------------------------------------
def pointwise_choice(rows: Sequence[Sequence[float]]) -> int:
    """rows[i] = option i's [P(Yes), P(No)]: the option with the highest Yes score."""
    return prompts.argmax([row[0] for row in rows])


def generate_choice(tops: Sequence[Sequence[tuple[str, float]]]) -> int:
    """tops[i] = option i's first-token top alternatives: the option with the highest Yes log-probability."""
    return prompts.argmax([prompts.yes_score(top) for top in tops])


class TokenCache:
    """Token ids of texts (without special tokens) through a target's own tokenizer, each text asked once."""

    def __init__(self, tokenize: Any) -> None:
        self.tokenize, self.ids = tokenize, {}

    async def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        missing = [t for t in dict.fromkeys(texts) if t not in self.ids]
        for text, ids in zip(missing, await asyncio.gather(*(self.tokenize(t) for t in missing)), strict=True):
            self.ids[text] = list(ids)
        return [self.ids[t] for t in texts]


async def loglik_prompts(q: Question, tokens: TokenCache) -> tuple[int, list[list[int]]]:
    """(the context's token count, each option's prompt: context + continuation token ids)."""
    p = prompts.loglikelihood(q)
    context, *continuations = await tokens([p.context, *p.continuations])
    return len(context), [context + c for c in continuations]


def loglik_choice(continuations: Sequence[Sequence[float]]) -> int:
    """continuations[i] = the logprobs of option i's continuation tokens: the option whose sum is highest."""
    return prompts.argmax([sum(float(v) for v in lps) for lps in continuations])


def echoed_continuations(logprobs: Sequence[Sequence[float | None]], start: int, ids: Sequence[Sequence[int]]
                         ) -> list[list[float]]:
    """Each option's continuation logprobs (positions start .. its prompt's end) out of echoed prompt logprobs
    (the first None, the generated token's last)."""
    return [[float(v) for v in lps[start : len(i)]] for lps, i in zip(logprobs, ids, strict=True)]


# --- our gRPC server -------------------------------------------------------------------------------------
async def resolve_labels(tokenize) -> list[int]:
    """Yes/No label ids: the space-prefixed word where it is one token (it follows 'Answer Yes or No.' / a
    marker), else the bare word. `tokenize(text)` -> ids without special tokens."""
    ids = []
    for word in (prompts.YES, prompts.NO):
        for text in (f" {word}", word):
            got = await tokenize(text)
            if len(got) == 1:
                ids.append(got[0])
                break
        else:
            raise TargetError(f"neither ' {word}' nor '{word}' is a single token of this model")
    return ids


class GrpcTarget(OurPaths, Target):
    paths = PATHS
    timed = True

    def __init__(self, address: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.address = address
        self.spec = f"grpc://{address}"
        self.client: Any = None

    async def open(self) -> TargetInfo:
        from pyscore.client import AsyncScorerClient

        self.client = AsyncScorerClient(self.address, timeout=self.timeout)
        model = await self.client.model_info()

        async def tokenize(text: str) -> list[int]:
            return (await self.client.tokenize(text, add_special_tokens=False))[0]

        labels = await resolve_labels(tokenize)
        marker = self.marker
        if marker is None:
            tokenized = {c: await self.client.tokenize(c, add_special_tokens=False) for c in prompts.MARKER_CANDIDATES}
            marker = prompts.pick_marker(tokenized.__getitem__, model.special_tokens.values())
        self.marker = marker
        self.info = TargetInfo(model=model.name, label_token_ids=labels, marker=marker,
                               details=dict(dtype=model.dtype, device=model.device, architecture=model.architecture,
                                            prefix_cache=self.prefix_cache))
        return self.info

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def _score_call(self, query: str, items: list[str], **fields: Any) -> Any:
        return await self.client.score(query, items, label_token_ids=self.info.label_token_ids, apply_softmax=True,
                                       **fields, **cache_options(self.prefix_cache))

    async def _top_call(self, prompt: str, chat: bool, top: int, cache: dict[str, Any]) -> tuple[list, Any]:
        r = await self.client.generate(prompt, apply_chat_template=chat, max_tokens=1, top_logprobs=top, **cache)
        return tops_of(r), r.usage

    async def _tokenize(self, text: str) -> list[int]:
        return (await self.client.tokenize(text, add_special_tokens=False))[0]

    async def _prompt_logprobs_call(self, ids: list[int], start: int, cache: dict[str, Any]
                                    ) -> tuple[list[float], Any]:
        r = await self.client.generate(ids, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=start, **cache)
        return [lp.logprob for lp in r.prompt_logprobs or []], r.usage


# --- HTTP servers ----------------------------------------------------------------------------------------
class HTTPTarget(Target):
    """Shared HTTP plumbing (aiohttp, one pooled session, no connection limit so the client never queues);
    `spec` is `scheme://HOST:PORT`; targets that send label ids (`labels`) resolve them at open, and `notes`
    go into the TargetInfo's details."""

    scheme = ""
    labels = False
    notes: tuple[tuple[str, str], ...] = ()

    def __init__(self, base_url: str, *, model: str | None = None, label_token_ids: Sequence[int] | None = None,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.base_url = base_url.rstrip("/")
        self.spec = f"{self.scheme}://" + self.base_url.split("://", 1)[-1]
        self.model = model
        self.label_token_ids = list(label_token_ids) if label_token_ids else None
        self.session: Any = None
        self.tokens = TokenCache(self.tokenize)

    async def open(self) -> TargetInfo:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        if self.model is None:
            models = await self.get("/v1/models")
            try:
                self.model = str(models["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as e:
                raise TargetError(f"{self.base_url}/v1/models lists no model; pass --model") from e
        self.info = TargetInfo(model=self.model, marker=None, details=dict(self.notes))
        if self.labels:
            self.info.label_token_ids = self.label_token_ids or await resolve_labels(self.tokenize)
        return self.info

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def get(self, route: str) -> Any:
        async with self.session.get(self.base_url + route) as response:
            return await self._json(route, response)

    async def post(self, route: str, body: dict[str, Any]) -> Any:
        async with self.session.post(self.base_url + route, json=body) as response:
            return await self._json(route, response)

    @staticmethod
    async def _json(route: str, response: Any) -> Any:
        if response.status != 200:
            text = await response.text()
            raise TargetError(f"{route}: HTTP {response.status}: {text[:300]}")
        return await response.json(content_type=None)

    async def tokenize(self, text: str) -> list[int]:
        """The server's /tokenize (vLLM and SGLang take `prompt`, llama.cpp `content`; all answer `tokens`)."""
        body = {"model": self.model, "prompt": text, "content": text, "add_special_tokens": False}
        return [int(t) for t in (await self.post("/tokenize", body))["tokens"]]


@dataclass
class Usage:
    """An OpenAI-style `usage`: prompt tokens, and the prompt tokens served from the prefix cache where the
    server says (vLLM: `prompt_tokens_details.cached_tokens`, given --enable-prompt-tokens-details)."""

    prompt_tokens: int = 0
    cached_tokens: int | None = None

    @classmethod
    def of(cls, answer: Any) -> Usage:
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if not isinstance(usage, dict):
            return cls()
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(int(usage.get("prompt_tokens") or 0), None if cached is None else int(cached))


def http_usage_decision(choice: int | None, usages: Sequence[Usage]) -> Decision:
    """A decision with the summed token accounting; computed tokens stay 0 (unknown) unless every answer said
    how many of its prompt tokens came from the cache."""
    prompt = sum(u.prompt_tokens for u in usages)
    known = all(u.cached_tokens is not None for u in usages)
    computed = prompt - sum(u.cached_tokens or 0 for u in usages) if known else 0
    return Decision(choice, calls=len(usages), prompt_tokens=prompt, computed_tokens=computed)


async def echo_logprobs(target: HTTPTarget, prompts_ids: list[list[int]], extra: dict[str, Any]
                        ) -> tuple[list[list[float | None]], Any]:
    """One /v1/completions of every prompt (token ids) with echo and logprobs, one token each: every prompt's
    tokens' logprobs (the first None), and the answer."""
    body = {"model": target.model, "prompt": prompts_ids, "max_tokens": 1, "temperature": 0.0, "logprobs": 1,
            "echo": True, **extra}
    answer = await target.post("/v1/completions", body)
    try:
        choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
        logprobs = [c["logprobs"]["token_logprobs"] for c in choices]
    except (KeyError, TypeError, ValueError) as e:
        raise TargetError(f"/v1/completions: no echoed token_logprobs in {str(answer)[:300]}") from e
    if len(logprobs) != len(prompts_ids):
        raise TargetError(f"/v1/completions: {len(logprobs)} choices for {len(prompts_ids)} prompts")
    return logprobs, answer


class OpenAIHTTPTarget(HTTPTarget):
    """`extra` (the body fields one question dispatch adds to each of its requests) is empty here; the vLLM
    target sets a fresh cache salt in it. `loglik` sends every option's prompt in one request (a list of
    prompts, as lm-evaluation-harness batches them)."""

    paths = ("generate", "fused", "loglik")
    scheme = "openai-http"

    async def _loglik(self, q: Question, extra: dict[str, Any] | None = None) -> Decision:
        start, ids = await loglik_prompts(q, self.tokens)
        logprobs, answer = await echo_logprobs(self, ids, extra or {})
        return http_usage_decision(loglik_choice(echoed_continuations(logprobs, start, ids)), [Usage.of(answer)])

    async def _completion_top(self, prompt: str, extra: dict[str, Any]) -> tuple[list[tuple[str, float]], Usage]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "logprobs": GENERATE_TOP_LOGPROBS, **extra}
        answer = await self.post("/v1/completions", body)
        try:
            top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise TargetError(f"/v1/completions: no top_logprobs in {str(answer)[:300]}") from e
        return [(str(t), float(lp)) for t, lp in top.items()], Usage.of(answer)

    async def _generate(self, q: Question, extra: dict[str, Any] | None = None) -> Decision:
        p = prompts.pointwise(q)
        answers = await asyncio.gather(*(self._completion_top(p.query + item, extra or {}) for item in p.items))
        return http_usage_decision(generate_choice([top for top, _ in answers]), [u for _, u in answers])

    async def _fused(self, q: Question, extra: dict[str, Any] | None = None) -> Decision:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompts.fused_choice(q)}],
                "max_tokens": 1, "temperature": 0.0, "logprobs": True, "top_logprobs": FUSED_TOP_LOGPROBS,
                "chat_template_kwargs": {"enable_thinking": False}, **(extra or {})}
        answer = await self.post("/v1/chat/completions", body)
        try:
            top = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        except (KeyError, IndexError, TypeError) as e:
            raise TargetError(f"/v1/chat/completions: no top_logprobs in {str(answer)[:300]}") from e
        choice = prompts.best_letter([(str(t["token"]), float(t["logprob"])) for t in top], q.num_candidates)
        return http_usage_decision(choice, [Usage.of(answer)])


# vLLM's /metrics counters (Prometheus; summed over the label sets that carry every given label) that say how
# many prompt tokens it was asked for, how many its prefix cache served and how many it computed.
VLLM_COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", ()),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", ()),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", ()),
    "computed_tokens": ("vllm:prompt_tokens_by_source_total", ('source="local_compute"',)),
}


def prometheus_counters(text: str, names: dict[str, tuple[str, tuple[str, ...]]]) -> dict[str, float]:
    """{key: the sum of metric names[key][0] over its label sets that contain every label of names[key][1]}
    from a Prometheus text exposition; a metric that does not appear is absent from the result."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        for key, (metric, required) in names.items():
            if name == metric and all(label in labels for label in required):
                out[key] = out.get(key, 0.0) + float(value)
    return out


class VLLMHTTPTarget(OpenAIHTTPTarget):
    """vLLM's OpenAI server, driven as fairly as we know: `sis` and `mis` send the same /generative_scoring
    request (query, items, Yes/No label ids, apply_softmax — how vLLM runs it, one sequence per item sharing
    the query's cached blocks, is its own choice), `generate` one one-token /v1/completions per candidate."""

    paths = ("generate", "sis", "mis", "fused", "loglik", "rerank")
    scheme = "vllm-http"
    labels = True
    notes = (("cache_salt", "fresh per question dispatch"),)

    async def decide(self, path: str, q: Question) -> Decision:
        self.check_path(path)
        extra = {"cache_salt": uuid.uuid4().hex}
        if path in ("sis", "mis"):
            return await self._generative_scoring(q, extra)
        return await getattr(self, f"_{path}")(q, extra)

    async def _rerank(self, q: Question, extra: dict[str, Any]) -> Decision:
        """/rerank on a vLLM started as the LLM reranker (bench/peers.md: the model converted into a classifier
        from the tokens No and Yes): relevance P(Yes) over Yes/No, the value pyscore's MIS Score gives. Its
        request has no cache salt (vLLM's pooling requests take none)."""
        p = prompts.pointwise(q)
        answer = await self.post("/rerank", {"model": self.model, "query": p.query, "documents": p.items})
        return http_usage_decision(prompts.argmax(rerank_scores(answer, len(p.items))), [Usage.of(answer)])

    async def _generative_scoring(self, q: Question, extra: dict[str, Any]) -> Decision:
        p = prompts.pointwise(q)
        body = {"model": self.model, "query": p.query, "items": p.items, "label_token_ids": self.info.label_token_ids,
                "apply_softmax": True, **extra}
        answer = await self.post("/generative_scoring", body)
        scores = generative_scoring_scores(answer, len(p.items))
        return http_usage_decision(prompts.argmax(scores), [Usage.of(answer)])

    async def counters(self) -> dict[str, float]:
        """vLLM's cumulative token counters now (see VLLM_COUNTERS); diff two snapshots around a run."""
        async with self.session.get(self.base_url + "/metrics") as response:
            if response.status != 200:
                raise TargetError(f"/metrics: HTTP {response.status}")
            return prometheus_counters(await response.text(), VLLM_COUNTERS)


def rerank_scores(answer: Any, num_documents: int) -> list[float]:
    """Each document's relevance, in document order, from a /rerank answer (its results sorted by relevance)."""
    try:
        relevance = {int(r["index"]): float(r["relevance_score"]) for r in answer["results"]}
        return [relevance[i] for i in range(num_documents)]
    except (KeyError, TypeError, ValueError) as e:
        raise TargetError(f"/rerank: no relevance per document in {str(answer)[:300]}") from e


def generative_scoring_scores(answer: Any, num_items: int) -> list[float]:
    """P(first label) per item, in item order, from /generative_scoring's `data` ({index, score} per item; with
    apply_softmax the score is normalised over the label ids only, as our Score's first column)."""
    try:
        scores = [float(r["score"]) for r in sorted(answer["data"], key=lambda r: int(r["index"]))]
    except (KeyError, TypeError, ValueError) as e:
        raise TargetError(f"/generative_scoring: no per-item scores in {str(answer)[:300]}") from e
    if len(scores) != num_items:
        raise TargetError(f"/generative_scoring: expected {num_items} scores, got {len(scores)}")
    return scores


class SGLangScoreTarget(HTTPTarget):
    paths = ("sis", "mis")
    scheme = "sglang-score-http"
    labels = True
    notes = (("mode", "chosen by the server's launch flags (--multi-item-scoring-delimiter => MIS)"),)

    async def _score(self, q: Question) -> Decision:
        p = prompts.pointwise(q)
        body = {"model": self.model, "query": p.query, "items": p.items, "label_token_ids": self.info.label_token_ids,
                "apply_softmax": True, "item_first": False}
        answer = await self.post("/v1/score", body)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(p.items):
            raise TargetError(f"/v1/score: expected {len(p.items)} score rows, got {str(answer)[:300]}")
        return Decision(pointwise_choice(scores))

    _sis = _mis = _score


class PyscoreHTTPTarget(OurPaths, HTTPTarget):
    """pyscore's HTTP front door, asked exactly what GrpcTarget asks (same label ids, marker rule, cache
    options); its answers carry the server's queue wait and compute time in `usage`, as gRPC's do."""

    paths = (*PATHS, "rerank")
    timed = True
    scheme = "pyscore-http"
    labels = True

    async def open(self) -> TargetInfo:
        info = await super().open()
        if self.marker is None:
            tokenized = {}
            for candidate in prompts.MARKER_CANDIDATES:
                answer = await self.post("/tokenize", {"prompt": candidate, "add_special_tokens": False,
                                                       "return_token_strs": True})
                tokenized[candidate] = (answer["tokens"], answer["token_strs"])
            self.marker = prompts.pick_marker(tokenized.__getitem__, ())
        info.marker = self.marker
        info.details["prefix_cache"] = self.prefix_cache
        return info

    @staticmethod
    def usage(answer: Any) -> Any:
        """pyscore's Usage from an answer's `usage` (OpenAI's fields plus computed tokens and server timing)."""
        from pyscore.types import Usage as PyscoreUsage

        u = answer["usage"]
        return PyscoreUsage(prompt_tokens=u["prompt_tokens"], computed_tokens=u["computed_tokens"],
                            cached_tokens=u["prompt_tokens_details"]["cached_tokens"], queue_s=u["queue_s"],
                            compute_s=u["compute_s"])

    async def _tokenize(self, text: str) -> list[int]:
        return await self.tokenize(text)

    async def _loglik(self, q: Question) -> Decision:
        """Every option's prompt in one echo request, as OpenAIHTTPTarget (and lm-evaluation-harness) sends it."""
        start, ids = await loglik_prompts(q, self.tokens)
        logprobs, answer = await echo_logprobs(self, ids, cache_options(self.prefix_cache))
        choice = loglik_choice(echoed_continuations(logprobs, start, ids))
        return usage_decision(choice, [self.usage(answer)], self.timed)

    async def _rerank(self, q: Question) -> Decision:
        """vLLM's /rerank, as its clients send it (the Yes/No label ids added): each document's relevance, the Yes
        share over Yes/No, what the vLLM target's rerank path reads from vLLM's LLM reranker."""
        p = prompts.pointwise(q)
        answer = await self.post("/rerank", {"model": self.model, "query": p.query, "documents": p.items,
                                             "label_token_ids": self.info.label_token_ids,
                                             **cache_options(self.prefix_cache)})
        choice = prompts.argmax(rerank_scores(answer, len(p.items)))
        return usage_decision(choice, [self.usage(answer)], self.timed)

    async def _score_call(self, query: str, items: list[str], **fields: Any) -> Any:
        from pyscore.types import ScoreResult

        answer = await self.post("/v1/score", {"model": self.model, "query": query, "items": items,
                                               "label_token_ids": self.info.label_token_ids, "apply_softmax": True,
                                               **fields, **cache_options(self.prefix_cache)})
        # an item's scores: one row ([label]) where it has one position, else one row per position
        scores = [rows if rows and isinstance(rows[0], list) else [rows] for rows in answer["scores"]]
        return ScoreResult(scores=scores, label_token_ids=answer["label_token_ids"], mode=answer.get("mode", ""),
                           usage=self.usage(answer))

    async def _top_call(self, prompt: str, chat: bool, top: int, cache: dict[str, Any]) -> tuple[list, Any]:
        if not chat:
            answer = await self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0.0, "logprobs": top, **cache})
            return list(answer["choices"][0]["logprobs"]["top_logprobs"][0].items()), self.usage(answer)
        answer = await self.post("/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
            "temperature": 0.0, "logprobs": True, "top_logprobs": top, **cache})
        content = answer["choices"][0]["logprobs"]["content"]
        return [(t["token"], t["logprob"]) for t in content[0]["top_logprobs"]] if content else [], self.usage(answer)


# --- the engine in this process --------------------------------------------------------------------------
class InProcessTarget(OurPaths, Target):
    """pyscore.engine.Engine behind one worker thread (as in the server), without gRPC or the batcher:
    the generate path prefills all of a question's candidates in one packed step, as the batcher would."""

    paths = PATHS

    def __init__(self, model: str | None = None, *, dtype: str = "auto", threads: int | None = None,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.model, self.dtype, self.threads = model, dtype, threads
        self.spec = "inprocess" + (f":{model}" if model else "")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="bench-engine")
        self.engine: Any = None

    async def run(self, fn, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def open(self) -> TargetInfo:
        from pyscore.engine import Engine

        self.engine = await self.run(lambda: Engine.from_pretrained(self.model, dtype=self.dtype,
                                                                    threads=self.threads))
        info = self.engine.info()

        async def tokenize(text: str) -> list[int]:
            return self.engine.tokenize(text, add_special_tokens=False)[0]

        labels = await resolve_labels(tokenize)
        self.marker = self.marker or prompts.pick_marker(lambda t: self.engine.tokenize(t, add_special_tokens=False),
                                                         info.special_tokens.values())
        self.info = TargetInfo(model=info.name, label_token_ids=labels, marker=self.marker,
                               details=dict(dtype=info.dtype, device=info.device, architecture=info.architecture))
        return self.info

    async def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _generate_sync(self, q: Question) -> Decision:
        from pyscore.types import GenerateRequest

        p = prompts.pointwise(q)
        cache = cache_options(self.prefix_cache)
        gens = [self.engine.start_generation(GenerateRequest(prompt=p.query + item, max_tokens=1,
                                                             top_logprobs=GENERATE_TOP_LOGPROBS, **cache))
                for item in p.items]
        while not all(g.finished for g in gens):
            self.engine.step(gens)
        return Decision(generate_choice([tops_of(g.result()) for g in gens]), calls=len(gens))

    async def _generate(self, q: Question) -> Decision:
        return await self.run(self._generate_sync, q)

    async def _score_call(self, query: str, items: list[str], **fields: Any) -> Any:
        cache = cache_options(self.prefix_cache)
        return await self.run(lambda: self.engine.score(query, items, label_token_ids=self.info.label_token_ids,
                                                        apply_softmax=True, **fields, **cache))

    async def _top_call(self, prompt: str, chat: bool, top: int, cache: dict[str, Any]) -> tuple[list, Any]:
        from pyscore.types import GenerateRequest

        r = await self.run(self.engine.generate, GenerateRequest(prompt=prompt, apply_chat_template=chat, max_tokens=1,
                                                                 top_logprobs=top, **cache))
        return tops_of(r), r.usage

    async def _tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text, add_special_tokens=False)[0]

    async def _prompt_logprobs_call(self, ids: list[int], start: int, cache: dict[str, Any]
                                    ) -> tuple[list[float], Any]:
        from pyscore.types import GenerateRequest

        r = await self.run(self.engine.generate, GenerateRequest(prompt_token_ids=ids, max_tokens=1, prompt_logprobs=0,
                                                                 prompt_logprobs_start=start, **cache))
        return [lp.logprob for lp in r.prompt_logprobs or []], r.usage


# --- recorded requests replayed against our server (overload, soak, fleet) ----------------------------------
TOLERANCE = 1e-3  # |answer under load - answer alone| on a probability above which a Score counts as wrong (bf16)


@dataclass
class Case:
    """One request as a client sends it to our gRPC server (Score: query, items, options; Generate: the prompt
    in `query`, no items) and the answer it got alone: the reference its answers under load must equal."""

    id: str
    kind: str  # sis | mis | setwise | generate
    query: str | list[int]  # text or token ids
    items: list[str] | list[list[int]]
    options: dict[str, Any]
    alone: Any = None  # a ScoreResult, or the generated text
    bucket = 0  # no candidate-count bucket (bench.dataset's): not a decision question

    @property
    def num_candidates(self) -> int:
        return len(self.items)


def mis_cases(n: int, items: int) -> list[Case]:
    """`n` seeded MIS Score requests of `items` candidates (bench.common.question), Yes/No labels."""
    from bench.common import question

    return [Case(f"mis-{seed}", "mis", *question(items, seed=1000 + seed), dict(labels=[" Yes", " No"], mode="mis"))
            for seed in range(n)]


def draws(cases: Sequence[Case], n: int, seed: int) -> list[Case]:
    """`n` cases drawn at random (with replacement), seeded."""
    rng = random.Random(seed)
    return [rng.choice(cases) for _ in range(n)]


def max_diff(a: Any, b: Any) -> float:
    """Largest |a - b| over all values of two ScoreResults; inf when the shapes, labels or modes differ."""
    if (a.label_token_ids, a.mode, [len(r) for r in a.scores]) != (b.label_token_ids, b.mode,
                                                                    [len(r) for r in b.scores]):
        return float("inf")
    return max((abs(x - y) for ra, rb in zip(a.scores, b.scores, strict=True) for xa, xb in zip(ra, rb, strict=True)
                for x, y in zip(xa, xb, strict=True)), default=0.0)


class ReplayTarget(Target):
    """Our gRPC server, sent `Case`s as they are (path "case") through `channels` client channels in turn (the
    soak's clients each have their own); `channel_options` are added to each channel's (the fleet run's channelz
    trace). A case with an answer alone is judged: a Score within TOLERANCE of it, a Generate text equal to it."""

    paths = ("case",)

    def __init__(self, address: str, *, channels: int = 1, channel_options: Sequence[tuple[str, Any]] = (),
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.address, self.channels, self.channel_options = address, channels, list(channel_options)
        self.spec = f"replay+grpc://{address}"
        self.clients: list[Any] = []
        self.turn = itertools.count()

    async def open(self) -> TargetInfo:
        import grpc

        from pyscore import balancing as lb
        from pyscore.client import AsyncScorerClient

        options = [*lb.channel_options(self.address, None), *self.channel_options]
        self.clients = [AsyncScorerClient(self.address, timeout=self.timeout, channel=grpc.aio.insecure_channel(
            self.address, options=options) if self.channel_options else None) for _ in range(self.channels)]
        return self.info

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def answer(self, case: Case) -> Any:
        client = self.clients[next(self.turn) % len(self.clients)]
        if case.kind == "generate":
            return (await client.generate(case.query, **case.options)).text
        return await client.score(case.query, case.items, **case.options)

    async def record_alone(self, cases: Sequence[Case]) -> list[float]:
        """Answers each case alone (one at a time, nothing else in flight) and keeps the answer as its
        reference; returns the latencies in seconds."""
        times = []
        for case in cases:
            t0 = time.perf_counter()
            case.alone = await self.answer(case)
            times.append(time.perf_counter() - t0)
        return times

    async def decide(self, path: str, q: Case) -> Decision:
        self.check_path(path)
        got = await self.answer(q)
        if q.alone is None:
            return Decision(None)
        if q.kind == "generate":
            return Decision(None, correct=got == q.alone)
        diff = max_diff(got, q.alone)
        return Decision(None, correct=diff <= TOLERANCE, diff=diff)


def make_target(spec: str, **kw: Any) -> Target:
    """`HOST:PORT` / `grpc://HOST:PORT`, `pyscore-http://HOST:PORT`, `openai-http://HOST:PORT`,
    `vllm-http://HOST:PORT`, `sglang-score-http://HOST:PORT`,
    `inprocess[:MODEL]`. HTTP-only options (model, label_token_ids), in-process ones (dtype, threads) and ours
    (prefix_cache) are dropped for targets that do not take them."""
    http = {k: kw.pop(k) for k in ("model", "label_token_ids") if k in kw}
    local = {k: kw.pop(k) for k in ("dtype", "threads") if k in kw}
    ours = {k: kw.pop(k) for k in ("prefix_cache",) if k in kw}
    for cls in (PyscoreHTTPTarget, OpenAIHTTPTarget, VLLMHTTPTarget, SGLangScoreTarget):
        if spec.startswith(f"{cls.scheme}://"):
            mine = ours if issubclass(cls, OurPaths) else {}
            return cls("http://" + spec.removeprefix(f"{cls.scheme}://"), **http, **mine, **kw)
    if spec == "inprocess" or spec.startswith("inprocess:"):
        return InProcessTarget(spec.partition(":")[2] or http.get("model"), **local, **ours, **kw)
    return GrpcTarget(spec.removeprefix("grpc://"), **ours, **kw)
