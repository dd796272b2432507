"""Validation of a GenerateRequest: every field checked at the door, with an InvalidArgument /
FailedPrecondition naming it, before any model work; returns the prompt's token ids. Also a chat's messages
rendered by the model's chat template into prompt token ids (`render_chat`, OpenAI's chat completions). No
torch."""

from __future__ import annotations

import math
from typing import Any

from pyscore.errors import FailedPrecondition, InvalidArgument, quoted

# The caps live in pyscore.types so that the server can check them at the door without importing torch.
from pyscore.types import MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, GenerateRequest

RESERVED_TEMPLATE_KWARGS = {"conversation", "tokenize", "add_generation_prompt", "return_dict"}  # render_chat's own


def validate_generate(req: GenerateRequest, tokenizer: Any, vocab_size: int, max_context: int) -> list[int]:
    """Checks every field and returns the prompt's token ids."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidArgument("prompt", "give prompt or prompt_token_ids, not both")
    if not req.prompt and not req.prompt_token_ids:
        raise InvalidArgument("prompt", "is empty: give prompt or prompt_token_ids")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.prompt_logprobs}")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise InvalidArgument("temperature", f"must be a finite number >= 0, got {req.temperature}")
    if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
        raise InvalidArgument("top_p", f"must be in (0, 1], got {req.top_p}")
    if req.top_k < 0:
        raise InvalidArgument("top_k", f"must be >= 0 (0 = off), got {req.top_k}")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    if any(not s or len(s) > MAX_STOP_LENGTH for s in req.stop):
        raise InvalidArgument("stop", f"stop strings must be 1..{MAX_STOP_LENGTH} characters")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(req.stop_token_ids)}")
    bad_stops = [t for t in req.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stops:  # quoted: an HTTP client's id may be thousands of digits long
        raise InvalidArgument("stop_token_ids", f"token id {quoted(bad_stops[0])} is outside the vocabulary "
                              f"[0, {vocab_size})")
    if req.prompt_token_ids:
        if req.apply_chat_template:
            raise InvalidArgument("apply_chat_template", "applies to a text prompt, not prompt_token_ids")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument("prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        prompt = [int(t) for t in req.prompt_token_ids]
    elif req.apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise FailedPrecondition("apply_chat_template", "this model's tokenizer has no chat template")
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": req.prompt}], tokenize=True,
                                                    add_generation_prompt=True, return_dict=False))
    else:
        prompt = list(tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
    if not 0 <= req.prompt_logprobs_start <= len(prompt):
        raise InvalidArgument("prompt_logprobs_start", f"must be in [0, {len(prompt)}] (the prompt's tokens), got "
                              f"{req.prompt_logprobs_start}")
    if req.max_tokens < 0 or (req.max_tokens == 0 and req.prompt_logprobs is None):
        raise InvalidArgument("max_tokens", f"must be > 0 (or 0 with prompt_logprobs), got {req.max_tokens}")
    if len(prompt) + req.max_tokens > max_context:
        raise InvalidArgument("max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                              f"exceeds the model's context of {max_context}")
    return prompt


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                add_generation_prompt: bool = True, *, add_special_tokens: bool = False) -> list[int]:
    """The prompt token ids of `messages` under the tokenizer's chat template, with `kwargs` for the template;
    with the assistant's turn opened after them unless `add_generation_prompt` is false (a classifier's chat,
    vLLM's default there). add_special_tokens adds the tokenizer's own (BOS) on top of the template's, as vLLM's
    /tokenize may ask; without it the ids are apply_chat_template's own (which tokenizes the rendered text
    without them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise FailedPrecondition("messages", "this model's tokenizer has no chat template")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise InvalidArgument("chat_template_kwargs", f"may not set {', '.join(clash)}")
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=not add_special_tokens,
                                                 add_generation_prompt=add_generation_prompt, return_dict=False,
                                                 **kwargs)
    except Exception as e:  # the template's own checks (roles must alternate, ...) are the client's to fix
        raise InvalidArgument("messages", f"the model's chat template refused them: {e}") from None
    ids = tokenizer(rendered, add_special_tokens=True)["input_ids"] if add_special_tokens else rendered
    return [int(t) for t in ids]
