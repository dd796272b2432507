"""Scoring over HTTP: SGLang's `POST /v1/score` and vLLM's `POST /generative_scoring`, each turned into the same
pyscore ScoreRequest a gRPC Score call makes and sent through the same batcher, so HTTP and gRPC requests share
forward passes and answer the same question with the same bits (scores rounded to float32, as the proto's
`float` rounds them).

/v1/score answers SGLang's ScoringResponse: `scores` [item][label] ([item][row][label] with a setwise
`score_extraction_token`), `model`, `usage`, `object: "scoring"`, plus pyscore's `mode` and `label_token_ids`; it
refuses what SGLang's scoring refuses, with SGLang's status and its flat error object (no `items`, one string as
`items`, no `query`, another model's name: 400), and scores what SGLang scores: an empty query is no query (each
item alone, as SGLang's query + item is the item), an empty item the query's next token.
/generative_scoring answers vLLM's shape: `data: [{index, object: "score", score}]` with `score` the first label's
probability (over the labels with `apply_softmax`, vLLM's default, else over the vocabulary), one completion token
counted per item as vLLM counts its one generated token, no items refused as vLLM refuses them. Where vLLM
tokenizes query and items separately (`add_special_tokens: false`, or text and token ids mixed), the text is
tokenized here first, on the engine thread, exactly as the engine would: the query with (or, as asked, without)
special tokens, items without."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import replace
from typing import Any

from starlette.responses import Response

from pyscore import errors
from pyscore.types import ScoreRequest, ScoreResult, Usage

from .gate import Gate
from .http_call import JSON, Call, bounded, fp32
from .http_schema import GenerativeScoringBody, ScoringBody

# engine / proto field -> the field a client of these endpoints wrote
SCORE_FIELDS = {"query_token_ids": "query", "item_token_ids": "items"}


def usage_json(usage: Usage, completion_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage (cached tokens in prompt_tokens_details) plus what pyscore measured: tokens computed and
    the server-side queue wait and compute time."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": usage.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "computed_tokens": usage.computed_tokens, "queue_s": usage.queue_s, "compute_s": usage.compute_s}


def summed_usage(usages: list[Usage]) -> Usage:
    """Several Score requests answering one call: their tokens summed, the longest queue wait and compute time."""
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 computed_tokens=sum(u.computed_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in usages),
                 queue_s=max((u.queue_s for u in usages), default=0.0),
                 compute_s=max((u.compute_s for u in usages), default=0.0))


def token_ids_in(query: str | list[int], items: list[str] | list[list[int]]) -> int:
    """Token ids given as ids (what the servicer counts against --max-request-tokens before any model work)."""
    return (0 if isinstance(query, str) else len(query)) + sum(len(i) for i in items if not isinstance(i, str))


def sglang_inputs(body: ScoringBody) -> tuple[str | list[int], list[Any]]:
    """(query, items) as SGLang's scoring takes them: both required (an empty query or empty list of items is
    still given), items a list (SGLang refuses one string here)."""
    if body.query is None:
        raise errors.InvalidArgument("query", "is required (text or token ids; \"\" scores the items alone)")
    if body.items is None:
        raise errors.InvalidArgument("items", "must be provided (a list of texts or of token-id lists)")
    if isinstance(body.items, str):
        raise errors.InvalidArgument("items", "must be a list of texts or of token-id lists, not one string")
    return body.query, list(body.items)


class ScoreEndpoints:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def _score(self, call: Call, model: str | None, request: ScoreRequest) -> tuple[ScoreResult, str]:
        batcher, info = self.gate.ready(model)
        self.gate.check_items(len(request.items))
        self.gate.check_ids("items", token_ids_in(request.query, request.items))  # type: ignore[arg-type]
        call.summary = f"items={len(request.items)} "
        result = await batcher.score(request)
        call.usage = result.usage
        return result, info.name

    async def score(self, call: Call, body: ScoringBody) -> Response:
        """SGLang's /v1/score. An empty item scores the query's next token, as in SGLang (query + "" is the query):
        those items are asked as the query's last token after the rest of the query, beside the others. An empty
        query scores each item alone (query + item is the item)."""
        self._check_sglang_model(body.model)
        query, items = sglang_inputs(body)
        request = ScoreRequest(query=query, items=items,
                               label_token_ids=body.label_token_ids or None, labels=body.labels or None,
                               apply_softmax=body.apply_softmax, item_first=body.item_first,
                               score_extraction_token=body.score_extraction_token or None, mode=body.mode,
                               bypass_prefix_cache=body.bypass_prefix_cache, prefix_cache_salt=body.salt())
        empty = [i for i, item in enumerate(items) if len(item) == 0]
        same_kind = all(isinstance(item, str) == isinstance(request.query, str) for item in items)
        if not query and same_kind and not request.score_extraction_token:
            result, name = await self._items_alone(call, body.model, request)
        elif empty and query and same_kind and not request.score_extraction_token:
            result, name = await self._with_empty_items(call, body.model, request, empty)
        else:
            result, name = await self._score(call, body.model, request)
        if body.score_extraction_token:
            scores: list[Any] = [[fp32(row) for row in rows] for rows in result.scores]
        else:
            scores = [fp32(rows[0]) for rows in result.scores]
        return JSON({"scores": scores, "model": name, "usage": usage_json(result.usage), "object": "scoring",
                     "mode": result.mode, "label_token_ids": result.label_token_ids})

    def _check_sglang_model(self, model: str | None) -> None:
        """Another model's name is SGLang's 400 (its "The model ... does not exist"), where pyscore's gRPC and vLLM
        routes answer NOT_FOUND."""
        _, info = self.gate.ready(None)
        if model and model != info.name:
            raise errors.InvalidArgument("model", f"The model `{model}` does not exist. The served model name is "
                                         f"`{info.name}`")

    async def _items_alone(self, call: Call, model: str | None, request: ScoreRequest) -> tuple[ScoreResult, str]:
        """An empty query: every item its own sequence, as SGLang's query + item is the item: a text tokenized
        with the tokenizer's special tokens (SGLang tokenizes the joined text), token ids as they are; each read at
        its last token after the rest. No items: the empty answer (the labels still checked, against a one-token
        stand-in query that no item reads)."""
        batcher, _ = self.gate.ready(model)
        if not request.items:
            return await self._score(call, model, replace(request, query=[0]))
        self.gate.check_items(len(request.items))
        self.gate.check_ids("items", token_ids_in([], request.items))
        engine, items = self.gate.engine, request.items
        texts = [item for item in items if isinstance(item, str)]
        sequences = (await batcher.call(lambda: engine.encode(texts, add_special_tokens=True)) if texts
                     else [list(item) for item in items])
        for i, ids in enumerate(sequences):
            if len(ids) < 2:
                raise errors.InvalidArgument(f"items[{i}]", f"is {len(ids)} token(s) and the query is empty: the item "
                                             "alone is scored at its last token, which needs two or more")

        async def one(i: int, ids: list[int]) -> tuple[ScoreResult, str]:
            try:
                return await self._score(call, model, replace(request, query=ids[:-1], items=[ids[-1:]],
                                                              item_first=False))
            except errors.RequestError as e:  # the item's tokens are the request's query and item here
                if e.field.startswith(("query", "item")):
                    raise type(e)(f"items[{i}]", str(e).removeprefix(f"{e.field}: ")) from None
                raise

        answers = await bounded([functools.partial(one, i, list(ids)) for i, ids in enumerate(sequences)])
        results = [result for result, _ in answers]
        call.usage = usage = summed_usage([r.usage for r in results])
        call.summary = f"items={len(items)} "
        merged = ScoreResult(scores=[r.scores[0] for r in results], label_token_ids=results[0].label_token_ids,
                             mode=results[-1].mode, usage=usage)
        return merged, answers[0][1]

    async def _with_empty_items(self, call: Call, model: str | None, request: ScoreRequest, empty: list[int]
                                ) -> tuple[ScoreResult, str]:
        """The request's empty items answered as its query's next token (the query's last token as the item, the
        rest as the query: the same sequence, read out at its end), the others as asked; rows in item order."""
        batcher, _ = self.gate.ready(model)
        query = request.query
        if isinstance(query, str):
            engine, text = self.gate.engine, query
            query = await batcher.call(lambda: engine.encode([text], add_special_tokens=True)[0])
        if len(query) < 2:
            raise errors.InvalidArgument(f"items[{empty[0]}]", "is empty and the query is one token: an empty "
                                         "item scores the token after the query, which needs a query of two or more")
        skip = set(empty)
        rest = [i for i in range(len(request.items)) if i not in skip]
        tail = replace(request, query=list(query[:-1]), items=[[query[-1]]], item_first=False)
        parts = [self._score(call, model, tail)]
        if rest:
            parts.append(self._score(call, model, replace(request, items=[request.items[i] for i in rest])))
        answers = await asyncio.gather(*parts)
        rows: list[Any] = [None] * len(request.items)
        for i in empty:
            rows[i] = answers[0][0].scores[0]
        if rest:
            for i, item_rows in zip(rest, answers[1][0].scores, strict=True):
                rows[i] = item_rows
        results = [r for r, _ in answers]
        usage = summed_usage([r.usage for r in results])
        usage.prompt_tokens += (len(empty) - 1) * len(query)  # every empty item's sequence is the whole query
        call.usage = usage
        merged = ScoreResult(scores=rows, label_token_ids=results[0].label_token_ids, mode=results[-1].mode,
                             usage=usage)
        return merged, answers[0][1]

    async def generative_scoring(self, call: Call, body: GenerativeScoringBody) -> Response:
        """vLLM's /generative_scoring."""
        if not body.items:
            raise errors.InvalidArgument("items", "must contain at least one item")
        query, items = await self._vllm_tokens(body)
        request = ScoreRequest(query=query, items=items, label_token_ids=body.label_token_ids or None,
                               apply_softmax=body.apply_softmax, item_first=body.item_first,
                               bypass_prefix_cache=body.bypass_prefix_cache, prefix_cache_salt=body.salt())
        result, name = await self._score(call, body.model, request)
        data = [{"index": i, "object": "score", "score": fp32(rows[0][:1])[0] if rows[0] else None}
                for i, rows in enumerate(result.scores)]
        return JSON({"id": f"generative-scoring-{body.request_id or uuid.uuid4().hex}", "object": "list",
                     "created": int(time.time()), "model": name, "data": data,
                     "usage": usage_json(result.usage, completion_tokens=len(data))})

    async def _vllm_tokens(self, body: GenerativeScoringBody) -> tuple[Any, Any]:
        """query and items as the engine takes them: unchanged, unless vLLM's rules differ from the engine's
        (no special tokens on the query, or text mixed with ids): then the text is tokenized here."""
        query, items = body.query, list(body.items)
        text_query = isinstance(query, str)
        mixed = bool(items) and text_query != isinstance(items[0], str)
        if not mixed and (body.add_special_tokens or not text_query):
            return query, items
        batcher, _ = self.gate.ready(body.model)
        engine, special = self.gate.engine, body.add_special_tokens

        def tokenize() -> tuple[list[int], list[list[int]]]:
            ids = engine.tokenize(query, special)[0] if isinstance(query, str) else query
            return ids, [engine.tokenize(i, False)[0] if isinstance(i, str) else i for i in items]

        return await batcher.call(tokenize)
