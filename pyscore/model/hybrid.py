"""The sublayers of the hybrid Qwen3.5 family that the Llama-family decoder lacks, on packed tokens:

* gated full attention: q_proj yields per head a query and an output gate, q/k get that norm, only the leading
  `rotary_dim` dims of each head rotate, and the attention output is multiplied by sigmoid(gate) before o_proj;
* the Gated DeltaNet mixer: one fused input projection, the segment-aware causal conv and gated delta rule ops
  (pyscore.ops.gated_delta_rule: MIS items continue from their prefix's state, read-only), then the gated RMSNorm.

Its zero-centred RMSNorm (`x_hat * (1 + w)`) is add_rms_norm with the fp32 weight 1 + w (one rounding). Everything
is computed in the activation dtype where transformers computes in it, so bf16 rounds where it rounds.

`LinearStates` are every linear layer's conv tail and recurrent state at one token of a sequence: what the prefix
cache keeps beside a cached block (as bytes) so that a later pass resumes the sequence there bitwise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyscore.model.config import ModelConfig
from pyscore.model.weights import LayerWeights, LinearAttentionWeights
from pyscore.ops import add_rms_norm, causal_conv1d, gated_delta_rule, linear
from pyscore.ops.gated_delta_rule import LinearAttentionPlan
from pyscore.ops.reference import rotate_half_ref


@dataclass
class LinearStates:
    """Every linear layer's state at one token: conv tails [L_lin, K - 1, C] in the dtype (the last K - 1
    pre-conv inputs) and recurrent states [L_lin, Hv, Dk, Dv] in fp32."""

    conv: torch.Tensor
    state: torch.Tensor

    @classmethod
    def empty(cls, cfg: ModelConfig, num_linear: int, dtype: torch.dtype, device: torch.device) -> LinearStates:
        lin = cfg.linear
        return cls(torch.empty((num_linear, lin.conv_kernel - 1, lin.conv_channels), dtype=dtype, device=device),
                   torch.empty((num_linear, lin.num_v_heads, lin.k_dim, lin.v_dim), device=device))

    @staticmethod
    def nbytes(cfg: ModelConfig, num_linear: int, dtype: torch.dtype) -> int:
        lin = cfg.linear
        conv = num_linear * (lin.conv_kernel - 1) * lin.conv_channels * torch.empty((), dtype=dtype).element_size()
        return conv + num_linear * lin.num_v_heads * lin.k_dim * lin.v_dim * 4

    def to_bytes(self) -> torch.Tensor:
        """uint8 [nbytes]: the fp32 states, then the conv tails (so each part starts aligned to its dtype)."""
        return torch.cat([self.state.reshape(-1).view(torch.uint8), self.conv.reshape(-1).view(torch.uint8)])

    @classmethod
    def view_of(cls, blob: torch.Tensor, like: LinearStates) -> LinearStates:
        """States whose tensors are views of `blob` (uint8, `to_bytes`' layout) with `like`'s shapes and dtypes."""
        n = like.state.numel() * 4
        return cls(blob[n:].view(like.conv.dtype).view(like.conv.shape),
                   blob[:n].view(torch.float32).view(like.state.shape))

    def load_bytes(self, blob: torch.Tensor) -> LinearStates:
        """Fills this object's tensors from `to_bytes`' layout; returns it."""
        n = self.state.numel() * 4
        self.state.view(-1).view(torch.uint8).copy_(blob[:n])
        self.conv.view(-1).view(torch.uint8).copy_(blob[n:])
        return self


def gated_attention_inputs(h: torch.Tensor, layer: LayerWeights, cfg: ModelConfig, positions: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, backend: str, rows_per_call: int,
                           ) -> tuple[torch.Tensor, ...]:
    """h [T, H] -> q [T, Hq, D], k [T, Hkv, D] (normed, the leading rotary_dim dims rotated), v [T, Hkv, D], and the
    output gate [T, Hq D]. q_proj's rows are per head [query D | gate D]."""
    num_tokens, d, hq, hkv = h.shape[0], cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    proj = linear(h, layer.qkv, backend=backend, rows_per_call=rows_per_call)  # [T, 2 Hq D + 2 Hkv D]
    query_gate = proj[:, : 2 * hq * d].view(num_tokens, hq, 2 * d)
    # per-head norms over rows of D (a copy each: the heads' rows sit irregularly in the projection output)
    q = add_rms_norm(query_gate[..., :d].reshape(-1, d), layer.q_norm, cfg.rms_norm_eps, backend=backend)
    k = add_rms_norm(proj[:, 2 * hq * d : (2 * hq + hkv) * d].reshape(-1, d), layer.k_norm, cfg.rms_norm_eps,
                     backend=backend)
    q, k = q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d)
    v = proj[:, (2 * hq + hkv) * d :].view(num_tokens, hkv, d)
    rotate_leading(q, k, positions, cos, sin, cfg.rotary_dims)
    return q, k, v, query_gate[..., d:].reshape(num_tokens, hq * d)


def rotate_leading(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rotary_dims: int) -> None:
    """In place: the leading rotary_dims dims of each head of q [T, Hq, D] and k [T, Hkv, D] rotated at positions
    (transformers' partial rotary, in the activation dtype)."""
    rd = rotary_dims
    c, s = cos[positions].to(q.dtype)[:, None, :], sin[positions].to(q.dtype)[:, None, :]  # [T, 1, rd]
    for x in (q, k):
        x[..., :rd] = rotate_half_ref(x[..., :rd], c, s)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   backend: str) -> torch.Tensor:
    """o, gate [T, Hv, Dv] -> transformers' Qwen3_5RMSNormGated: (weight * to_dtype(RMSNorm(o))) * silu(gate) in fp32,
    rounded to o's dtype; the first factor is Llama's RMSNorm (add_rms_norm, weight in the dtype) per head."""
    normed = add_rms_norm(o.view(-1, o.shape[-1]), weight, eps, backend=backend).view(o.shape)
    return silu_gate(normed, gate)


def silu_gate(normed: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None,
              wide: torch.Tensor | None = None) -> torch.Tensor:
    """normed * silu(gate) in fp32, rounded once to normed's dtype (gated_rms_norm's tail); into `out`, through the
    fp32 buffer `wide`, when given (a decode program's kept buffers: the same products, the same rounding)."""
    product = torch.mul(normed, F.silu(gate.float()), out=wide)
    return product.to(normed.dtype) if out is None else out.copy_(product)


def sigmoid_gate(attn: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated attention's output [T, Hq D]: attn * sigmoid(gate), in the dtype (into `out` when given)."""
    return torch.mul(attn, torch.sigmoid(gate), out=out)


def linear_attention(
    h: torch.Tensor, w: LinearAttentionWeights, cfg: ModelConfig, plan: LinearAttentionPlan, backend: str,
    rows_per_call: int, *,
    tails_in: Sequence[torch.Tensor | None] | None = None, tails_out: Sequence[torch.Tensor | None] | None = None,
    states_in: Sequence[torch.Tensor | None] | None = None, states_out: Sequence[torch.Tensor | None] | None = None,
    snapshots: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]] = (),
) -> torch.Tensor:
    """The Gated DeltaNet mixer on h [T, H] over the plan's segments -> [T, Hv Dv], before out_proj. The optional
    per-segment conv tails [K - 1, C] and fp32 states [Hv, Dk, Dv] carry sequences across passes (generation's, and
    a prefix cached with its states). snapshots: (segment without a prefix, n, conv tail out, state out): that
    segment's states after its first n tokens, mid-segment (a cached block's end)."""
    shape = cfg.linear
    num_tokens, channels = h.shape[0], shape.conv_channels
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.k_dim, shape.v_dim
    proj = linear(h, w.in_proj, backend=backend, rows_per_call=rows_per_call)  # [T, C + Hv Dv + 2 Hv]: q|k|v, z, b, a
    mixed = causal_conv1d(proj[:, :channels], w.conv, plan.table, plan, tail_in=tails_in, tail_out=tails_out,
                          backend=backend)  # [T, C]
    q = mixed[:, : hk * dk].view(num_tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(num_tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(num_tokens, hv, dv)
    z = proj[:, channels : channels + hv * dv].view(num_tokens, hv, dv)
    b = proj[:, channels + hv * dv : channels + hv * dv + hv]
    a = proj[:, channels + hv * dv + hv :]
    snaps: list[tuple[int, torch.Tensor] | None] | None = None
    if snapshots:
        snaps = [None] * plan.table.num_segments
        for s, n, tail, state in snapshots:
            _conv_tail(proj[:, :channels], plan, s, n, tails_in, tail)
            snaps[s] = (n, state)
    o = gated_delta_rule(q, k, v, a, b, w.a_log, w.dt_bias, plan.table, plan, state_in=states_in,
                         state_out=states_out, state_snap=snaps, backend=backend)  # [T, Hv, Dv]
    return gated_rms_norm(o, z, w.norm, cfg.rms_norm_eps, backend).view(num_tokens, hv * dv)


def _conv_tail(pre_conv: torch.Tensor, plan: LinearAttentionPlan, s: int, n: int,
               tails_in: Sequence[torch.Tensor | None] | None, tail: torch.Tensor) -> None:
    """Segment s's conv tail after its first n tokens into `tail` [K - 1, C]: those tokens' last K - 1 pre-conv
    inputs, after the segment's tail_in (else zeros) where there are fewer than K - 1."""
    history = tail.shape[0]
    start, length, _, prefix_length = plan.table.host[s].tolist()
    if prefix_length or not 0 < n <= length:
        raise ValueError(f"a snapshot is taken inside a segment without a prefix: segment {s}, {n} tokens")
    take = min(n, history)
    if take < history:
        before = tails_in[s] if tails_in is not None else None
        tail[: history - take] = 0 if before is None else before[take:]
    tail[history - take :] = pre_conv[start + n - take : start + n]
