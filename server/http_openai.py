"""OpenAI's `POST /v1/completions` and `POST /v1/chat/completions` over the batcher's generations, so that the `openai`
client (and vLLM's or SGLang's users of it) work unchanged: max_tokens, temperature, top_p, stop, vLLM's
stop_token_ids, seed, logprobs / top_logprobs, n, a list of prompts, `stream: true` as server-sent events ending
`data: [DONE]` (with `stream_options.include_usage`, a last chunk carrying usage; with `continuous_usage_stats` too,
vLLM's usage so far in every chunk), and usage with cached tokens. vLLM's own test cases are the yardstick
(tests/server/test_http_vllm.py; docs/http.md lists each choice).

A completion is one GenerateRequest per prompt and sample: a list of prompts (texts or token-id lists) and n samples
of each give len(prompts) x n choices, choice `index` = prompt * n + sample (OpenAI's and vLLM's order), at most
MAX_CHOICES a request; all run at once through the batcher and stream interleaved as their tokens come. Sample j of
a seeded request draws with seed + j, so the n samples differ and each is the single-sample request with that seed,
bit for bit (vLLM's parallel sampling derives its samples' seeds the same way). Usage counts each prompt once (its
first sample's prompt and cached tokens), every sample's computed and completion tokens (the end-of-sequence or
`stop_token_ids` token that ended a choice counted, as vLLM counts it, though it is not in the text), and the
longest queue wait and compute time. That token is listed last in the choice's logprobs, as vLLM lists it, and each
choice says vLLM's `stop_reason` (the stop string or stop token id that ended it; null for the tokenizer's
end-of-sequence token and a length finish). A completion's top_logprobs hold the chosen token beside its `logprobs`
alternatives (OpenAI's and vLLM's k + 1); a stream's text offsets continue across its chunks. `echo` puts the prompt
in front of each choice's text (a token-id prompt decoded on the engine thread) and, with `logprobs`, the prompt's
tokens in front of its logprobs (the first with a null logprob: vLLM's prompt logprobs, what lm-evaluation-harness
scores continuations with); `max_tokens` 0 with `echo` returns the prompt alone. vLLM's `prompt_logprobs` extension
adds each choice's `prompt_logprobs` in vLLM's shape (null, then per token {id: {logprob, rank, decoded_token}} for
the token and its alternatives; the token's rank null when it is not among them; null when not asked); a chat has
the same list at the top level of its answer (not with a stream, as vLLM refuses). A chat's messages are rendered
with the model's chat template on the engine thread into prompt token ids, exactly as a gRPC Generate with
apply_chat_template renders its one user message (`chat_template_kwargs` reach the template); a chat stream's last
delta carries its finish_reason (vLLM's shape). vLLM's /tokenize is here too: a prompt, or a chat's messages under
the template, to ids, with the vocabulary's pieces as `token_strs` when asked. OpenAI's defaults hold where they
differ from the proto's: temperature 1, completions 16 tokens, chats up to the context. Sampling floats go through
float32, as the proto's `float` does, so the same question asked over gRPC gets the same tokens. Fields OpenAI or
vLLM have and pyscore cannot honour (best_of other than n, suffix, penalties, logit_bias, tools, a JSON
response_format, use_beam_search, stream_options without a stream, and vLLM's ignore_eos, min_tokens,
include_stop_str_in_output, skip_special_tokens and repetition_penalty away from their defaults) are refused naming
the field. A stream's status is settled by its first token: anything the request gets wrong is an HTTP error before
the stream starts; a failure after that is a last `data:` event carrying the error object."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pyscore.errors import InvalidArgument
from pyscore.types import MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, GenerateRequest, GenerateResult, TokenLogprob, Usage

from .batcher import Batcher
from .engine_like import EngineLike
from .gate import Gate
from .http_call import JSON, Call, described, error_body, fp32
from .http_schema import ChatCompletionBody, ChatMessage, CompletionBody, SamplingBody, TokenizeBody, TokenizeChatBody
from .http_score import usage_json
from .scheduler import GenerationDelta

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
COMPLETION_FIELDS = {"prompt_token_ids": "prompt", "top_logprobs": "logprobs"}
CHAT_FIELDS = {"prompt": "messages", "prompt_token_ids": "messages", "apply_chat_template": "messages"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
# Choices (prompts x n) per request: each is a queued job, then a running sequence holding KV pages until it ends;
# a request may ask for as many as the engine runs at once by default (--max-running-generations 64), no more.
MAX_CHOICES = 64


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


# vLLM's sampling extras not served, at the value that asks for nothing: SamplingBody's defaults
VLLM_DEFAULTS: dict[str, object] = {name: SamplingBody.model_fields[name].default for name in (
    "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "repetition_penalty")}


def refuse_unsupported(body: SamplingBody, prompts: int = 1) -> None:
    if body.n < 1:
        raise InvalidArgument("n", f"must be at least 1, got {body.n}")
    if prompts * body.n > MAX_CHOICES:
        raise InvalidArgument("n" if body.n > 1 else "prompt", f"{prompts} prompt(s) x n={body.n} would be "
                              f"{prompts * body.n} choices; at most {MAX_CHOICES} per request")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise InvalidArgument(name, "is not supported: leave it at 0")
    if body.logit_bias:
        raise InvalidArgument("logit_bias", "is not supported")
    if body.use_beam_search:
        raise InvalidArgument("use_beam_search", "beam search is not served (sampling or greedy only)")
    for name, default in VLLM_DEFAULTS.items():
        if getattr(body, name) not in (default, None):
            raise InvalidArgument(name, f"is not supported: leave it at vLLM's default {json.dumps(default)}")
    if body.stream_options is not None and body.stream_options.model_fields_set and not body.stream:
        raise InvalidArgument("stream_options", "can only be given with stream: true (as vLLM refuses it)")
    count_stop_token_ids(body.stop_token_ids)


def count_stop_token_ids(ids: list[int] | None, field: str = "stop_token_ids") -> None:
    """A request's stop token ids (vLLM's and SGLang's field), counted at the door: every choice of the request
    gets its own copy, so an unbounded list would be copied up to MAX_CHOICES times before the engine saw it."""
    if ids and len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(field, f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")


def usage_options(body: SamplingBody) -> tuple[bool, bool]:
    """(a last usage chunk, usage in every chunk): vLLM's continuous_usage_stats counts only with include_usage."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's per-chunk usage (continuous_usage_stats): the choice's prompt and its tokens so far."""
    return {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def checked_prompt_logprobs(value: int | None) -> int | None:
    """vLLM's prompt_logprobs, bounded as the proto's (its -1, the whole vocabulary per token, is not served)."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def completion_tokens(token_ids: list[int], final: GenerateResult | None) -> int:
    """Tokens a choice generated as vLLM counts them: the end-of-sequence or stop token that ended it counts
    (vLLM's token_ids hold it), though, as over gRPC, it is not in the text."""
    return len(token_ids) + (final is not None and final.stop_token is not None)


def stop_reason(final: GenerateResult | None, eos_id: int | None) -> str | int | None:
    """vLLM's CompletionOutput.stop_reason: the stop string that ended the choice, or the id of the token that did
    where vLLM stops on it as a stop token: a stop_token_ids entry, or an end-of-sequence id other than the
    tokenizer's own `eos_id` (vLLM's stop tokens from the model's config). None for the tokenizer's
    end-of-sequence token, a length finish, and before the choice has finished."""
    stopped_by = None if final is None else final.stopped_by
    return None if stopped_by == eos_id else stopped_by  # a stop string is never an id


def with_stop_token(logprobs: list[TokenLogprob], final: GenerateResult | None) -> list[TokenLogprob]:
    """A choice's (or its last chunk's) logprob entries as vLLM lists them: the end-of-sequence or stop token
    that ended it last, its text the tokenizer's for the id alone (`<|im_end|>`: vLLM decodes a logprob's token
    without skipping special tokens)."""
    stop = final.stop_token if final is not None else None
    return logprobs if stop is None else [*logprobs, stop]


def tokenizer_eos(engine: EngineLike) -> int | None:
    """The tokenizer's own end-of-sequence id: the one vLLM's stop_reason reports as None."""
    return getattr(engine.traits.tokenizer, "eos_token_id", None)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """A peer's `stop` (one string, a list, or none) as GenerateRequest's list."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def sampling(body: SamplingBody, max_tokens: int, sample: int = 0) -> dict[str, Any]:
    """GenerateRequest fields from OpenAI's sampling fields (OpenAI's defaults; floats as float32) for sample
    `sample` of n (a seeded request's sample j draws with seed + j)."""
    stop = stop_strings(body.stop)
    return dict(max_tokens=max_tokens, temperature=fp32([1.0 if body.temperature is None else body.temperature])[0],
                top_p=fp32([1.0 if body.top_p is None else body.top_p])[0],
                top_k=0 if body.top_k in (None, -1) else body.top_k,
                seed=None if body.seed is None else body.seed + sample, stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                bypass_prefix_cache=body.bypass_prefix_cache, prefix_cache_salt=body.salt())


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completion request: one text, one token-id list, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidArgument("prompt", "must not be empty")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


async def echo_texts(batcher: Batcher, engine: EngineLike, prompts: list[str | list[int]]) -> list[str]:
    """What echo puts in front of each prompt's choices: a text prompt as given, a token-id prompt decoded (on the
    engine thread, all in one call: decoding grows with the input)."""
    ids = [p for p in prompts if isinstance(p, list)]
    decoded = iter(await batcher.call(lambda: [engine.decode(p) for p in ids]) if ids else [])
    return [p if isinstance(p, str) else next(decoded) for p in prompts]


def merged_usage(results: list[GenerateResult], n: int) -> Usage:
    """One usage for a request's choices (results in choice order, n samples a prompt): each prompt's prompt and
    cached tokens once (its first sample's), every choice's computed tokens, the longest queue wait and compute."""
    firsts = results[::n]
    return Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in firsts),
                 computed_tokens=sum(r.usage.computed_tokens for r in results),
                 cached_tokens=sum(r.usage.cached_tokens for r in firsts),
                 queue_s=max(r.usage.queue_s for r in results), compute_s=max(r.usage.compute_s for r in results))


async def final_result(deltas: AsyncIterator[GenerationDelta]) -> GenerateResult:
    async for delta in deltas:
        if delta.final is not None:
            return delta.final
    raise RuntimeError("generation ended without a result")


async def close_all(tasks: list[asyncio.Future[Any]], streams: list[AsyncIterator[GenerationDelta]]) -> None:
    """Cancels what still waits on a stream, then closes every stream (its sequence is freed)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for deltas in streams:
        await deltas.aclose()  # type: ignore[attr-defined]


async def final_results(streams: list[AsyncIterator[GenerationDelta]]) -> list[GenerateResult]:
    """Every choice's result, in choice order; the first failure fails the request and frees the others."""
    tasks = [asyncio.ensure_future(final_result(deltas)) for deltas in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await close_all(tasks, streams)


def vllm_prompt_logprobs(entries: list[TokenLogprob], k: int) -> list[dict[str, Any] | None]:
    """vLLM's choices[].prompt_logprobs: null for the first token, then {token id: {logprob, rank, decoded_token}}
    for the token (rank null unless it is among the k alternatives) and its k alternatives (ranks 1..k)."""
    out: list[dict[str, Any] | None] = []
    for lp in entries:
        if math.isnan(lp.logprob):
            out.append(None)
            continue
        tops = lp.top[:k]
        rank = next((r + 1 for r, t in enumerate(tops) if t.token_id == lp.token_id), None)
        position = {str(lp.token_id): {"logprob": fp32([lp.logprob])[0], "rank": rank, "decoded_token": lp.token}}
        for r, t in enumerate(tops):
            position.setdefault(str(t.token_id), {"logprob": fp32([t.logprob])[0], "rank": r + 1,
                                                  "decoded_token": t.token})
        out.append(position)
    return out


def top_entry(lp: TokenLogprob, k: int) -> dict[str, float]:
    """OpenAI's (and vLLM's) top_logprobs entry: the chosen token and its k most likely alternatives (k + 1
    entries where the chosen one is not among them; `logprobs: 0` gives the chosen token alone). Keyed by text,
    ids whose texts are equal (byte tokens' "\ufffd") share an entry: the chosen token's, then the likelier
    one's, so an entry's value for the chosen text is always its token_logprob."""
    tops = lp.top[:k]
    values = fp32([lp.logprob, *(t.logprob for t in tops)])
    out: dict[str, float] = {}
    for token, value in zip([lp.token, *(t.token for t in tops)], values, strict=True):
        out.setdefault(token, value)
    return out


def completion_logprobs(logprobs: list[TokenLogprob], prompt: list[TokenLogprob] | None = None,
                        top: int = MAX_TOP_LOGPROBS, start: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completion logprobs, `top` alternatives a token; text offsets count token texts from
    `start` (a stream's chunk continues where the choice's previous chunk ended, so a stream's offsets are the
    whole answer's). With `prompt` (echo), the prompt's entries come first, the first token's logprob and
    alternatives null (nothing precedes it)."""
    entries = [*(prompt or []), *logprobs]
    offsets, at = [], start
    for lp in entries:
        offsets.append(at)
        at += len(lp.token)
    values: list[float | None] = list(fp32([lp.logprob for lp in entries]))
    tops: list[dict[str, float] | None] = [top_entry(lp, top) for lp in entries]
    if prompt:
        values[0] = tops[0] = None
    return {"tokens": [lp.token for lp in entries], "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def text_end(logprobs: dict[str, Any] | None, start: int) -> int:
    """Where the next chunk's text offsets start: past this chunk's tokens."""
    return start + sum(len(t) for t in logprobs["tokens"]) if logprobs else start


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


class OpenAIEndpoints:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def completions(self, call: Call, body: CompletionBody) -> Response:
        prompts = completion_prompts(body.prompt)
        refuse_unsupported(body, len(prompts))  # bounds the list before anything walks it
        for i, p in enumerate(prompts):
            if not p and len(prompts) > 1:
                raise InvalidArgument(f"prompt[{i}]", "must not be empty")
        for name, unsupported in (("best_of", body.best_of not in (None, body.n)), ("suffix", body.suffix)):
            if unsupported:
                raise InvalidArgument(name, "is not supported")
        max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise InvalidArgument("max_tokens", "must be > 0 (0 only with echo: the prompt alone)")
        batcher, info = self.gate.ready(body.model)
        self.gate.check_ids("prompt", sum(len(p) for p in prompts if isinstance(p, list)))
        n, logprobs = body.n, body.logprobs is not None
        checked_prompt_logprobs(body.prompt_logprobs)
        # echo with logprobs (or alone, with max_tokens 0), or vLLM's prompt_logprobs, read the prompt's logprobs
        asked = [k for k in ((body.logprobs or 0) if body.echo and (logprobs or max_tokens == 0) else None,
                             body.prompt_logprobs) if k is not None]
        prompt_logprobs = max(asked) if asked else None
        requests = [GenerateRequest(prompt=p if isinstance(p, str) else None,
                                    prompt_token_ids=p if isinstance(p, list) else None,
                                    top_logprobs=body.logprobs or 0, prompt_logprobs=prompt_logprobs,
                                    **sampling(body, max_tokens, j))
                    for p in prompts for j in range(n)]
        echoes = await echo_texts(batcher, self.gate.engine, prompts) if body.echo else []
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        eos_id = tokenizer_eos(self.gate.engine)

        def choice(k: int, text: str, lps: list[TokenLogprob], final: GenerateResult | None, first: bool,
                   prompt_lps: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any]:
            """Choice k's entry (`final`: its result, in the whole answer or a stream's last chunk); its `first`
            (the whole answer, or a stream's first chunk) carries the echo; its text offsets start at `offset`.
            Every entry has vLLM's stop_reason (null until the finish)."""
            echo = body.echo and first
            out = {"index": k, "text": echoes[k // n] + text if echo else text,
                   "logprobs": completion_logprobs(with_stop_token(lps, final), prompt_lps if echo else None,
                                                   body.logprobs or 0, offset) if logprobs else None,
                   "finish_reason": FINISH.get(final.finish_reason) if final else None,
                   "stop_reason": stop_reason(final, eos_id)}
            if body.prompt_logprobs is not None and first:
                out["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps or [], body.prompt_logprobs)
            return out

        def chunk(choices: list[dict[str, Any]], usage: Usage | None = None, generated: int = 0) -> dict[str, Any]:
            out = {"id": rid, "object": "text_completion", "created": created, "model": info.name, "choices": choices}
            return out | ({"usage": usage_json(usage, generated)} if usage is not None else {})

        include_usage, continuous = usage_options(body)
        lengths = await prompt_lengths(batcher, self.gate.engine, prompts) if body.stream and continuous else []
        streams = [batcher.generate(r) for r in requests]
        if body.stream:
            started: set[int] = set()
            offsets, counts = [0] * len(requests), [0] * len(requests)  # choice k's next text_offset, its tokens

            def chunks(k: int, d: GenerationDelta) -> list[dict[str, Any]]:
                first = k not in started
                started.add(k)
                out = choice(k, d.text, d.logprobs, d.final, first, d.prompt_logprobs, offsets[k])
                offsets[k] = text_end(out["logprobs"], offsets[k])
                counts[k] += completion_tokens(d.token_ids, d.final)
                return [chunk([out]) | (running_usage(lengths[k // n], counts[k]) if continuous else {})]

            return await stream(call, streams, n, COMPLETION_FIELDS, chunks,
                                lambda rs, usage: [chunk([], usage, generated(rs))] if include_usage else [])
        results = await final_results(streams)
        call.usage = usage = merged_usage(results, n)
        # vLLM's choices always carry prompt_logprobs (null unless asked): its clients read the attribute
        return JSON(chunk([{"prompt_logprobs": None} | choice(k, r.text, r.logprobs, r, True, r.prompt_logprobs)
                           for k, r in enumerate(results)], usage, generated(results)))

    async def chat(self, call: Call, body: ChatCompletionBody) -> Response:
        refuse_unsupported(body)
        if body.tools:
            raise InvalidArgument("tools", "tool calling is not supported")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")
        if body.top_logprobs and not body.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        k_prompt = checked_prompt_logprobs(body.prompt_logprobs)
        if body.stream and k_prompt:  # vLLM's rule: a stream has nowhere to carry them
            raise InvalidArgument("prompt_logprobs", "are not available with stream: true (as in vLLM)")
        batcher, info = self.gate.ready(body.model)
        messages = [chat_message(m) for m in body.messages]
        prompt = await batcher.call(self.gate.engine.render_chat, messages, dict(body.chat_template_kwargs or {}))
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = info.max_context - len(prompt) if asked is None else asked  # OpenAI: up to the context
        # the samples share the prompt: its logprobs are read once, by the first (the response has one list)
        requests = [GenerateRequest(prompt_token_ids=prompt, top_logprobs=body.top_logprobs or 0,
                                    prompt_logprobs=k_prompt if j == 0 and not body.stream else None,
                                    **sampling(body, max_tokens, j)) for j in range(body.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage, continuous = usage_options(body)
        counts = [0] * body.n
        eos_id = tokenizer_eos(self.gate.engine)

        def chunk(choices: list[dict[str, Any]], usage: Usage | None = None, generated: int = 0,
                  obj: str = "chat.completion.chunk") -> dict[str, Any]:
            out = {"id": rid, "object": obj, "created": created, "model": info.name, "choices": choices}
            return out | ({"usage": usage_json(usage, generated)} if usage is not None else {})

        def with_usage(out: dict[str, Any], k: int) -> dict[str, Any]:
            return out | (running_usage(len(prompt), counts[k]) if continuous else {})

        def delta_chunks(k: int, d: GenerationDelta) -> list[dict[str, Any]]:
            """vLLM's shape: the last delta's text and the finish_reason in one chunk (its text "" where an
            end-of-sequence token ended the choice), with the stop_reason (that chunk alone has the key)."""
            lps = chat_logprobs(with_stop_token(d.logprobs, d.final)) if body.logprobs else None
            counts[k] += completion_tokens(d.token_ids, d.final)
            out = {"index": k, "delta": {"content": d.text}, "logprobs": lps, "finish_reason": None}
            if d.final is not None:
                out |= {"finish_reason": FINISH[d.final.finish_reason], "stop_reason": stop_reason(d.final, eos_id)}
            return [with_usage(chunk([out]), k)]

        streams = [batcher.generate(r) for r in requests]
        if body.stream:
            roles = [with_usage(chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}]), k) for k in range(body.n)]
            return await stream(call, streams, body.n, CHAT_FIELDS, delta_chunks,
                                lambda rs, usage: [chunk([], usage, generated(rs))] if include_usage else [], roles)
        results = await final_results(streams)
        call.usage = usage = merged_usage(results, body.n)
        answer = chunk([{"index": k, "message": {"role": "assistant", "content": r.text},
                         "logprobs": chat_logprobs(with_stop_token(r.logprobs, r)) if body.logprobs else None,
                         "finish_reason": FINISH[r.finish_reason], "stop_reason": stop_reason(r, eos_id)}
                        for k, r in enumerate(results)],
                       usage, generated(results), obj="chat.completion")
        # vLLM's: top level (null unless asked), one list for the prompt all the choices share
        answer["prompt_logprobs"] = (None if k_prompt is None else
                                     vllm_prompt_logprobs(results[0].prompt_logprobs or [], k_prompt))
        return JSON(answer)

    async def tokenize(self, call: Call, body: TokenizeBody | TokenizeChatBody) -> Response:
        """vLLM's /tokenize: a prompt's ids, or a chat's under the model's template; `token_strs` (the
        vocabulary's pieces, convert_ids_to_tokens) when asked, null otherwise, as vLLM answers."""
        batcher, info = self.gate.ready(body.model)
        engine = self.gate.engine
        if isinstance(body, TokenizeChatBody):
            messages, kwargs = chat_tokenize_args(body)

            def ids() -> list[int]:
                return engine.render_chat(messages, kwargs, add_generation_prompt=body.add_generation_prompt,
                                          add_special_tokens=body.add_special_tokens)
        else:
            def ids() -> list[int]:
                return engine.encode([body.prompt], body.add_special_tokens)[0]

        def tokenized() -> tuple[list[int], list[str] | None]:  # one trip to the engine thread
            tokens = ids()
            return tokens, engine.token_pieces(tokens) if body.return_token_strs else None

        tokens, pieces = await batcher.call(tokenized)
        return JSON({"count": len(tokens), "max_model_len": info.max_context, "tokens": tokens, "token_strs": pieces})


def tokenize_schema(data: Any) -> type[TokenizeBody] | type[TokenizeChatBody]:
    """vLLM's /tokenize takes a prompt or a chat (its TokenizeCompletionRequest | TokenizeChatRequest)."""
    chat = isinstance(data, dict) and "messages" in data and "prompt" not in data
    return TokenizeChatBody if chat else TokenizeBody


def chat_tokenize_args(body: TokenizeChatBody) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template kwargs of a /tokenize chat; what pyscore does not serve is refused by name."""
    if body.tools:
        raise InvalidArgument("tools", "tool calling is not supported")
    if body.chat_template is not None:
        raise InvalidArgument("chat_template", "is not supported: the model's own chat template is used")
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidArgument("continue_final_message", "cannot be true with add_generation_prompt (as in vLLM): "
                              "set add_generation_prompt to false")
    kwargs = dict(body.chat_template_kwargs or {})
    if body.continue_final_message:
        kwargs["continue_final_message"] = True
    return [chat_message(m) for m in body.messages], kwargs


async def prompt_lengths(batcher: Batcher, engine: EngineLike, prompts: list[str | list[int]]) -> list[int]:
    """Each prompt's token count before it runs (what continuous usage reports from the first chunk): a text
    prompt tokenized as its generation tokenizes it, all in one engine-thread call."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await batcher.call(engine.encode, texts, True) if texts else [])
    return [len(next(encoded)) if isinstance(p, str) else len(p) for p in prompts]


def generated(results: list[GenerateResult]) -> int:
    return sum(completion_tokens(r.token_ids, r) for r in results)


async def stream(call: Call, streams: list[AsyncIterator[GenerationDelta]], n: int, renames: dict[str, str],
                 chunks: Callable[[int, GenerationDelta], list[dict[str, Any]]],
                 ending: Callable[[list[GenerateResult], Usage], list[dict[str, Any]]],
                 opening: list[dict[str, Any]] | None = None) -> Response:
    """Waits for every choice's first delta (so a bad request is still an HTTP error), then streams the choices'
    deltas as events as they come (choice k's through chunks(k, delta); deltas that arrive together in choice
    order), the ending events once every choice has finished, and `data: [DONE]`."""
    firsts = [asyncio.ensure_future(anext(deltas)) for deltas in streams]
    try:
        ready = list(enumerate(await asyncio.gather(*firsts)))
    except BaseException:
        await close_all(firsts, streams)
        raise

    async def events() -> AsyncIterator[str]:
        status = "OK"
        results: list[GenerateResult | None] = [None] * len(streams)
        waiting: dict[asyncio.Future[GenerationDelta | None], int] = {}
        try:
            for data in opening or []:
                yield event(data)
            batch: list[tuple[int, GenerationDelta | None]] = list(ready)
            while True:
                for k, delta in batch:
                    if delta is None:
                        raise RuntimeError("generation ended without a result")
                    for data in chunks(k, delta):
                        yield event(data)
                    if delta.final is not None:
                        results[k] = delta.final
                    else:
                        waiting[asyncio.ensure_future(anext(streams[k], None))] = k
                if not waiting:
                    break
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                batch = sorted((waiting.pop(task), task.result()) for task in done)
            finished = [r for r in results if r is not None]
            call.usage = usage = merged_usage(finished, n)
            for data in ending(finished, usage):
                yield event(data)
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        except Exception as e:
            status, message, param, http_status = described(e, renames)
            yield event(error_body(status, message, param, http_status))
        finally:
            await close_all(list(waiting), streams)
            call.finish(status, 200)
        yield "data: [DONE]\n\n"

    async def on_close() -> None:  # both idempotent: a no-op after a stream that ran its course
        await close_all([], streams)
        call.finish("CANCELLED", 200)

    return EventStream(events(), on_close)
