"""Pure-PyTorch references for the ops: the test oracle, the fallback where no kernel is built, and the
benchmark baseline. Slow and obviously right: attention is a dense masked softmax over the whole stream.
Attention, label scores and the gated delta rule are computed in fp32; the decoder's elementwise ops (add_rms_norm,
rotary, silu_mul, the linear layers' causal_conv1d) are computed in their inputs' dtype exactly as transformers does,
because that rounding is their contract; linear computes its fused epilogue in fp32 and rounds once."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_attention_mask(segments: torch.Tensor, num_tokens: int, cached: torch.Tensor | None = None,
                           cached_keys: int = 0, block_tokens: int = 0) -> torch.Tensor:
    """Boolean [T, T + cached_keys] mask (True = may attend) for a segment table [S, 4] of (start, length,
    prefix_start, prefix_length): a token sees its segment's prefix and, causally, its own segment. With cached
    rows [S, 3] (first, count, kind; see pyscore.ops.segments.CachedKeys) the columns after T are the listed
    cached blocks' keys in list order, and a token also sees all of its segment's."""
    mask = torch.zeros(num_tokens, num_tokens + cached_keys, dtype=torch.bool)
    cached_rows = cached.tolist() if cached is not None else [(0, 0, 0)] * segments.shape[0]
    for (start, length, prefix_start, prefix_length), (first, count, _) in zip(segments.tolist(), cached_rows,
                                                                                 strict=True):
        end = start + length
        mask[start:end, start:end] = torch.tril(torch.ones(length, length, dtype=torch.bool))
        if prefix_length:
            mask[start:end, prefix_start : prefix_start + prefix_length] = True
        if count:
            mask[start:end, num_tokens + first * block_tokens : num_tokens + (first + count) * block_tokens] = True
    return mask


def prefix_item_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float | None = None,
    cached: torch.Tensor | None = None, cached_blocks: torch.Tensor | None = None,
    cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> out [T, Hq, D] (fp32) with the segment mask; GQA by head groups. With
    cached rows [S, 3] and blocks [NB] (pyscore.ops.segments.CachedKeys), the listed blocks of the pools
    cache_k / cache_v [N, B, Hkv, D] are more keys, seen by their segments' tokens."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    cached_keys = block_tokens = 0
    if cached is not None:
        assert cached_blocks is not None and cache_k is not None and cache_v is not None
        index = cached_blocks.long().to(cache_k.device)
        block_tokens = cache_k.shape[1]
        k = torch.cat([k, cache_k[index].reshape(-1, *k.shape[1:])])  # [T + NB B, Hkv, D]
        v = torch.cat([v, cache_v[index].reshape(-1, *v.shape[1:])])
        cached_keys = k.shape[0] - num_tokens
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T (+ cached), D]
    kf = kf.repeat_interleave(group, dim=0)
    vf = vf.repeat_interleave(group, dim=0)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [Hq, T, T + cached]
    cached = cached.cpu() if cached is not None else None
    mask = segment_attention_mask(segments.cpu(), num_tokens, cached, cached_keys, block_tokens).to(scores.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).contiguous()


def decode_attention_ref(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float | None = None
) -> torch.Tensor:
    """q [B, Hq, D], keys / values: per sequence [n_b, Hkv, D] -> out [B, Hq, D] (fp32): each sequence's token
    attends to all of its keys; GQA by head groups."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = q.shape[1] // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (kf @ q[b].float()[:, :, None])[..., 0] * scale  # [Hq, n]
        outs.append((scores.softmax(-1)[:, None, :] @ vf)[:, 0])  # [Hq, D]
    return torch.stack(outs)


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


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K], weight [N, K] -> fp32 [M, N]: F.linear in fp32, then silu(gate) * up over the two halves of N when
    gated ([M, N / 2]), then + residual."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else y + residual.float()


def add_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] (+= delta in place when given) -> Llama's RMSNorm of x [T, H]: statistics in fp32, the normalized
    value cast to x's dtype, then scaled by the weight in that dtype (bitwise the transformers recipe). A float32
    weight for a lower-precision x scales the fp32 value before its one rounding (Qwen3.5's `x_hat * (1 + w)`)."""
    if delta is not None:
        x.add_(delta)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:
        return (xf * weight).to(x.dtype)
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


def _sequence_rows(segments: torch.Tensor) -> list[tuple[int, int, int, int]]:
    return [tuple(int(v) for v in row) for row in segments.cpu().tolist()]


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor,
    tail_in: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x [T, C] pre-convolution inputs, weight [C, K], segment table [S, 4] -> (y [T, C] in x's dtype, per segment
    the last K - 1 inputs of its sequence [K - 1, C]). Each segment is convolved over its whole sequence (an item's
    prefix tokens, then its own; before them tail_in[s] or zeros): the depthwise conv in fp32 rounded to x's dtype,
    then SiLU in that dtype, as transformers' conv1d and silu in the model's dtype."""
    channels, taps = weight.shape
    y = torch.zeros_like(x)
    tails = []
    for s, (start, length, prefix_start, prefix_length) in enumerate(_sequence_rows(segments)):
        before = x[prefix_start : prefix_start + prefix_length]
        if tail_in is not None and tail_in[s] is not None:  # before the segment, or an item's prefix
            before = torch.cat([tail_in[s], before])
        seq = torch.cat([x.new_zeros(taps - 1, channels), before, x[start : start + length]])  # [K-1 + P + L, C]
        conv = F.conv1d(seq.float().T[None], weight.float()[:, None, :], groups=channels)[0].T  # [P + L, C]
        y[start : start + length] = F.silu(conv[conv.shape[0] - length :].to(x.dtype))
        tails.append(seq[seq.shape[0] - (taps - 1) :].clone())
    return y, tails


def l2_normalize_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the FLA / transformers l2norm of Gated DeltaNet)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, segments: torch.Tensor, state_in: list[torch.Tensor | None] | None = None,
    scale: float | None = None, snap_at: list[int] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
    """q/k [T, Hk, Dk], v [T, Hv, Dv], a/b [T, Hv], a_log/dt_bias [Hv], segment table [S, 4] -> (o [T, Hv, Dv] in
    q's dtype, per segment its end state [Hv, Dk, Dv] fp32, per segment its state after its first snap_at[s] tokens
    (None where 0 or not asked)). The token-by-token recurrence of Gated DeltaNet in fp32
    (csrc/gated_delta_rule/gated_delta_rule.h): every segment runs its whole sequence from a zero state (or
    state_in[s]); an
    item re-runs its prefix first, from its prefix's state_in. Slow and obviously right."""
    num_v_heads, key_dim = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    scale = key_dim**-0.5 if scale is None else scale
    qf = (l2_normalize_ref(q.float()) * scale).repeat_interleave(group, dim=1)  # [T, Hv, Dk]
    kf = l2_normalize_ref(k.float()).repeat_interleave(group, dim=1)
    vf = v.float()
    decay = torch.exp(-a_log.float().exp() * F.softplus(a.float() + dt_bias.float()))  # [T, Hv]
    beta = b.float().sigmoid()

    def run(start: int, length: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outs = []
        for t in range(start, start + length):
            state = state * decay[t][:, None, None]
            kv = (state * kf[t][:, :, None]).sum(1)  # [Hv, Dv]
            state = state + kf[t][:, :, None] * ((vf[t] - kv) * beta[t][:, None])[:, None, :]
            outs.append((state * qf[t][:, :, None]).sum(1))
        return (torch.stack(outs) if outs else vf.new_zeros(0, *vf.shape[1:])), state

    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    ends: list[torch.Tensor] = []
    mids: list[torch.Tensor | None] = []
    rows = _sequence_rows(segments)
    lead_of = {(r[0], r[1]): s for s, r in enumerate(rows) if not r[3]}
    for s, (start, length, prefix_start, prefix_length) in enumerate(rows):
        state = vf.new_zeros(num_v_heads, key_dim, v.shape[2])
        first = lead_of[(prefix_start, prefix_length)] if prefix_length else s  # an item starts where its prefix did
        if state_in is not None and state_in[first] is not None:
            state = state_in[first].float().clone()
        if prefix_length:
            _, state = run(prefix_start, prefix_length, state)
        at = snap_at[s] if snap_at else 0
        o[start : start + at], state = run(start, at, state)
        mids.append(state if at else None)
        o[start + at : start + length], state = run(start + at, length - at, state)
        ends.append(state)
    return o.to(q.dtype), ends, mids
