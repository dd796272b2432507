"""The next-token choice: greedy at temperature 0, else sampled after temperature, top-k and top-p; the logprob
entry (with the top alternatives) is always the model's raw distribution's. A NaN / inf row fails its own
sequence (NonFiniteLogits), never its batch-mates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pyscore.types import GenerateRequest, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from pyscore.generation import Generation

Choice = tuple[int, TokenLogprob]


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or inf logits for one sequence (its generation stops; INTERNAL for its caller)."""


def _filtered_logits(logits: torch.Tensor, req: GenerateRequest) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of finite fp32 logits [V]. The row's maximum is
    subtracted before dividing by the temperature, so no temperature > 0 can overflow: every value is <= 0,
    and as T -> 0 the distribution tends to the argmax instead of inf / inf = NaN."""
    logits = (logits - logits.max()) / req.temperature
    if req.top_k:
        kth = torch.topk(logits, min(req.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if req.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= req.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def choose_tokens(logits: torch.Tensor, gens: list[Generation], tokenizer: Any,
                  logz: torch.Tensor | None = None) -> list[Choice | Exception]:
    """logits [B, V] (any dtype) -> per generation its next token and logprob entry, or the exception that
    fails that sequence alone (NonFiniteLogits for a NaN / inf row). logz [B], when the logits came with each
    row's log-sum-exp (`lm_head_logits`' CPU walk): log-softmax is logits - logz, without another pass."""
    logits = logits.float()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    logp = torch.log_softmax(logits, dim=-1) if logz is None else logits - logz[:, None]
    out: list[Choice | Exception] = []
    for row, gen in enumerate(gens):
        if not finite[row]:
            out.append(NonFiniteLogits(f"the model's logits for this sequence are not finite (NaN or inf) at "
                                       f"generated token {len(gen.token_ids) + 1}; its generation stopped"))
            continue
        out.append(_choose(logits[row], logp[row], gen.request, gen.generator, tokenizer))
    return out


def _choose(logits: torch.Tensor, logp: torch.Tensor, req: GenerateRequest, generator: torch.Generator | None,
            tokenizer: Any) -> Choice:
    """One row: the next token (greedy or sampled) and its logprob entry with the top alternatives."""
    if req.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        probs = _filtered_logits(logits, req).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    top = []
    if req.top_logprobs:
        values, ids = torch.topk(logp, req.top_logprobs)
        top = [TopLogprob(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids, strict=True)]
    return token, TokenLogprob(token, tokenizer.decode([token]), float(logp[token]), top)
