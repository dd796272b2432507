"""OpenAI's `POST /v1/completions` and `POST /v1/chat/completions` over the batcher's generations, so that the
`openai` client (and vLLM's or SGLang's users of it) work unchanged: max_tokens, temperature, top_p, stop,
seed, logprobs / top_logprobs, n=1, `stream: true` as server-sent events ending `data: [DONE]` (with
`stream_options.include_usage`, a last chunk carrying usage), and usage with cached tokens.

A completion is one GenerateRequest (text or token-id prompt). A chat's messages are rendered with the model's
chat template on the engine thread into prompt token ids, exactly as a gRPC Generate with apply_chat_template
renders its one user message (`chat_template_kwargs` reach the template). OpenAI's defaults hold where they
differ from the proto's: temperature 1, completions 16 tokens, chats up to the context. Sampling floats go
through float32, as the proto's `float` does, so the same question asked over gRPC gets the same tokens.
Fields OpenAI has and pyscore cannot honour (n > 1, best_of, echo, suffix, penalties, logit_bias, tools, a JSON
response_format) are refused naming the field. A stream's status is settled by its first token: anything the
request gets wrong is an HTTP error before the stream starts; a failure after that is a last `data:` event
carrying the error object."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pyscore.errors import FailedPrecondition, InvalidArgument
from pyscore.types import GenerateRequest, GenerateResult, TokenLogprob, Usage

from .batcher import GenerationDelta
from .http_call import JSON, Call, Gate, described, error_body, fp32
from .http_schema import ChatCompletionBody, ChatMessage, CompletionBody, SamplingBody
from .http_score import usage_json

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
COMPLETION_FIELDS = {"prompt_token_ids": "prompt", "top_logprobs": "logprobs"}
CHAT_FIELDS = {"prompt": "messages", "prompt_token_ids": "messages", "apply_chat_template": "messages"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
RESERVED_TEMPLATE_KWARGS = {"conversation", "tokenize", "add_generation_prompt", "return_dict"}


class EventStream(StreamingResponse):
    """Server-sent events; the call is finished (logged, counted) when the stream ends, not when it starts.
    `on_close` runs however the response ends, even if the client left before the first event was pulled (an
    async generator never started runs no `finally`)."""

    streaming = True

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def event(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def refuse_unsupported(body: SamplingBody) -> None:
    if body.n != 1:
        raise InvalidArgument("n", f"only n=1 is supported, got {body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise InvalidArgument(name, "is not supported: leave it at 0")
    if body.logit_bias:
        raise InvalidArgument("logit_bias", "is not supported")


def sampling(body: SamplingBody, max_tokens: int) -> dict[str, Any]:
    """GenerateRequest fields from OpenAI's sampling fields (OpenAI's defaults; floats as float32)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return dict(max_tokens=max_tokens, temperature=fp32([1.0 if body.temperature is None else body.temperature])[0],
                top_p=fp32([1.0 if body.top_p is None else body.top_p])[0],
                top_k=0 if body.top_k in (None, -1) else body.top_k, seed=body.seed, stop=stop,
                bypass_prefix_cache=body.bypass_prefix_cache, prefix_cache_salt=body.salt())


async def final_result(deltas: AsyncIterator[GenerationDelta]) -> GenerateResult:
    async for delta in deltas:
        if delta.final is not None:
            return delta.final
    raise RuntimeError("generation ended without a result")


def completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's legacy completion logprobs; text offsets count within the completion."""
    offsets, at = [], 0
    for lp in logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": fp32([lp.logprob for lp in logprobs]),
            "top_logprobs": [dict(zip([t.token for t in lp.top], fp32([t.logprob for t in lp.top]), strict=True))
                             for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token, fp32([lp.logprob])[0]),
                         "top_logprobs": [entry(t.token, v) for t, v in zip(lp.top, fp32([t.logprob for t in lp.top]),
                                                                             strict=True)]}
                        for lp in logprobs]}


def chat_message(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it: text parts joined by newlines (as vLLM joins them)."""
    content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
    return {**(m.model_extra or {}), "role": m.role, "content": content or ""}


def render_chat(engine: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int]:
    """The prompt token ids of `messages` under the model's chat template (on the engine thread)."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise FailedPrecondition("messages", "this model's tokenizer has no chat template")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise InvalidArgument("chat_template_kwargs", f"may not set {', '.join(clash)}")
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False,
                                            **kwargs)
    except Exception as e:  # the template's own checks (roles must alternate, ...) are the client's to fix
        raise InvalidArgument("messages", f"the model's chat template refused them: {e}") from None
    return [int(t) for t in ids]


class OpenAIEndpoints:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def completions(self, call: Call, body: CompletionBody) -> Response:
        refuse_unsupported(body)
        for name, unsupported in (("echo", body.echo), ("best_of", body.best_of not in (None, 1)),
                                  ("suffix", body.suffix)):
            if unsupported:
                raise InvalidArgument(name, "is not supported")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument("prompt", f"one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        batcher, info = self.gate.ready(body.model)
        ids = prompt if isinstance(prompt, list) else None
        self.gate.check_ids("prompt", len(ids or []))
        max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        request = GenerateRequest(prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=ids,
                                  top_logprobs=body.logprobs or 0, **sampling(body, max_tokens))
        logprobs = body.logprobs is not None
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(text: str, lps: list[TokenLogprob], finish: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": completion_logprobs(lps) if logprobs else None,
                    "finish_reason": FINISH.get(finish or "")}

        def chunk(choices: list[dict[str, Any]], usage: Usage | None = None, generated: int = 0) -> dict[str, Any]:
            out = {"id": rid, "object": "text_completion", "created": created, "model": info.name, "choices": choices}
            return out | ({"usage": usage_json(usage, generated)} if usage is not None else {})

        deltas = batcher.generate(request)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream(call, deltas, COMPLETION_FIELDS, lambda d: [chunk([choice(
                d.text, d.logprobs, d.final.finish_reason if d.final else None)])],
                lambda r: [chunk([], r.usage, len(r.token_ids))] if include_usage else [])
        result = await final_result(deltas)
        call.usage = result.usage
        return JSON(chunk([choice(result.text, result.logprobs, result.finish_reason)], result.usage,
                          len(result.token_ids)))

    async def chat(self, call: Call, body: ChatCompletionBody) -> Response:
        refuse_unsupported(body)
        if body.tools:
            raise InvalidArgument("tools", "tool calling is not supported")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")
        if body.top_logprobs and not body.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        batcher, info = self.gate.ready(body.model)
        messages = [chat_message(m) for m in body.messages]
        prompt = await batcher.call(render_chat, batcher.engine, messages, dict(body.chat_template_kwargs or {}))
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = info.max_context - len(prompt) if asked is None else asked  # OpenAI: up to the context
        request = GenerateRequest(prompt_token_ids=prompt, top_logprobs=body.top_logprobs or 0,
                                  **sampling(body, max_tokens))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices: list[dict[str, Any]], usage: Usage | None = None, generated: int = 0,
                  obj: str = "chat.completion.chunk") -> dict[str, Any]:
            out = {"id": rid, "object": obj, "created": created, "model": info.name, "choices": choices}
            return out | ({"usage": usage_json(usage, generated)} if usage is not None else {})

        def delta_chunks(d: GenerationDelta) -> list[dict[str, Any]]:
            lps = chat_logprobs(d.logprobs) if body.logprobs else None
            out = [chunk([{"index": 0, "delta": {"content": d.text}, "logprobs": lps, "finish_reason": None}])]
            if d.final is not None:
                out.append(chunk([{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": FINISH[d.final.finish_reason]}]))
            return out

        deltas = batcher.generate(request)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            role = chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}])
            return await stream(call, deltas, CHAT_FIELDS, delta_chunks,
                                lambda r: [chunk([], r.usage, len(r.token_ids))] if include_usage else [], [role])
        result = await final_result(deltas)
        call.usage = result.usage
        message = {"role": "assistant", "content": result.text}
        return JSON(chunk([{"index": 0, "message": message,
                            "logprobs": chat_logprobs(result.logprobs) if body.logprobs else None,
                            "finish_reason": FINISH[result.finish_reason]}],
                          result.usage, len(result.token_ids), obj="chat.completion"))


async def stream(call: Call, deltas: AsyncIterator[GenerationDelta], renames: dict[str, str],
                 chunks: Callable[[GenerationDelta], list[dict[str, Any]]],
                 ending: Callable[[GenerateResult], list[dict[str, Any]]],
                 opening: list[dict[str, Any]] | None = None) -> Response:
    """Waits for the first delta (so a bad request is still an HTTP error), then streams every delta as events,
    the ending events and `data: [DONE]`."""
    try:
        first = await anext(deltas)
    except BaseException:
        await deltas.aclose()  # type: ignore[attr-defined]
        raise

    async def events() -> AsyncIterator[str]:
        status = "OK"
        try:
            for data in opening or []:
                yield event(data)
            delta: GenerationDelta | None = first
            while delta is not None:
                for data in chunks(delta):
                    yield event(data)
                if delta.final is not None:
                    call.usage = delta.final.usage
                    for data in ending(delta.final):
                        yield event(data)
                    break
                delta = await anext(deltas, None)
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        except Exception as e:
            status, message, param, http_status = described(e, renames)
            yield event(error_body(status, message, param, http_status))
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
            call.finish(status, 200)
        yield "data: [DONE]\n\n"

    async def on_close() -> None:  # both idempotent: a no-op after a stream that ran its course
        await deltas.aclose()  # type: ignore[attr-defined]
        call.finish("CANCELLED", 200)

    return EventStream(events(), on_close)
