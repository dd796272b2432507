"""The next-token choice: greedy at temperature 0, else sampled after temperature, top-k and top-p; the logprob
entry (with the top alternatives) is always the model's raw distribution's. A NaN / inf row fails its own
sequence (NonFiniteLogits), never its batch-mates. And the prompt's own tokens' logprob entries
(`prompt_token_logprobs`), from the same distribution at every prompt position."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pyscore.ops.label_logprobs import label_logprobs, lm_head_logits
from pyscore.types import GenerateRequest, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from pyscore.generation import Generation

Choice = tuple[int, TokenLogprob]
# Prompt positions whose logits are held at once: [rows, V] fp32 (a 151,936-token vocabulary: 78 MB).
PROMPT_LOGPROB_ROWS = 128


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
    row's log-sum-exp (`lm_head_logits`' CPU walk): a logprob is logit - logz (fp32), computed for the entries
    reported only, without another pass over the rows."""
    logits = logits.float()
    finite, greedy = _finite_and_argmax(logits)
    if logz is None:
        rows, shift = torch.log_softmax(logits, dim=-1), logits.new_zeros(logits.shape[0])
    else:
        rows, shift = logits, logz
    tokens = [greedy[r] if g.request.temperature == 0 or not finite[r] else _sample(logits[r], g.request, g.generator)
              for r, g in enumerate(gens)]
    chosen = (rows[torch.arange(len(gens)), torch.tensor(tokens)] - shift).tolist()  # each row's token's logprob
    tops = _top_logprobs(rows, shift, [g.request.top_logprobs if ok else 0 for g, ok in zip(gens, finite,
                                                                                            strict=True)])
    out: list[Choice | Exception] = []
    for row, (gen, token) in enumerate(zip(gens, tokens, strict=True)):
        if not finite[row]:
            out.append(NonFiniteLogits(f"the model's logits for this sequence are not finite (NaN or inf) at "
                                       f"generated token {len(gen.token_ids) + 1}; its generation stopped"))
            continue
        top = [TopLogprob(i, tokenizer.decode([i]), v) for i, v in tops.get(row, [])]
        out.append((token, TokenLogprob(token, tokenizer.decode([token]), chosen[row], top)))
    return out


def _finite_and_argmax(logits: torch.Tensor) -> tuple[list[bool], list[int]]:
    """Per row of fp32 logits [B, V]: whether every value is finite, and the first index of its maximum (greedy's
    token). On CPU through numpy's vectorized reductions: torch's max / argmax along the last dimension took
    ~450 us each for 8 rows of a 49,152-token vocabulary on the AMX Xeon, numpy's ~32 (a decode step is ~20 ms)."""
    if logits.device.type == "cpu":
        rows = logits.numpy()
        low, high = rows.min(axis=1), rows.max(axis=1)  # NaN propagates into both; -inf / inf show in one
        return (np.isfinite(low) & np.isfinite(high)).tolist(), rows.argmax(axis=1).tolist()
    low, high = torch.aminmax(logits, dim=-1)
    return (low.isfinite() & high.isfinite()).tolist(), torch.argmax(logits, dim=-1).tolist()


def _sample(logits: torch.Tensor, req: GenerateRequest, generator: torch.Generator | None) -> int:
    """One row's token drawn after temperature, top-k and top-p."""
    return int(torch.multinomial(_filtered_logits(logits, req).softmax(-1), 1, generator=generator))


def _top_logprobs(rows: torch.Tensor, shift: torch.Tensor, ks: list[int]) -> dict[int, list[tuple[int, float]]]:
    """row -> its ks[row] most likely (token, logprob), best first, for the rows with ks[row] > 0: one top-k over
    those rows at their largest k (torch's per-row calls cost ~140 us each at a 49,152-token vocabulary). A
    logprob is row - shift in fp32: rows of log-softmax with shift 0, or of logits with shift logZ (subtracting
    one value keeps a row's order, so its top tokens are its logits')."""
    wanted = [r for r, k in enumerate(ks) if k > 0]
    if not wanted:
        return {}
    index = torch.tensor(wanted)
    values, ids = torch.topk(rows[index], max(ks), dim=-1)
    values = (values - shift[index, None]).tolist()
    ids = ids.tolist()
    return {r: list(zip(ids[j][: ks[r]], values[j][: ks[r]], strict=True)) for j, r in enumerate(wanted)}


def prompt_token_logprobs(hidden: torch.Tensor, prompt: list[int], first: int, top: int, lm_head: torch.Tensor,
                          backend: str, tokenizer: Any) -> list[TokenLogprob]:
    """hidden [r, H]: the final hidden states at prompt positions max(first, 1) - 1 .. (at least up to the one
    before the last) -> one entry per prompt token from `first` on: token i's logprob given tokens < i (read at
    position i - 1, as a generated token's), with its `top` most likely alternatives there; token 0's logprob is
    NaN, with none. Rows of logits are made PROMPT_LOGPROB_ROWS at a time. Raises NonFiniteLogits when a row has a
    NaN or +inf logit (its logZ, or its log-softmax, is then not finite)."""
    out = [TokenLogprob(prompt[0], tokenizer.decode([prompt[0]]), float("nan"))] if first == 0 else []
    offset = max(first, 1) - 1  # the prompt position of hidden's row 0
    for start in range(0, len(prompt) - 1 - offset, PROMPT_LOGPROB_ROWS):
        end = min(len(prompt) - 1 - offset, start + PROMPT_LOGPROB_ROWS)
        targets = prompt[offset + start + 1 : offset + end + 1]
        if top == 0:  # the token's own logprob alone: the streamed label read-out, no row of logits written
            lps, _ = label_logprobs(hidden[start:end], lm_head, torch.tensor(targets)[:, None], backend)
            chosen, shift, ids, values = lps[:, 0], lps.new_zeros(end - start), [], []
        else:
            logits, logz = lm_head_logits(hidden[start:end], lm_head, backend)
            logits = logits.float()
            rows, shift = (logits, logz) if logz is not None else (torch.log_softmax(logits, -1),
                                                                   logits.new_zeros(end - start))
            chosen = rows[torch.arange(end - start), torch.tensor(targets)] - shift
            ids, values = _row_tops(rows, shift, top)
        bad = ~(torch.isfinite(chosen) & torch.isfinite(shift))
        if bool(bad.any()):
            raise NonFiniteLogits(f"the model's logits are not finite (NaN or inf) after prompt token "
                                  f"{offset + start + int(bad.nonzero()[0])}")
        names = tokenizer.batch_decode([[t] for t in targets] + [[i] for row in ids for i in row])
        alternatives = iter(names[len(targets):])
        for j, (token, name) in enumerate(zip(targets, names, strict=False)):
            tops = [TopLogprob(i, next(alternatives), v) for i, v in zip(ids[j], values[j], strict=True)] if top else []
            out.append(TokenLogprob(token, name, float(chosen[j]), tops))
    return out


def _row_tops(rows: torch.Tensor, shift: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Every row's k >= 1 most likely (ids, logprobs), best first: numpy's argmax for k = 1 on the CPU (~4x torch's
    top-k over a 49,152-token row), torch's top-k else."""
    if k == 1 and rows.device.type == "cpu":
        best = torch.from_numpy(rows.numpy().argmax(axis=1))[:, None]
        values = rows.gather(1, best)
    else:
        values, best = torch.topk(rows, k, dim=-1)
    return best.tolist(), (values - shift[:, None]).tolist()
