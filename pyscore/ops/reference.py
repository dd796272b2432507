"""Pure-PyTorch references for the ops: the test oracle, the fallback where no kernel is built, and the
benchmark baseline. Slow and obviously right: attention is a dense masked softmax over the whole stream.
Attention and label scores are computed in fp32; the decoder's elementwise ops (add_rms_norm, rotary, silu_mul)
are computed in their inputs' dtype exactly as transformers does, because that rounding is their contract."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_attention_mask(segments: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Boolean [T, T] mask (True = may attend) for a segment table [S, 4] of (start, length, prefix_start,
    prefix_length): a token sees its segment's prefix and, causally, its own segment."""
    mask = torch.zeros(num_tokens, num_tokens, dtype=torch.bool)
    for start, length, prefix_start, prefix_length in segments.tolist():
        end = start + length
        mask[start:end, start:end] = torch.tril(torch.ones(length, length, dtype=torch.bool))
        if prefix_length:
            mask[start:end, prefix_start : prefix_start + prefix_length] = True
    return mask


def prefix_item_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> out [T, Hq, D] (fp32) with the segment mask; GQA by head groups."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T, D]
    kf = kf.repeat_interleave(group, dim=0)
    vf = vf.repeat_interleave(group, dim=0)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [Hq, T, T]
    mask = segment_attention_mask(segments.cpu(), num_tokens).to(scores.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).contiguous()


def attention_with_lse_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-head partial attention: q [M, D], k/v [N, D], mask [M, N] -> (out [M, D], lse [M]) in fp32.
    Rows that see no key get out 0 and lse -inf, the identity of `merge_state_ref`."""
    scores = (q.float() @ k.float().T) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[:, None].clamp_min(torch.finfo(torch.float32).min)).nan_to_num(0.0)
    return probs @ v.float(), lse


def merge_state_ref(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets: o = (e^{a-m} o_a + e^{b-m} o_b) / (e^{a-m} + e^{b-m})
    with m = max(a, b); lse = m + log(e^{a-m} + e^{b-m}). o: [..., D], lse: [...]."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    denom = w_a + w_b
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = (w_a[..., None] * o_a + w_b[..., None] * o_b) / safe[..., None]
    return out, m + torch.log(denom)


def label_logprobs_ref(
    hidden: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [R, H] and LM head weight [V, H] (or logits [R, V] with weight None), labels [R, K] int (< 0 =
    padding) -> (logprobs [R, K] fp32 under the full-vocabulary softmax, softmax over the row's valid labels)."""
    logits = hidden.float() if weight is None else hidden.float() @ weight.float().T  # [R, V]
    logp = torch.log_softmax(logits, dim=-1)
    valid = labels >= 0
    idx = labels.clamp_min(0).long()
    lab_logp = logp.gather(1, idx).masked_fill(~valid, float("-inf"))
    lab_logits = logits.gather(1, idx).masked_fill(~valid, float("-inf"))
    lab_soft = torch.softmax(lab_logits, dim=-1).nan_to_num(0.0)
    return lab_logp, lab_soft


def add_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] (+= delta in place when given) -> Llama's RMSNorm of x [T, H]: statistics in fp32, the normalized
    value cast to x's dtype, then scaled by the weight in that dtype (bitwise the transformers recipe)."""
    if delta is not None:
        x.add_(delta)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> x * cos + rotate_half(x) * sin (the Llama/Qwen convention, halves not pairs); cos/sin
    [T, 1, D] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
) -> None:
    """In place: q [T, Hq, D] and k [T, Hkv, D] rotated by the fp32 tables cos/sin [P, D] at positions [T], after a
    per-head RMSNorm with q_norm / k_norm [D] when given (Qwen3); tables cast to q's dtype first, as the decoder did."""
    c, s = cos[positions].to(q.dtype)[:, None, :], sin[positions].to(q.dtype)[:, None, :]
    for x, norm in ((q, q_norm), (k, k_norm)):
        if norm is not None:
            x.copy_(add_rms_norm_ref(x, norm, eps))
        x.copy_(rotate_half_ref(x, c, s))


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I] in the input dtype (torch's own rounding)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
