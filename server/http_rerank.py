"""vLLM's APIs for rerankers and classifiers: `POST /rerank` (also `/v1/rerank` and `/v2/rerank`, Jina's and
Cohere's shape), `POST /score` (also `/v1/score` when the body is vLLM's rather than SGLang's) and
`POST /classify`, each answered by pyscore's Score through the same batcher as gRPC.

A document's relevance to a query (a pair's score), by the served model:
- a causal LM (an LLM reranker such as Qwen3-Reranker, which vLLM serves converted into a classifier from the
  tokens "no" and "yes"): the first label's share of the softmax over the labels: the server's --rerank-labels
  (default ["yes", "no"]; vLLM's classifier_from_token is set per server too) or a request's pyscore extras
  `labels` / `label_token_ids`, positive first. With two labels that is vLLM's sigmoid of the two tokens' logit
  difference; one label alone gives its probability over the vocabulary. `use_activation: false` is refused:
  the label softmax does not give the logits back;
- a classifier with one class (a cross-encoder head): the sigmoid of its logit (vLLM's activation for one class),
  or the logit with `use_activation: false`;
- a classifier with several classes: the class named by `labels` / `label_token_ids` (refused without one): its
  softmax probability over every class, or its logit.

Sequences are tokenized as vLLM's LLM reranker tokenizes them: each pair's query + document as one text, with the
tokenizer's special tokens (so the tokens, and the scores, are vLLM's whatever the texts; a cross-encoder's
separator tokens are not added). A pair is split into query and item where its tokens stop being the query's own
(`shared_prefix_requests`), so that its score depends on its own texts alone, and the pairs of one query are one
MIS request (vLLM computes every pair in full); vLLM's N:N score pairs are grouped by query. A template (an LLM
reranker's prefix, instruction and suffix) is the client's text, as with vLLM's LLM-reranker examples.

/classify: every input its own sequence, tokenized as vLLM does (special tokens on by default), read out at its
last token; `probs` is the softmax over every class (the logits with `use_activation: false`), `label` the
most likely class's name."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from starlette.responses import Response

from pyscore import errors
from pyscore.types import ModelInfo, ScoreRequest, ScoreResult, Usage

from .engine_like import EngineLike
from .gate import Gate
from .http_call import JSON, Call
from .http_schema import ClassifyBody, PoolingOptions, RerankBody, VLLMScoreBody
from .http_score import summed_usage, usage_json

T = TypeVar("T")
RERANK_LABELS = ["yes", "no"]  # the default of --rerank-labels: Qwen3-Reranker's tokens, vLLM's documented
# classifier_from_token (no, yes)
SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
VLLM_SCORE_FIELDS = frozenset(name for pair in SIDES for name in pair)


IN_FLIGHT = 16  # a call's Score requests in the server's queue at once: many distinct queries (N:N pairs, classify
# inputs; up to --max-items) must not fill --max-queue, which other callers share


async def bounded(calls: Sequence[Callable[[], Awaitable[T]]], limit: int = IN_FLIGHT) -> list[T]:
    """Every call's result in order, at most `limit` running at once; the first failure cancels the rest."""
    gate = asyncio.Semaphore(limit)

    async def run(call: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await call()

    tasks = [asyncio.ensure_future(run(call)) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # the first failure is the call's answer: the others are dropped, not left running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def refuse_unserved(body: PoolingOptions) -> None:
    for name, value in body.unserved().items():
        if value is not None:
            raise errors.InvalidArgument(name, "is not served by pyscore (give the texts as they are to score)")


def renamed(exc: errors.RequestError, query_field: str, item_field: str, item_index: Sequence[int]
            ) -> errors.RequestError:
    """An engine error of one grouped request, its field in the client's terms (`documents[4]`, not
    `items[1]`)."""
    head, _, rest = exc.field.partition("[")
    if head in ("items", "item_token_ids"):
        field = f"{item_field}[{item_index[int(rest.rstrip(']'))]}]" if rest else item_field
    elif head in ("query", "query_token_ids"):
        field = query_field
    else:
        field = exc.field
    message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
    return type(exc)(field, message)


def shared_prefix_requests(engine: EngineLike, queries: list[str], documents: list[str], field: str
                           ) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """(pair indices, query ids, item ids) per Score request (on the engine thread: the work grows with the
    input). Each pair is tokenized as vLLM's LLM reranker does, query + document as one text with the tokenizer's
    special tokens, and split where its tokens stop being the query's own (at the latest before its last token):
    a pair's split depends on its own two texts alone, never on the other documents, so its score does not
    either, and where the join is a token boundary it is Score's split (the same bits as gRPC's Score). The
    pairs of one query with one split are one MIS request."""
    texts = [q + d for q, d in zip(queries, documents, strict=True)]
    distinct = list(dict.fromkeys(queries))
    # one batch call: 16 joined 330-token texts ~5-7 ms, where one engine.tokenize each (it also decodes every
    # token to its text) took ~19
    encoded = engine.encode([*texts, *distinct], add_special_tokens=True)
    own = {q: list(ids) for q, ids in zip(distinct, encoded[len(texts):], strict=True)}
    plans: dict[tuple[str, int], tuple[list[int], list[int], list[list[int]]]] = {}
    for i, (query, ids) in enumerate(zip(queries, encoded[: len(texts)], strict=True)):
        seq, prefix = list(ids), own[query]
        if len(seq) < 2:
            raise errors.InvalidArgument(f"{field}[{i}]", f"query + document is {len(seq)} token(s); a pair is "
                                         "read out at its last token after at least one other")
        limit = min(len(prefix), len(seq) - 1)
        split = next((j for j in range(limit) if seq[j] != prefix[j]), limit) or len(seq) - 1
        if (query, split) not in plans:
            plans[query, split] = ([], seq[:split], [])
        index, _, items = plans[query, split]
        index.append(i)
        items.append(seq[split:])
    return list(plans.values())


class Relevance:
    """How one request turns a Score row into a pair's score (the module docstring's rules)."""

    def __init__(self, info: ModelInfo, body: PoolingOptions, id2label: dict[int, str], default_labels: list[str]
                 ) -> None:
        activate = body.use_activation is not False
        labels, ids = body.labels or None, body.label_token_ids or None
        self.sigmoid, self.column, self.default_labels = False, 0, False
        if info.kind != "classifier":
            if not activate:
                raise errors.InvalidArgument("use_activation", "false is served for classifiers only: a causal "
                                             "LM's relevance is the softmax over its labels")
            chosen = labels or (None if ids else default_labels)
            self.request: dict[str, Any] = {"labels": chosen, "label_token_ids": ids,
                                            "apply_softmax": len(chosen or ids or []) > 1}
            self.default_labels = not labels and not ids
            return
        # A classifier: every class is scored (a softmax needs them all) and one column is read.
        self.request = {"labels": None, "label_token_ids": None, "apply_softmax": activate and info.num_labels > 1}
        field = "labels" if labels else "label_token_ids"
        named: list[Any] = labels or ids or []
        if info.num_labels == 1 and not named:
            self.sigmoid = activate
            return
        if len(named) != 1:
            raise errors.InvalidArgument(field, f"the served classifier has {info.num_labels} classes: name the "
                                         "one whose score ranks (one of labels or label_token_ids)")
        by_name = {name: idx for idx, name in id2label.items()}
        column = by_name.get(named[0], -1) if labels else named[0]
        if not 0 <= column < info.num_labels:
            raise errors.InvalidArgument(field, f"{errors.quoted(named[0])} is not a class of the served "
                                         f"classifier ({info.num_labels} classes)")
        self.column, self.sigmoid = column, activate and info.num_labels == 1

    def score_request(self, query: list[int], items: list[list[int]], body: PoolingOptions) -> ScoreRequest:
        return ScoreRequest(query=query, items=items, bypass_prefix_cache=body.bypass_prefix_cache,
                            prefix_cache_salt=body.salt(), **self.request)

    def scores(self, result: ScoreResult) -> list[float]:
        values = np.asarray([rows[0][self.column] for rows in result.scores], dtype=np.float32)
        if self.sigmoid:
            values = np.float32(1) / (np.float32(1) + np.exp(-values))
        return values.tolist()


class RerankEndpoints:
    def __init__(self, gate: Gate, labels: list[str]) -> None:
        self.gate, self.labels = gate, labels

    def _id2label(self, model: str | None) -> dict[int, str]:
        self.gate.ready(model)
        return dict(self.gate.engine.traits.id2label or {})

    async def _pairs(self, call: Call, body: PoolingOptions, queries: list[str], documents: list[str],
                     names: tuple[str, str]) -> tuple[list[float], Usage, str]:
        """Every (queries[i], documents[i]) pair's score: each pair's text joined and tokenized as vLLM does, the
        pairs of one query one MIS request whose shared query is their common token prefix, concurrently."""
        refuse_unserved(body)
        batcher, info = self.gate.ready(body.model)
        self.gate.check_items(len(documents))
        relevance = Relevance(info, body, self._id2label(body.model), self.labels)
        engine = self.gate.engine
        plans = await batcher.call(lambda: shared_prefix_requests(engine, queries, documents, names[1]))
        call.summary = f"items={len(documents)} requests={len(plans)} "

        async def one(index: list[int], query: list[int], items: list[list[int]]) -> tuple[list[int], ScoreResult]:
            try:
                return index, await batcher.score(relevance.score_request(query, items, body))
            except errors.RequestError as e:
                if relevance.default_labels and e.field.startswith("labels"):
                    raise type(e)(e.field, f"{str(e).removeprefix(e.field + ': ')} (the server's --rerank-labels "
                                  f"{errors.quoted(self.labels)}: give pyscore's `labels` or `label_token_ids`, "
                                  "the positive first)") from None
                raise renamed(e, names[0], names[1], index) from None

        results = await bounded([functools.partial(one, *plan) for plan in plans])
        scores = [0.0] * len(documents)
        for index, result in results:
            for i, value in zip(index, relevance.scores(result), strict=True):
                scores[i] = value
        usage = summed_usage([result.usage for _, result in results])
        call.usage = usage
        return scores, usage, info.name

    async def rerank(self, call: Call, body: RerankBody) -> Response:
        """vLLM's /rerank: results sorted by relevance (highest first; ties in document order), the top_n."""
        documents = [body.documents] if isinstance(body.documents, str) else list(body.documents)
        if not documents:
            raise errors.InvalidArgument("documents", "is empty: give at least one document")
        scores, usage, name = await self._pairs(call, body, [body.query] * len(documents), documents,
                                                ("query", "documents"))
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        top = order[: body.top_n] if body.top_n else order
        results = [{"index": i, "document": {"text": documents[i], "multi_modal": None}, "relevance_score": scores[i]}
                   for i in top]
        return JSON({"id": f"rerank-{body.request_id or uuid.uuid4().hex}", "model": name,
                     "usage": usage_json(usage), "results": results})

    async def score(self, call: Call, body: VLLMScoreBody) -> Response:
        """vLLM's /score: one score per pair, 1:1, 1:N (the one query shared) or N:N."""
        names, first, second = self._sides(body)
        if isinstance(first, str):
            first = [first]
        second = [second] if isinstance(second, str) else list(second)
        if not second:
            raise errors.InvalidArgument(names[1], "is empty: give at least one text")
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise errors.InvalidArgument(names[1], f"has {len(second)} texts for {len(first)} in {names[0]}: the "
                                         "sides pair 1:1, 1:N or N:N")
        scores, usage, name = await self._pairs(call, body, first, second, names)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSON({"id": f"score-{body.request_id or uuid.uuid4().hex}", "object": "list",
                     "created": int(time.time()), "model": name, "data": data, "usage": usage_json(usage)})

    @staticmethod
    def _sides(body: VLLMScoreBody) -> tuple[tuple[str, str], Any, Any]:
        given = [name for name in VLLM_SCORE_FIELDS if getattr(body, name) is not None]
        for names in SIDES:
            if all(getattr(body, n) is not None for n in names) and set(given) == set(names):
                return names, getattr(body, names[0]), getattr(body, names[1])
        spelled = ", ".join(f"{a} + {b}" for a, b in SIDES)
        field = sorted(given)[0] if given else "text_1"
        raise errors.InvalidArgument(field, f"give the two sides as one of {spelled}"
                                     + (f" (got {', '.join(sorted(given))})" if given else ""))

    async def classify(self, call: Call, body: ClassifyBody) -> Response:
        """vLLM's /classify: every input's class probabilities (or logits) and its most likely class."""
        refuse_unserved(body)
        if body.messages is not None:
            raise errors.InvalidArgument("messages", "the chat form of /classify is not served; give `input`")
        if body.labels or body.label_token_ids:
            raise errors.InvalidArgument("labels" if body.labels else "label_token_ids",
                                         "/classify answers every class")
        batcher, info = self.gate.ready(body.model)
        if info.kind != "classifier":
            raise errors.FailedPrecondition("model", f"{info.name} is a causal LM: /classify needs a "
                                            "sequence-classification head (score labels with /v1/score or /rerank)")
        raw = body.input
        inputs: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not inputs:
            raise errors.InvalidArgument("input", "is empty: give at least one input")
        self.gate.check_items(len(inputs))
        self.gate.check_ids("input", sum(len(x) for x in inputs if not isinstance(x, str)))
        call.summary = f"items={len(inputs)} "
        engine, special = self.gate.engine, body.add_special_tokens

        def tokenize() -> list[list[int]]:
            texts = [x for x in inputs if isinstance(x, str)]
            ids = iter(engine.encode(texts, add_special_tokens=special) if texts else [])
            return [list(next(ids)) if isinstance(x, str) else list(x) for x in inputs]

        sequences = await batcher.call(tokenize)
        for i, ids in enumerate(sequences):
            if len(ids) < 2:
                raise errors.InvalidArgument(f"input[{i}]", f"is {len(ids)} tokens; pyscore classifies sequences "
                                             "of at least 2")
        activate = body.use_activation is not False

        async def one(i: int, ids: list[int]) -> ScoreResult:
            request = ScoreRequest(query=ids[:-1], items=[ids[-1:]], apply_softmax=activate,
                                   bypass_prefix_cache=body.bypass_prefix_cache, prefix_cache_salt=body.salt())
            try:
                return await batcher.score(request)
            except errors.RequestError as e:
                raise renamed(e, f"input[{i}]", f"input[{i}]", [i]) from None

        results = await bounded([functools.partial(one, i, ids) for i, ids in enumerate(sequences)])
        id2label = self._id2label(body.model)
        data = []
        for i, result in enumerate(results):
            probs = np.asarray(result.scores[0][0], dtype=np.float32).tolist()
            best = result.label_token_ids[int(np.argmax(probs))]
            data.append({"index": i, "label": id2label.get(best, str(best)), "probs": probs,
                         "num_classes": len(probs)})
        call.usage = usage = summed_usage([r.usage for r in results])
        return JSON({"id": f"classify-{body.request_id or uuid.uuid4().hex}", "object": "list",
                     "created": int(time.time()), "model": info.name, "data": data, "usage": usage_json(usage)})
