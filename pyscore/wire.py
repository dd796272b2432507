"""protobuf (pyscore.v1) <-> pyscore.types, both directions: the only place that knows both. The servicer
converts requests from and results to the wire with it, the client the other way round. Structural problems
that the plain types cannot even express (both `query` and `query_token_ids`, an unknown mode) are
InvalidArgument here, naming the proto field; everything else is the engine's to validate."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore.errors import InvalidArgument
from pyscore.types import (
    GenerateRequest,
    GenerateResult,
    MemoryPlan,
    Mode,
    ModelInfo,
    ScoreRequest,
    ScoreResult,
    ServerLimits,
    TokenLogprob,
    TopLogprob,
    Usage,
)

DEFAULT_MAX_TOKENS = 16  # GenerateRequest.max_tokens = 0 means this

# The proto's unspecified mode is the server's choice ("auto").
_MODE_TO_PROTO: dict[str, int] = {"auto": pb.SCORING_MODE_UNSPECIFIED, "sis": pb.SCORING_MODE_SIS,
                                  "mis": pb.SCORING_MODE_MIS}
_MODE_FROM_PROTO: dict[int, Mode] = {v: k for k, v in _MODE_TO_PROTO.items()}  # type: ignore[misc]
_FINISH_TO_PROTO: dict[str, int] = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP,
                                    "eos": pb.FINISH_REASON_EOS}
_FINISH_FROM_PROTO: dict[int, str] = {v: k for k, v in _FINISH_TO_PROTO.items()}
_KIND_TO_PROTO: dict[str, int] = {"causal_lm": pb.MODEL_KIND_CAUSAL_LM, "classifier": pb.MODEL_KIND_CLASSIFIER}
_KIND_FROM_PROTO: dict[int, str] = {v: k for k, v in _KIND_TO_PROTO.items()}


def mode_from_proto(value: int) -> Mode:
    if value not in _MODE_FROM_PROTO:
        raise InvalidArgument("mode", f"unknown ScoringMode {value}")
    return _MODE_FROM_PROTO[value]


def mode_to_proto(mode: str) -> int:
    return _MODE_TO_PROTO[mode]


def finish_reason_from_proto(value: int) -> str | None:
    """The finish reason of a GenerateResponse; None while unfinished (a streamed chunk but the last)."""
    return _FINISH_FROM_PROTO.get(value)


# -- Score ----------------------------------------------------------------------------------------------------
def score_request_from_proto(msg: pb.ScoreRequest) -> ScoreRequest:
    if msg.query and msg.query_token_ids:
        raise InvalidArgument("query_token_ids", "give query or query_token_ids, not both")
    if msg.items and msg.item_token_ids:
        raise InvalidArgument("item_token_ids", "give items or item_token_ids, not both")
    query: str | list[int] = list(msg.query_token_ids) if msg.query_token_ids else msg.query
    items: list[str] | list[list[int]] = (
        [list(t.ids) for t in msg.item_token_ids] if msg.item_token_ids else list(msg.items)
    )
    return ScoreRequest(
        query=query,
        items=items,
        label_token_ids=list(msg.label_token_ids) or None,
        labels=list(msg.labels) or None,
        apply_softmax=msg.apply_softmax,
        item_first=msg.item_first,
        score_extraction_token=msg.score_extraction_token or None,
        mode=mode_from_proto(msg.mode),
        bypass_prefix_cache=msg.bypass_prefix_cache,
        prefix_cache_salt=msg.prefix_cache_salt,
    )


def score_request_to_proto(req: ScoreRequest, model: str = "") -> pb.ScoreRequest:
    msg = pb.ScoreRequest(
        model=model,
        label_token_ids=req.label_token_ids or [],
        labels=req.labels or [],
        apply_softmax=req.apply_softmax,
        item_first=req.item_first,
        score_extraction_token=req.score_extraction_token or "",
        mode=mode_to_proto(req.mode),
        bypass_prefix_cache=req.bypass_prefix_cache,
        prefix_cache_salt=req.prefix_cache_salt,
    )
    if isinstance(req.query, str):
        msg.query = req.query
    else:
        msg.query_token_ids.extend(req.query)
    for item in req.items:
        if isinstance(item, str):
            msg.items.append(item)
        else:
            msg.item_token_ids.add(ids=item)
    return msg


def score_result_to_proto(result: ScoreResult, model: str) -> pb.ScoreResponse:
    return pb.ScoreResponse(
        scores=[pb.ItemScores(rows=[pb.ScoreRow(values=row) for row in rows]) for rows in result.scores],
        label_token_ids=result.label_token_ids,
        mode=mode_to_proto(result.mode),
        usage=usage_to_proto(result.usage),
        model=model,
    )


def score_result_from_proto(msg: pb.ScoreResponse) -> ScoreResult:
    return ScoreResult(
        scores=[[list(row.values) for row in item.rows] for item in msg.scores],
        label_token_ids=list(msg.label_token_ids),
        mode=mode_from_proto(msg.mode),  # type: ignore[arg-type]
        usage=usage_from_proto(msg.usage),
    )


def usage_to_proto(usage: Usage) -> pb.Usage:
    msg = pb.Usage(prompt_tokens=usage.prompt_tokens, computed_tokens=usage.computed_tokens,
                   cached_tokens=usage.cached_tokens)
    msg.queue_duration.FromNanoseconds(round(usage.queue_s * 1e9))
    msg.compute_duration.FromNanoseconds(round(usage.compute_s * 1e9))
    return msg


def usage_from_proto(msg: pb.Usage) -> Usage:
    return Usage(prompt_tokens=msg.prompt_tokens, computed_tokens=msg.computed_tokens,
                 cached_tokens=msg.cached_tokens, queue_s=msg.queue_duration.ToNanoseconds() / 1e9,
                 compute_s=msg.compute_duration.ToNanoseconds() / 1e9)


# -- Generate -------------------------------------------------------------------------------------------------
def generate_request_from_proto(msg: pb.GenerateRequest) -> GenerateRequest:
    if msg.prompt and msg.prompt_token_ids:
        raise InvalidArgument("prompt_token_ids", "give prompt or prompt_token_ids, not both")
    return GenerateRequest(
        prompt=msg.prompt or None,
        prompt_token_ids=list(msg.prompt_token_ids) or None,
        apply_chat_template=msg.apply_chat_template,
        max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        top_logprobs=msg.top_logprobs,
        bypass_prefix_cache=msg.bypass_prefix_cache,
        prefix_cache_salt=msg.prefix_cache_salt,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        prompt_logprobs_start=msg.prompt_logprobs_start,
    )


def generate_request_to_proto(req: GenerateRequest, model: str = "") -> pb.GenerateRequest:
    if req.stop_token_ids:  # refused rather than dropped: the proto has no such field
        raise InvalidArgument("stop_token_ids", "pyscore.v1's Generate has no stop_token_ids (the HTTP "
                              "completions and chat routes take them)")
    return pb.GenerateRequest(
        model=model,
        prompt=req.prompt or "",
        prompt_token_ids=req.prompt_token_ids or [],
        apply_chat_template=req.apply_chat_template,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        top_logprobs=req.top_logprobs,
        bypass_prefix_cache=req.bypass_prefix_cache,
        prefix_cache_salt=req.prefix_cache_salt,
        prompt_logprobs=req.prompt_logprobs,
        prompt_logprobs_start=req.prompt_logprobs_start,
    )


def logprobs_to_proto(logprobs: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(token_id=lp.token_id, token=lp.token, logprob=lp.logprob,
                        top=[pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in lp.top])
        for lp in logprobs
    ]


def logprobs_from_proto(msgs: Sequence[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.token_id, lp.token, lp.logprob, [TopLogprob(t.token_id, t.token, t.logprob) for t in lp.top])
        for lp in msgs
    ]


def generate_response(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], text: str,
                      final: GenerateResult | None = None,
                      prompt_logprobs: Sequence[TokenLogprob] | None = None) -> pb.GenerateResponse:
    """One GenerateResponse: the whole result (unary), or a stream chunk whose `final` (the finished
    result, on the last chunk only) supplies finish_reason and usage; `prompt_logprobs` on the first only."""
    msg = pb.GenerateResponse(text=text, token_ids=token_ids, logprobs=logprobs_to_proto(logprobs),
                              prompt_logprobs=logprobs_to_proto(prompt_logprobs or []))
    if final is not None:
        msg.finish_reason = _FINISH_TO_PROTO[final.finish_reason]  # type: ignore[assignment]
        msg.usage.CopyFrom(usage_to_proto(final.usage))
    return msg


def generate_result_to_proto(result: GenerateResult) -> pb.GenerateResponse:
    return generate_response(result.token_ids, result.logprobs, result.text, result, result.prompt_logprobs)


def generate_result_from_proto(msg: pb.GenerateResponse, prompt_logprobs: bool = False) -> GenerateResult:
    """prompt_logprobs: the request asked for them (an empty list is then an answer, not their absence)."""
    return GenerateResult(text=msg.text, token_ids=list(msg.token_ids), logprobs=logprobs_from_proto(msg.logprobs),
                          finish_reason=finish_reason_from_proto(msg.finish_reason),  # type: ignore[arg-type]
                          usage=usage_from_proto(msg.usage),
                          prompt_logprobs=logprobs_from_proto(msg.prompt_logprobs)
                          if prompt_logprobs or msg.prompt_logprobs else None)


# -- ModelInfo ------------------------------------------------------------------------------------------------
def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    msg = pb.ModelInfo(name=info.name, architecture=info.architecture, kind=_KIND_TO_PROTO[info.kind],  # type: ignore[arg-type]
                       vocab_size=info.vocab_size, max_context=info.max_context, dtype=info.dtype, device=info.device,
                       special_tokens=info.special_tokens, num_labels=info.num_labels, ops=info.ops,
                       prefix_cache_block_tokens=info.prefix_cache_block_tokens,
                       prefix_cache_bytes=info.prefix_cache_bytes, server_version=info.server_version,
                       cpu_tier=info.cpu_tier, quantize=info.quantize)
    if info.limits is not None:
        msg.limits.CopyFrom(pb.ServerLimits(**dataclasses.asdict(info.limits)))
    if info.memory is not None:
        msg.memory.CopyFrom(pb.MemoryPlan(**dataclasses.asdict(info.memory),
                                          expected_total_bytes=info.memory.expected_total_bytes))
    return msg


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    limits = ServerLimits(**{f.name: getattr(msg.limits, f.name) for f in dataclasses.fields(ServerLimits)})
    return ModelInfo(name=msg.name, architecture=msg.architecture,
                     kind=_KIND_FROM_PROTO.get(msg.kind, ""),  # type: ignore[arg-type]
                     vocab_size=msg.vocab_size, max_context=msg.max_context, dtype=msg.dtype, device=msg.device,
                     special_tokens=dict(msg.special_tokens), num_labels=msg.num_labels, ops=dict(msg.ops),
                     limits=limits if msg.HasField("limits") else None,
                     prefix_cache_block_tokens=msg.prefix_cache_block_tokens,
                     prefix_cache_bytes=msg.prefix_cache_bytes, server_version=msg.server_version,
                     cpu_tier=msg.cpu_tier, quantize=msg.quantize,
                     memory=MemoryPlan(**{f.name: getattr(msg.memory, f.name) for f in dataclasses.fields(MemoryPlan)})
                     if msg.HasField("memory") else None)


# -- undecodable bytes ----------------------------------------------------------------------------------------
def undecodable_field(descriptor: Any, data: bytes) -> str:
    """Names the top-level string field of message type `descriptor` whose bytes in `data` are not UTF-8 (what
    protobuf refuses to parse without saying where), or '' when that is not the reason `data` does not parse.

    It runs on the server's event loop (inside gRPC's deserializer), so its cost is bounded by protobuf's own
    parse, in C: `data` is parsed once with every string read as bytes (malformed bytes fail here, e.g. a varint
    longer than 10 bytes), then once more per repeated string field present, with that field alone read as text.
    A singular field is checked by one C-level decode. No Python loop runs over the bytes or the entries."""
    try:
        parsed = _lenient_class(descriptor, "").FromString(data)
    except DecodeError:
        return ""
    for field in descriptor.fields:
        if field.type != field.TYPE_STRING:
            continue
        if field.is_repeated:
            if len(getattr(parsed, field.name)) and not _parses(_lenient_class(descriptor, field.name), data):
                return field.name
        elif not _is_utf8(getattr(parsed, field.name)):
            return field.name
    return ""


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _parses(cls: type[Message], data: bytes) -> bool:
    try:
        cls.FromString(data)
    except DecodeError:
        return False
    return True


@functools.cache
def _lenient_class(descriptor: Any, text_field: str) -> type[Message]:
    """A message class with `descriptor`'s field numbers and wire types in which every string field except
    `text_field` is bytes (no UTF-8 check), nested messages are opaque bytes and enums plain int32: it parses
    whatever `descriptor` parses, and also what fails only because of a string that is not UTF-8."""
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    del proto.nested_type[:], proto.enum_type[:]
    for f in proto.field:
        if f.type == f.TYPE_MESSAGE or (f.type == f.TYPE_STRING and f.name != text_field):
            f.type = f.TYPE_BYTES
        elif f.type == f.TYPE_ENUM:
            f.type = f.TYPE_INT32
        f.ClearField("type_name")
    package = "pyscore_lenient"
    file = descriptor_pb2.FileDescriptorProto(name=f"{package}/{descriptor.full_name}/{text_field}.proto",
                                              package=package, syntax="proto3", message_type=[proto])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{proto.name}"))
