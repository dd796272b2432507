"""Score request preparation: validation, tokenization, label resolution and the choice of SIS or MIS, with
no model work and no torch. Every refusal is an InvalidArgument / FailedPrecondition naming the field.

Semantics follow SGLang's /v1/score: the query is tokenized as the tokenizer normally does (special tokens
included), items without special tokens, and query and item are joined at the token level (`item_first` puts
the item first). SIS and MIS see exactly the same tokens at the same positions.

Mode AUTO (this module is its one definition; the proto's SCORING_MODE_UNSPECIFIED): MIS, unless `item_first` is
set (the query is then a suffix, not a prefix the items can share); then SIS. Forcing MIS with item_first is a
FailedPrecondition. The result's `mode` says which ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pyscore.errors import FailedPrecondition, InvalidArgument, quoted
from pyscore.model.packing import Group
from pyscore.types import ScoreRequest

MODES = ("auto", "sis", "mis")


@dataclass(frozen=True)
class ModelTraits:
    """What preparation needs to know of the model: no weights, just limits and the tokenizer."""

    tokenizer: Any
    vocab_size: int
    max_context: int
    is_classifier: bool
    num_labels: int
    id2label: dict[int, str]


@dataclass
class PreparedScore:
    request: ScoreRequest
    query: list[int]
    items: list[list[int]]
    labels: list[int]  # label token ids (causal LM) or class indices (classifier)
    mode: Literal["sis", "mis"]
    readouts: list[list[int]]  # per item: read-out offsets after the group's prefix: in the item (MIS, SIS), in
    # item + query (item_first SIS, which has no prefix)

    @property
    def num_items(self) -> int:
        return len(self.items)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(self.query) + len(item) for item in self.items)

    @property
    def computed_tokens(self) -> int:
        if self.mode == "mis" and self.items:
            return len(self.query) + sum(len(item) for item in self.items)
        return self.prompt_tokens

    def groups(self) -> list[Group]:
        """MIS: one group, the query as the shared prefix of all items. SIS: one group per query+item, the query
        as the prefix of that one item — the same causal sequence, but the attention kernels then break their
        key tiles at the query/item boundary exactly as in MIS, so SIS and MIS do the same arithmetic for an item
        and give bitwise equal scores (a prefix-less query+item puts query and item keys in shared tiles, which
        changes the softmax's summation order: ~1e-2 in a bf16 probability). item_first SIS is one plain
        sequence (item + query; there is no MIS for it)."""
        if not self.items:
            return []
        if self.mode == "mis":
            return [Group(prefix=self.query, items=self.items, readouts=self.readouts)]
        if self.request.item_first:
            return [Group(prefix=[], items=[item + self.query], readouts=[offsets])
                    for item, offsets in zip(self.items, self.readouts, strict=True)]
        return [Group(prefix=self.query, items=[item], readouts=[offsets])
                for item, offsets in zip(self.items, self.readouts, strict=True)]


def _token_ids(ids: Any, field: str, vocab_size: int) -> list[int]:
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(field, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def _tokenize_inputs(req: ScoreRequest, traits: ModelTraits) -> tuple[list[int], list[list[int]]]:
    tok = traits.tokenizer
    query_is_text = isinstance(req.query, str)
    if query_is_text and not req.query:
        raise InvalidArgument("query", "is required (text or token ids)")
    if not query_is_text and len(req.query) == 0:
        raise InvalidArgument("query_token_ids", "is required (text or token ids)")
    items = list(req.items)
    kinds = {isinstance(item, str) for item in items}
    if len(kinds) > 1:
        raise InvalidArgument("items", "must be all text or all token ids, not mixed")
    if items and kinds != {query_is_text}:
        field = "item_token_ids" if query_is_text else "items"
        raise InvalidArgument(field, "query and items must both be text or both token ids")
    if query_is_text:
        query = list(tok(req.query, add_special_tokens=True)["input_ids"])
        item_ids = [list(ids) for ids in tok(items, add_special_tokens=False)["input_ids"]] if items else []
        field = "items"
    else:
        query = _token_ids(req.query, "query_token_ids", traits.vocab_size)
        item_ids = [_token_ids(item, f"item_token_ids[{i}]", traits.vocab_size) for i, item in enumerate(items)]
        field = "item_token_ids"
    for i, ids in enumerate(item_ids):
        if not ids:
            raise InvalidArgument(f"{field}[{i}]", "is empty")
        if len(query) + len(ids) > traits.max_context:
            raise InvalidArgument(f"{field}[{i}]", f"query + item is {len(query) + len(ids)} tokens, over the "
                                  f"model's context of {traits.max_context}")
    return query, item_ids


def single_token(tokenizer: Any, text: str, field: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise InvalidArgument(field, f"{quoted(text)} is {len(ids)} tokens {quoted(list(ids))}; it must be "
                                     "exactly one token")
    return int(ids[0])


def _resolve_labels(req: ScoreRequest, traits: ModelTraits) -> list[int]:
    if req.label_token_ids and req.labels:
        raise InvalidArgument("labels", "give label_token_ids or labels, not both")
    if traits.is_classifier:
        return _resolve_classes(req, traits)
    if req.labels:
        ids = [single_token(traits.tokenizer, label, f"labels[{i}]") for i, label in enumerate(req.labels)]
        field = "labels"
    elif req.label_token_ids:
        ids = _token_ids(req.label_token_ids, "label_token_ids", traits.vocab_size)
        field = "label_token_ids"
    else:
        raise InvalidArgument("label_token_ids", "a causal LM needs labels: give label_token_ids or labels")
    _check_unique(ids, field)
    return ids


def _check_unique(ids: list[int], field: str) -> None:
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise InvalidArgument(field, f"duplicate labels: {i} occurs more than once in {quoted(ids)}")
        seen.add(i)


def _resolve_classes(req: ScoreRequest, traits: ModelTraits) -> list[int]:
    """Classifier labels are class indices (label_token_ids) or class names from id2label (labels);
    none means every class in order."""
    n = traits.num_labels
    if req.labels:
        by_name = {name: idx for idx, name in traits.id2label.items()}
        missing = [label for label in req.labels if label not in by_name]
        if missing:
            raise InvalidArgument("labels", f"unknown class {quoted(missing[0])}; classes: {quoted(sorted(by_name))}")
        ids, field = [by_name[label] for label in req.labels], "labels"
    elif req.label_token_ids:
        ids, field = [int(i) for i in req.label_token_ids], "label_token_ids"
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise InvalidArgument(field, f"class index {bad[0]} is outside [0, {n})")
    else:
        return list(range(n))
    _check_unique(ids, field)
    return ids


def _resolve_mode(req: ScoreRequest) -> Literal["sis", "mis"]:
    """The mode that runs. "auto" (the proto's SCORING_MODE_UNSPECIFIED) is MIS unless item_first (the query is
    then a suffix that cannot be shared); see the module docstring."""
    if req.mode not in MODES:
        raise InvalidArgument("mode", f"unknown mode {quoted(req.mode)}; expected one of {', '.join(MODES)}")
    if req.mode == "mis" and req.item_first:
        raise FailedPrecondition("mode", "MIS shares the query as a prefix, which item_first makes a suffix; "
                                 "use SIS or AUTO with item_first")
    if req.mode == "auto":
        return "sis" if req.item_first else "mis"
    return req.mode


def _readouts(req: ScoreRequest, traits: ModelTraits, query: list[int], items: list[list[int]]) -> list[list[int]]:
    """Read-out offsets per item, after the group's prefix (PreparedScore.readouts): the last token (pointwise:
    the item's, or with item_first the query's, which follows the item) or every marker token (setwise; markers
    are in the item, which starts the sequence after the prefix in every mode)."""
    if not req.score_extraction_token:
        tail = len(query) if req.item_first else 0
        return [[len(item) + tail - 1] for item in items]
    marker = single_token(traits.tokenizer, req.score_extraction_token, "score_extraction_token")
    if marker in query:
        raise InvalidArgument("score_extraction_token", "the marker token must not occur in the query")
    readouts = []
    for i, item in enumerate(items):
        offsets = [j for j, t in enumerate(item) if t == marker]
        if not offsets:
            raise InvalidArgument(f"items[{i}]", f"has no score_extraction_token {quoted(req.score_extraction_token)}")
        readouts.append(offsets)
    return readouts


def prepare_score(req: ScoreRequest, traits: ModelTraits) -> PreparedScore:
    mode = _resolve_mode(req)
    labels = _resolve_labels(req, traits)
    query, items = _tokenize_inputs(req, traits)
    readouts = _readouts(req, traits, query, items)
    return PreparedScore(request=req, query=query, items=items, labels=labels, mode=mode, readouts=readouts)

