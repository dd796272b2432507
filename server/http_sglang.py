"""SGLang's native `POST /generate` over the batcher's generations, so that clients of SGLang's own API work
unchanged: `text` or `input_ids` (one prompt, or a batch: a list answered by a list), `sampling_params` (one for
every prompt or one per prompt: max_new_tokens (SGLang's default 128; null taken as 128), temperature (default 1),
top_p, top_k (-1 off), stop, stop_token_ids (at most MAX_STOP_TOKEN_IDS), sampling_seed), `return_logprob` with
`logprob_start_len` (-1: the generated tokens' only; s >= 0: the prompt's from token s on, the context before it
from the prefix cache: Generate's prompt_logprobs_start), `top_logprobs_num` and `return_text_in_logprobs`, and
`stream` (one prompt: server-sent events whose text and output_ids are cumulative, as SGLang's, ending
`data: [DONE]`).

An answer is SGLang's: `text`, `output_ids` and `meta_info` (`id`, `finish_reason` {"type": "length", "length": n}
or {"type": "stop", "matched": the stop string, or the id of the end-of-sequence or stop_token_ids token that
ended it, as SGLang's; that token is in neither text nor output_ids, as SGLang trims a matched stop token}),
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `e2e_latency`; with return_logprob `input_token_logprobs` /
`output_token_logprobs` as [logprob, token_id, text or null] (the first prompt token's logprob null) and, with
top_logprobs_num, `input_top_logprobs` / `output_top_logprobs`, one list of such triples per position).
max_new_tokens 0 answers the prompt's logprobs alone. Sampling options pyscore cannot honour (n > 1, ignore_eos,
min_new_tokens, penalties, skip_special_tokens false) are refused naming the field."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from starlette.responses import Response

from pyscore.errors import InvalidArgument
from pyscore.types import GenerateRequest, GenerateResult, TokenLogprob

from .gate import Gate
from .http_call import JSON, Call, fp32
from .http_openai import MAX_CHOICES, count_stop_token_ids, final_results, merged_usage, stop_strings, stream
from .http_schema import SGLangGenerateBody, SGLangSamplingParams
from .scheduler import GenerationDelta

SGLANG_FIELDS = {"prompt": "text", "prompt_token_ids": "input_ids", "max_tokens": "sampling_params.max_new_tokens",
                 "temperature": "sampling_params.temperature", "top_p": "sampling_params.top_p",
                 "top_k": "sampling_params.top_k", "stop": "sampling_params.stop",
                 "seed": "sampling_params.sampling_seed", "stop_token_ids": "sampling_params.stop_token_ids",
                 "top_logprobs": "top_logprobs_num", "prompt_logprobs": "top_logprobs_num",
                 "prompt_logprobs_start": "logprob_start_len"}
DEFAULT_NEW_TOKENS = 128  # SGLang's
# SGLang sampling fields with the value pyscore runs: any other is refused.
FIXED = {"n": 1, "ignore_eos": False, "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
         "repetition_penalty": 1.0, "skip_special_tokens": True}


def sglang_prompts(body: SGLangGenerateBody) -> tuple[list[str | list[int]], bool]:
    """(the prompts, whether the request is a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidArgument("text", "give text or input_ids (not both)")
    given = body.text if body.text is not None else body.input_ids
    assert given is not None
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given], False  # type: ignore[list-item]
    if not given:
        raise InvalidArgument("text" if body.text is not None else "input_ids", "must not be empty")
    if len(given) > MAX_CHOICES:
        raise InvalidArgument("text" if body.text is not None else "input_ids",
                              f"{len(given)} prompts; at most {MAX_CHOICES} a request")
    return list(given), True  # type: ignore[arg-type]


def sampling_for(body: SGLangGenerateBody, count: int) -> list[SGLangSamplingParams]:
    """One sampling_params per prompt, each checked for what pyscore cannot honour."""
    given = body.sampling_params
    params = given if isinstance(given, list) else [given or SGLangSamplingParams()] * count
    if len(params) != count:
        raise InvalidArgument("sampling_params", f"{len(params)} sampling_params for {count} prompts")
    for p in params:
        for name, value in FIXED.items():
            if getattr(p, name) != value:
                raise InvalidArgument(f"sampling_params.{name}", f"is not supported: leave it at {value}")
        count_stop_token_ids(p.stop_token_ids, "sampling_params.stop_token_ids")
    return params


def generate_request(prompt: str | list[int], p: SGLangSamplingParams, body: SGLangGenerateBody) -> GenerateRequest:
    max_tokens = DEFAULT_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens
    prompt_logprobs, start = None, 0
    if body.return_logprob and body.logprob_start_len >= 0:
        prompt_logprobs, start = body.top_logprobs_num, body.logprob_start_len
    elif max_tokens == 0:
        prompt_logprobs = 0  # nothing to generate: the engine still needs a read-out
    return GenerateRequest(prompt=prompt if isinstance(prompt, str) else None,
                           prompt_token_ids=prompt if isinstance(prompt, list) else None, max_tokens=max_tokens,
                           temperature=fp32([p.temperature])[0], top_p=fp32([p.top_p])[0],
                           top_k=0 if p.top_k in (-1, 0) else p.top_k, seed=p.sampling_seed, stop=stop_strings(p.stop),
                           stop_token_ids=list(p.stop_token_ids or []),
                           top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
                           prompt_logprobs=prompt_logprobs, prompt_logprobs_start=start,
                           bypass_prefix_cache=body.bypass_prefix_cache, prefix_cache_salt=body.salt())


def triple(logprob: float, token_id: int, token: str, text: bool) -> list[Any]:
    return [None if math.isnan(logprob) else fp32([logprob])[0], token_id, token if text else None]


class Logprobs:
    """The meta_info logprob lists of one answer (SGLang's [logprob, token_id, text or null] triples)."""

    def __init__(self, body: SGLangGenerateBody) -> None:
        self.on, self.text, self.top = body.return_logprob, body.return_text_in_logprobs, body.top_logprobs_num
        self.asked_prompt = body.logprob_start_len >= 0

    def lists(self, prompt: list[TokenLogprob] | None, out: list[TokenLogprob]) -> dict[str, Any]:
        if not self.on:
            return {}
        prompt = (prompt or []) if self.asked_prompt else []
        lists: dict[str, Any] = {
            "input_token_logprobs": [triple(lp.logprob, lp.token_id, lp.token, self.text) for lp in prompt],
            "output_token_logprobs": [triple(lp.logprob, lp.token_id, lp.token, self.text) for lp in out]}
        if self.top:
            def tops(lp: TokenLogprob) -> list[list[Any]] | None:
                return None if math.isnan(lp.logprob) else [triple(t.logprob, t.token_id, t.token, self.text)
                                                             for t in lp.top]
            lists |= {"input_top_logprobs": [tops(lp) for lp in prompt],
                      "output_top_logprobs": [tops(lp) for lp in out]}
        return lists


def finish_reason(result: GenerateResult | None, generated: int) -> dict[str, Any] | None:
    if result is None:
        return None
    if result.finish_reason == "length":
        return {"type": "length", "length": generated}
    # SGLang's FINISH_MATCHED_STR / FINISH_MATCHED_TOKEN: the stop string, else the token id (its EOS included)
    return {"type": "stop", "matched": result.stopped_by}


class SGLangEndpoints:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def generate(self, call: Call, body: SGLangGenerateBody) -> Response:
        prompts, batch = sglang_prompts(body)
        params = sampling_for(body, len(prompts))
        if body.stream and batch:
            raise InvalidArgument("stream", "streams one prompt a request; send a batch unstreamed")
        if body.top_logprobs_num < 0:
            raise InvalidArgument("top_logprobs_num", f"must be >= 0, got {body.top_logprobs_num}")
        if body.logprob_start_len < -1:
            raise InvalidArgument("logprob_start_len", f"must be -1 or a prompt position, got {body.logprob_start_len}")
        batcher, _ = self.gate.ready(None)
        self.gate.check_ids("input_ids", sum(len(p) for p in prompts if isinstance(p, list)))
        requests = [generate_request(prompt, p, body) for prompt, p in zip(prompts, params, strict=True)]
        rids = body.rid if isinstance(body.rid, list) else [body.rid or uuid.uuid4().hex] * len(prompts)
        if len(rids) != len(prompts):
            raise InvalidArgument("rid", f"{len(rids)} rids for {len(prompts)} prompts")
        logprobs, started = Logprobs(body), time.perf_counter()

        def answer(k: int, text: str, ids: list[int], out: list[TokenLogprob], prompt: list[TokenLogprob] | None,
                   result: GenerateResult | None) -> dict[str, Any]:
            meta = {"id": rids[k], "finish_reason": finish_reason(result, len(ids)),
                    "prompt_tokens": result.usage.prompt_tokens if result else None, "completion_tokens": len(ids),
                    "cached_tokens": result.usage.cached_tokens if result else None,
                    "e2e_latency": time.perf_counter() - started}
            return {"text": text, "output_ids": ids, "meta_info": meta | logprobs.lists(prompt, out)}

        streams = [batcher.generate(r) for r in requests]
        if body.stream:
            text, ids, out, prompt = "", [], [], None  # the answer so far: SGLang streams it cumulatively

            def chunks(k: int, d: GenerationDelta) -> list[dict[str, Any]]:
                nonlocal text, ids, out, prompt
                text, ids, out = text + d.text, ids + d.token_ids, out + d.logprobs
                prompt = d.prompt_logprobs if d.prompt_logprobs is not None else prompt
                return [answer(k, text, ids, out, prompt, d.final)]

            return await stream(call, streams, 1, SGLANG_FIELDS, chunks, lambda results, usage: [])
        results = await final_results(streams)
        call.usage = merged_usage(results, 1)
        answers = [answer(k, r.text, r.token_ids, r.logprobs, r.prompt_logprobs, r) for k, r in enumerate(results)]
        return JSON(answers if batch else answers[0])
