"""Generation state and sampling: validation of a GenerateRequest, the per-sequence state the engine steps
(KV cache, emitted tokens, stop handling, streamed deltas) and the next-token choice with top-k logprobs.
Reported logprobs are those of the model's raw distribution (before temperature / top-k / top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pyscore.errors import FailedPrecondition, InvalidArgument
from pyscore.model.decoder import KVCache
from pyscore.types import GenerateRequest, GenerateResult, TokenLogprob, TopLogprob, Usage

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


def validate_generate(req: GenerateRequest, tokenizer: Any, vocab_size: int, max_context: int) -> list[int]:
    """Checks every field and returns the prompt's token ids."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidArgument("prompt", "give prompt or prompt_token_ids, not both")
    if not req.prompt and not req.prompt_token_ids:
        raise InvalidArgument("prompt", "is empty: give prompt or prompt_token_ids")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
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
    if req.max_tokens <= 0:
        raise InvalidArgument("max_tokens", f"must be > 0, got {req.max_tokens}")
    if len(prompt) + req.max_tokens > max_context:
        raise InvalidArgument("max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                              f"exceeds the model's context of {max_context}")
    return prompt


@dataclass
class Generation:
    request: GenerateRequest
    prompt: list[int]
    tokenizer: Any
    eos_ids: frozenset[int]
    generator: torch.Generator | None
    cache: KVCache | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None  # set when this sequence failed; its batch-mates go on
    text: str = ""
    _sent_tokens: int = 0
    _sent_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, error: Exception) -> None:
        """Marks the generation finished without a result (its request failed); frees the cache."""
        self.error = error
        self.finish_reason = self.finish_reason or "error"
        self.cache = None

    def append(self, token: int, logprob: TokenLogprob) -> None:
        """Records the sampled token and decides whether generation is over (eos / stop / length)."""
        if token in self.eos_ids:
            self.finish_reason = "eos"
        else:
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            cut = min((i for i in (self.text.find(s) for s in self.request.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.finish_reason = self.text[:cut], "stop"
            elif len(self.token_ids) >= self.request.max_tokens:
                self.finish_reason = "length"
        if self.finished:
            self.cache = None  # free the KV cache as soon as the sequence ends

    def _safe_text_end(self) -> int:
        """How much of the text can be streamed: not an incomplete UTF-8 tail, not a possible stop prefix."""
        if self.finished:
            return len(self.text)
        end = len(self.text)
        while end and self.text[end - 1] == "\ufffd":
            end -= 1
        hold = max((len(s) - 1 for s in self.request.stop), default=0)
        return max(self._sent_chars, end - hold)

    def take_delta(self) -> tuple[list[int], list[TokenLogprob], str]:
        """New tokens, their logprobs and new text since the last call."""
        end = self._safe_text_end()
        delta = (self.token_ids[self._sent_tokens:], self.logprobs[self._sent_tokens:],
                 self.text[self._sent_chars:end])
        self._sent_tokens, self._sent_chars = len(self.token_ids), end
        return delta

    def result(self) -> GenerateResult:
        return GenerateResult(text=self.text, token_ids=list(self.token_ids), logprobs=list(self.logprobs),
                              finish_reason=self.finish_reason or "length",
                              usage=Usage(prompt_tokens=len(self.prompt),
                                          computed_tokens=len(self.prompt) + len(self.token_ids)))


def _filtered_logits(logits: torch.Tensor, req: GenerateRequest) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of fp32 logits [V]."""
    logits = logits / req.temperature
    if req.top_k:
        kth = torch.topk(logits, min(req.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if req.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= req.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def choose_tokens(logits: torch.Tensor, gens: list[Generation], tokenizer: Any) -> list[tuple[int, TokenLogprob]]:
    """logits [B, V] (any dtype) -> per generation the next token and its logprob entry."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for row, gen in enumerate(gens):
        req = gen.request
        if req.temperature == 0:
            token = int(torch.argmax(logits[row]))
        else:
            probs = _filtered_logits(logits[row], req).softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=gen.generator))
        top = []
        if req.top_logprobs:
            values, ids = torch.topk(logp[row], req.top_logprobs)
            top = [TopLogprob(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids, strict=True)]
        out.append((token, TokenLogprob(token, tokenizer.decode([token]), float(logp[row, token]), top)))
    return out
