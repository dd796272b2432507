"""vLLM's APIs for rerankers and classifiers: `POST /rerank` (also `/v1/rerank` and `/v2/rerank`, Jina's and
Cohere's shape), `POST /score` (also `/v1/score` when the body is vLLM's rather than SGLang's) and
`POST /classify`, each answered by pyscore's Score through the same batcher as gRPC.

A document's relevance to a query (a pair's score), by the served model:
- a causal LM (an LLM reranker such as Qwen3-Reranker, which vLLM serves converted into a classifier from the
  tokens "no" and "yes"): the first label's share of the softmax over the labels: the server's --rerank-labels
  (default ["yes", "no"]; vLLM's classifier_from_token is set per server too) or a request's pyscore extras
  `labels` / `label_token_ids`, positive first. With two labels that is vLLM's sigmoid of the two tokens' logit
  difference, and `use_activation: false` gives that difference itself (the logit of vLLM's converted one-class
  head, w_yes - w_no), read back from the label softmax as log p0 - log p1; one label alone gives its probability
  over the vocabulary (and refuses `use_activation: false`: pyscore does not return a raw logit);
- a classifier with one class (a cross-encoder head): the sigmoid of its logit (vLLM's activation for one class),
  or the logit with `use_activation: false`;
- a classifier with several classes: vLLM serves /score and /rerank for one-class classifiers only and answers
  404 otherwise (the routes are not registered: its body for a missing route), and so does pyscore, with that
  same body, unless the request names the class whose score ranks (pyscore's `labels` / `label_token_ids`): its
  softmax probability over every class, or its logit.

Truncation keeps the end of what it shortens, where the score is read (the answer boundary: a template's
suffix, the position the labels are asked at): `truncate_prompt_tokens` N keeps a pair's (or a /classify input's)
last N tokens (-1: the model's context), as vLLM's `truncation_side: "left"` does; `"right"`, which would cut the
read-out position away, is refused. `max_tokens_per_query` / `max_tokens_per_doc` N keep a query's / document's
last N tokens (their text re-decoded, then joined as vLLM joins truncated texts).

Sequences are tokenized as vLLM's LLM reranker tokenizes them: each pair's query + document as one text, with the
tokenizer's special tokens (so the tokens, and the scores, are vLLM's whatever the texts; a cross-encoder's
separator tokens are not added). A pair is split into query and item where its tokens stop being the query's own
(`shared_prefix_requests`), so that its score depends on its own texts alone, and the pairs of one query are one
MIS request (vLLM computes every pair in full); vLLM's N:N score pairs are grouped by query. A template (an LLM
reranker's prefix, instruction and suffix) is the client's text, as with vLLM's LLM-reranker examples.

/classify: every input its own sequence, tokenized as vLLM does (special tokens on by default), or the chat
form, `messages` under the model's chat template (vLLM's defaults: no generation prompt, no extra special
tokens); read out at its last token; `probs` is the softmax over every class (the logits with
`use_activation: false`), `label` the most likely class's name."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.responses import Response

from pyscore import errors
from pyscore.types import ModelInfo, ScoreRequest, ScoreResult, Usage

from .engine_like import EngineLike
from .gate import Gate
from .http_call import JSON, Call, NotServed, bounded
from .http_openai import chat_message
from .http_schema import ClassifyBody, PoolingOptions, RerankBody, ScoringPairOptions, VLLMScoreBody
from .http_score import summed_usage, usage_json

RERANK_LABELS = ["yes", "no"]  # the default of --rerank-labels: Qwen3-Reranker's tokens, vLLM's documented
# classifier_from_token (no, yes)
SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
VLLM_SCORE_FIELDS = frozenset(name for pair in SIDES for name in pair)


def is_vllm_score(data: Any) -> bool:
    """A /v1/score body spelled as vLLM's (its sides, and no SGLang `query`); `items` alone is SGLang's."""
    return isinstance(data, dict) and "query" not in data and not (VLLM_SCORE_FIELDS - {"items"}).isdisjoint(data)


@dataclass(frozen=True)
class Truncation:
    """How much of a request's sequences is kept, from the end (0: all): the whole sequence (a pair, a classify
    input), and a pair's query and document sides before they are joined."""

    prompt: int = 0
    query: int = 0
    document: int = 0

    @staticmethod
    def of(body: PoolingOptions, context: int) -> Truncation:
        """vLLM's fields, checked as vLLM checks them (and a prompt of at least 2: pyscore reads a sequence's last
        token after at least one other)."""
        if body.truncation_side == "right":
            raise errors.InvalidArgument("truncation_side", "\"right\" keeps a prompt's first tokens and cuts its "
                                         "end, where the score is read; pyscore keeps the last ones (\"left\")")
        n = body.truncate_prompt_tokens
        if n is not None and not (n == -1 or 2 <= n <= context):
            raise errors.InvalidArgument("truncate_prompt_tokens", f"must be -1 (the model's context) or in [2, "
                                         f"{context}] (the last tokens kept), got {n}")
        sides = {"max_tokens_per_query": 0, "max_tokens_per_doc": 0}
        if isinstance(body, ScoringPairOptions):
            sides = {"max_tokens_per_query": body.max_tokens_per_query, "max_tokens_per_doc": body.max_tokens_per_doc}
        for name, value in sides.items():
            if not 0 <= value < context:
                raise errors.InvalidArgument(name, f"must be in [0, {context}) (0: off), got {value}")
        return Truncation(prompt=0 if n is None else context if n == -1 else n,
                          query=sides["max_tokens_per_query"], document=sides["max_tokens_per_doc"])

    def tail(self, ids: list[int]) -> list[int]:
        return ids[-self.prompt:] if self.prompt else ids


def tail_texts(engine: EngineLike, texts: list[str], keep: int) -> list[str]:
    """Each text cut to its last `keep` tokens (no special tokens) and decoded back, as vLLM truncates a side's
    text before joining it; a text already within `keep` is left as it is."""
    if not keep:
        return texts
    ids = engine.encode(texts, add_special_tokens=False)
    return [text if len(t) <= keep else engine.decode(list(t[-keep:])) for text, t in zip(texts, ids, strict=True)]


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


def shared_prefix_requests(engine: EngineLike, queries: list[str], documents: list[str], field: str,
                           cut: Truncation = Truncation()) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """(pair indices, query ids, item ids) per Score request (on the engine thread: the work grows with the
    input). Each pair is tokenized as vLLM's LLM reranker does, query + document as one text with the tokenizer's
    special tokens, and split where its tokens stop being the query's own (at the latest before its last token):
    a pair's split depends on its own two texts alone, never on the other documents, so its score does not
    either, and where the join is a token boundary it is Score's split (the same bits as gRPC's Score). The
    pairs with one shared prefix are one MIS request. Truncation cuts the sides' texts before they are joined and
    the pair's tokens from its start; the split moves with the cut (and, where the cut took the whole query, sits
    before the last token)."""
    queries, documents = tail_texts(engine, queries, cut.query), tail_texts(engine, documents, cut.document)
    texts = [q + d for q, d in zip(queries, documents, strict=True)]
    distinct = list(dict.fromkeys(queries))
    # one batch call: 16 joined 330-token texts ~5-7 ms, where one engine.tokenize each (it also decodes every
    # token to its text) took ~19
    encoded = engine.encode([*texts, *distinct], add_special_tokens=True)
    own = {q: list(ids) for q, ids in zip(distinct, encoded[len(texts):], strict=True)}
    plans: dict[tuple[int, ...], tuple[list[int], list[int], list[list[int]]]] = {}
    for i, (query, ids) in enumerate(zip(queries, encoded[: len(texts)], strict=True)):
        full, prefix = list(ids), own[query]
        if len(full) < 2:
            raise errors.InvalidArgument(f"{field}[{i}]", f"query + document is {len(full)} token(s); a pair is "
                                         "read out at its last token after at least one other")
        limit = min(len(prefix), len(full) - 1)
        split = next((j for j in range(limit) if full[j] != prefix[j]), limit)
        seq = cut.tail(full)
        split = split - (len(full) - len(seq))
        split = split if split > 0 else len(seq) - 1
        key = tuple(seq[:split])
        if key not in plans:
            plans[key] = ([], seq[:split], [])
        index, _, items = plans[key]
        index.append(i)
        items.append(seq[split:])
    return list(plans.values())


class Relevance:
    """How one request turns a Score row into a pair's score (the module docstring's rules)."""

    def __init__(self, info: ModelInfo, body: PoolingOptions, id2label: dict[int, str], default_labels: list[str]
                 ) -> None:
        activate = body.use_activation is not False
        labels, ids = body.labels or None, body.label_token_ids or None
        self.sigmoid, self.column, self.default_labels, self.logit_difference = False, 0, False, False
        if info.kind != "classifier":
            chosen = labels or (None if ids else default_labels)
            count = len(chosen or ids or [])
            if not activate and count != 2:
                raise errors.InvalidArgument("use_activation", f"false is served with two labels (their logit "
                                             f"difference, vLLM's converted reranker's logit); got {count}")
            self.request: dict[str, Any] = {"labels": chosen, "label_token_ids": ids, "apply_softmax": count > 1}
            self.default_labels = not labels and not ids
            self.logit_difference = not activate
            return
        # A classifier: every class is scored (a softmax needs them all) and one column is read.
        self.request = {"labels": None, "label_token_ids": None, "apply_softmax": activate and info.num_labels > 1}
        field = "labels" if labels else "label_token_ids"
        named: list[Any] = labels or ids or []
        if info.num_labels == 1 and not named:
            self.sigmoid = activate
            return
        if not named:  # vLLM registers its scoring routes for one-class models only: its 404 for a missing route
            raise NotServed()
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
        if self.logit_difference:  # softmax of two labels: log p0 - log p1 = logit0 - logit1, the logZ cancelling
            pairs = np.asarray([rows[0][:2] for rows in result.scores], dtype=np.float64)
            with np.errstate(divide="ignore"):  # a probability that underflowed to 0: an infinite difference
                return (np.log(pairs[:, 0]) - np.log(pairs[:, 1])).astype(np.float32).tolist()
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
        cut, engine = Truncation.of(body, info.max_context), self.gate.engine
        plans = await batcher.call(lambda: shared_prefix_requests(engine, queries, documents, names[1], cut))
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
        if body.labels or body.label_token_ids:
            raise errors.InvalidArgument("labels" if body.labels else "label_token_ids",
                                         "/classify answers every class")
        batcher, info = self.gate.ready(body.model)
        if info.kind != "classifier":
            raise errors.FailedPrecondition("model", f"{info.name} is a causal LM: /classify needs a "
                                            "sequence-classification head (score labels with /v1/score or /rerank)")
        cut = Truncation.of(body, info.max_context)
        if body.messages is not None:
            sequences, names = await self._chat_sequence(body), ["messages"]
        else:
            sequences = await self._input_sequences(body)
            names = [f"input[{i}]" for i in range(len(sequences))]
        sequences = [cut.tail(ids) for ids in sequences]
        call.summary = f"items={len(sequences)} "
        for name, ids in zip(names, sequences, strict=True):
            if len(ids) < 2:
                raise errors.InvalidArgument(name, f"is {len(ids)} tokens; pyscore classifies sequences of at least 2")
        activate = body.use_activation is not False

        async def one(i: int, ids: list[int]) -> ScoreResult:
            request = ScoreRequest(query=ids[:-1], items=[ids[-1:]], apply_softmax=activate,
                                   bypass_prefix_cache=body.bypass_prefix_cache, prefix_cache_salt=body.salt())
            try:
                return await batcher.score(request)
            except errors.RequestError as e:
                raise renamed(e, names[i], names[i], [i]) from None

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

    async def _input_sequences(self, body: ClassifyBody) -> list[list[int]]:
        """vLLM's completion form: a text, a list of texts, token ids or lists of them; texts tokenized with the
        tokenizer's special tokens unless `add_special_tokens` is false."""
        raw = body.input
        if raw is None:
            raise errors.InvalidArgument("input", "is required (or `messages`, the chat form)")
        inputs: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not inputs:
            raise errors.InvalidArgument("input", "is empty: give at least one input")
        self.gate.check_items(len(inputs))
        self.gate.check_ids("input", sum(len(x) for x in inputs if not isinstance(x, str)))
        batcher, _ = self.gate.ready(body.model)
        engine, special = self.gate.engine, body.add_special_tokens is not False

        def tokenize() -> list[list[int]]:
            texts = [x for x in inputs if isinstance(x, str)]
            ids = iter(engine.encode(texts, add_special_tokens=special) if texts else [])
            return [list(next(ids)) if isinstance(x, str) else list(x) for x in inputs]

        return await batcher.call(tokenize)

    async def _chat_sequence(self, body: ClassifyBody) -> list[list[int]]:
        """vLLM's chat form (ClassificationChatRequest): one conversation under the model's chat template, one
        sequence; vLLM's defaults, no generation prompt and no special tokens beyond the template's."""
        if body.input is not None:
            raise errors.InvalidArgument("messages", "give `input` or `messages`, not both")
        if not body.messages:
            raise errors.InvalidArgument("messages", "is empty: give at least one message")
        if body.add_special_tokens:
            raise errors.InvalidArgument("add_special_tokens", "true is not served with `messages`: the chat "
                                         "template's own special tokens are used (vLLM's default, false)")
        if body.chat_template is not None:
            raise errors.InvalidArgument("chat_template", "a request's own template is not served (vLLM refuses it "
                                         "without --trust-request-chat-template); the model's is used")
        if body.add_generation_prompt and body.continue_final_message:
            raise errors.InvalidArgument("continue_final_message", "cannot be true with add_generation_prompt")
        kwargs = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        batcher, _ = self.gate.ready(body.model)
        messages = [chat_message(m) for m in body.messages]
        return [await batcher.call(self.gate.engine.render_chat, messages, kwargs, body.add_generation_prompt)]
