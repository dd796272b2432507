"""The linear-attention layer of Qwen3.5 (Gated DeltaNet) over a packed segment table, as two ops (contracts in
csrc/gated_delta_rule/gated_delta_rule.h): `causal_conv1d` (depthwise causal conv + SiLU over the fused q|k|v
projection) and
`gated_delta_rule` (the recurrence, fp32 state per value head). Both walk prefix_item_attention's validated
SegmentTable: a segment without a prefix runs from a zero state and leaves its end state and conv tail; an MIS item
continues from its prefix's, read-only, and never sees another item. `plan_linear_attention` does the table work
once per batch (the decoder makes it beside the attention plan).

Generation passes per-segment states: `*_in` tensors a segment continues from, `*_out` tensors that receive its end
state (the same tensor may be both: decode updates a sequence's cache in place). CPU tensors run the C++ kernels,
CUDA tensors the CUDA kernels, and the fp32 reference runs where no kernel is built."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import causal_conv1d_ref, gated_delta_rule_ref
from pyscore.ops.segments import SegmentTable

MAX_CONV_KERNEL = 8
MAX_KEY_DIM = 256


@dataclass(frozen=True, eq=False)
class LinearAttentionPlan:
    """A validated segment table with, per segment, its state slot: for a segment without a prefix, the slot its end
    state is kept in for the items that continue it (-1: none); for an item, its prefix's slot. On the table's
    device, made once per batch for every linear layer."""

    table: SegmentTable
    state_slot: torch.Tensor  # [S] int32, on the table's device
    num_slots: int

    @property
    def num_tokens(self) -> int:
        return self.table.num_tokens


def plan_linear_attention(table: SegmentTable) -> LinearAttentionPlan:
    """Checks that every item's prefix is itself a row of the (validated) table with no prefix of its own, then
    numbers the prefixes that have items."""
    rows = table.host.tolist()
    lead_of = {(start, length): s for s, (start, length, _, prefix_length) in enumerate(rows) if not prefix_length}
    slot_of_lead: dict[int, int] = {}
    slots = [-1] * len(rows)
    for s, (_, _, prefix_start, prefix_length) in enumerate(rows):
        if not prefix_length:
            continue
        lead = lead_of.get((prefix_start, prefix_length))
        if lead is None:
            raise ValueError(f"segment {s}: its prefix [{prefix_start}, +{prefix_length}) must be a row of the table "
                             "without a prefix of its own (the linear layers continue from that row's state)")
        slots[s] = slot_of_lead.setdefault(lead, len(slot_of_lead))
    for lead, slot in slot_of_lead.items():
        slots[lead] = slot
    state_slot = torch.tensor(slots, dtype=torch.int32).to(table.device.device)
    return LinearAttentionPlan(table=table, state_slot=state_slot, num_slots=len(slot_of_lead))


def _plan_for(segments: torch.Tensor | SegmentTable, plan: LinearAttentionPlan | None, num_tokens: int,
              device: torch.device) -> LinearAttentionPlan:
    """The caller's plan, or a one-shot plan of a raw or validated table (checked against the tensors)."""
    if plan is None:
        table = segments if isinstance(segments, SegmentTable) else SegmentTable.of(segments, num_tokens, device)
        plan = plan_linear_attention(table)
    if plan.num_tokens != num_tokens:
        raise ValueError(f"the segment table is for {plan.num_tokens} tokens, the inputs have {num_tokens}")
    if plan.table.device.device.type != device.type:
        raise ValueError(f"the plan is on {plan.table.device.device}, the inputs on {device}")
    return plan


def _pointers(name: str, tensors: Sequence[torch.Tensor | None] | None, plan: LinearAttentionPlan,
              shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, lead_only: bool) -> torch.Tensor | None:
    """Per-segment state tensors -> an int64 [S] table of their addresses (0 = none) on `device`, after checking
    each (lead_only: the tensor may belong to a segment without a prefix only, as a state an item would read)."""
    if tensors is None:
        return None
    if len(tensors) != plan.table.num_segments:
        raise ValueError(f"{name} must have one entry per segment ({plan.table.num_segments}), got {len(tensors)}")
    addresses = []
    for s, t in enumerate(tensors):
        if t is None:
            addresses.append(0)
            continue
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(f"{name}[{s}] must be a contiguous {dtype} {list(shape)} on {device}, "
                             f"got {t.dtype} {list(t.shape)} on {t.device}")
        if lead_only and int(plan.table.host[s, 3]):
            raise ValueError(f"{name}[{s}]: segment {s} continues its prefix; only a segment without one takes a state")
        addresses.append(t.data_ptr())
    return torch.tensor(addresses, dtype=torch.int64).to(device)


def _snapshots(snaps: Sequence[tuple[int, torch.Tensor] | None] | None, plan: LinearAttentionPlan,
               shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """state_snap -> (int64 [S] addresses, int32 [S] token counts) on `device`, each checked (None, None: none)."""
    if snaps is None:
        return None, None
    rows = plan.table.host.tolist()
    tensors = [None if x is None else x[1] for x in snaps]
    addresses = _pointers("state_snap", tensors, plan, shape, torch.float32, device, lead_only=True)
    counts = []
    for s, x in enumerate(snaps):
        if x is not None and not 1 <= x[0] <= rows[s][1]:
            raise ValueError(f"state_snap[{s}]: {x[0]} tokens is not within segment {s}'s {rows[s][1]}")
        counts.append(0 if x is None else int(x[0]))
    return addresses, torch.tensor(counts, dtype=torch.int32).to(device)


def _from_reference(result: torch.Tensor, ends: list[torch.Tensor], ends_out: Sequence[torch.Tensor | None] | None,
                    out: torch.Tensor | None) -> torch.Tensor:
    """A reference result as the kernels deliver it: the end states copied into the caller's tensors, the result
    into `out` when given."""
    for s, t in enumerate(ends_out or []):
        if t is not None:
            t.copy_(ends[s])
    return result if out is None else out.copy_(result)


def _check_out(out: torch.Tensor | None, like: torch.Tensor, layout: str) -> None:
    if out is not None and (out.shape != like.shape or out.stride(-1) != 1 or out.dtype != like.dtype
                            or out.device != like.device):
        raise ValueError(f"out must be {layout}={tuple(like.shape)} {like.dtype} on {like.device}, contiguous in its "
                         f"last dim, got {out.dtype} {tuple(out.shape)} on {out.device}")


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | SegmentTable,
    plan: LinearAttentionPlan | None = None, *,
    tail_in: Sequence[torch.Tensor | None] | None = None, tail_out: Sequence[torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:
    """x [T, C] (row stride free, last dim contiguous), weight [C, K] contiguous in x's dtype, segments (an int32
    [S, 4] table or a SegmentTable; ignored when the batch's plan is given) -> silu(causal depthwise conv) [T, C]
    in x's dtype. tail_in / tail_out: per segment a contiguous [K - 1, C]
    tensor in x's dtype (or None): the inputs a segment continues after (an item's: those before its prefix, its
    prefix's tail_in), and where its last K - 1 inputs go.
    backend: "auto" | "kernel" | "reference"."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] contiguous in its last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    num_tokens, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [C={channels}, K], got {tuple(weight.shape)}")
    taps = weight.shape[1]
    if not 1 <= taps <= MAX_CONV_KERNEL:
        raise ValueError(f"weight: kernel size must be in [1, {MAX_CONV_KERNEL}], got {taps}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must match x's dtype and device ({x.dtype}, {x.device}), got {weight.dtype}, "
                         f"{weight.device}")
    _check_out(out, x, "[T, C]")
    plan = _plan_for(segments, plan, num_tokens, x.device)
    tail_shape = (taps - 1, channels)
    tails_in = _pointers("tail_in", tail_in, plan, tail_shape, x.dtype, x.device, lead_only=False)
    tails_out = _pointers("tail_out", tail_out, plan, tail_shape, x.dtype, x.device, lead_only=False)
    module = _ext.kernel_for("causal_conv1d", x.device, x.dtype, backend)
    if module is None:
        return _from_reference(*causal_conv1d_ref(x, weight, plan.table.host, tail_in), tail_out, out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    args = conv_args(x, weight, out, plan.table.device, _address(tails_in), _address(tails_out))
    module.causal_conv1d(*args, *((_ext.cuda_stream(x.device),) if x.is_cuda else ()))
    return out


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def conv_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, table: torch.Tensor, tails_in: int,
              tails_out: int) -> tuple:
    """The conv kernel's arguments for checked tensors: the segment table's rows, the addresses of the per-segment
    tail address tables (0: none)."""
    return (x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), table.data_ptr(),
            table.shape[0], x.shape[0], x.shape[1], weight.shape[1], tails_in, tails_out,
            _ext.torch_dtype_name(x.dtype))


def _check_rule_inputs(q, k, v, a, b, a_log, dt_bias) -> None:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    num_tokens, num_k_heads, key_dim = q.shape
    if v.dim() != 3 or v.shape[0] != num_tokens or v.shape[1] % num_k_heads:
        raise ValueError(f"v must be [T={num_tokens}, Hv, Dv] with Hv a multiple of Hk={num_k_heads}, got "
                         f"{tuple(v.shape)}")
    num_v_heads = v.shape[1]
    if not 0 < key_dim <= MAX_KEY_DIM:
        raise ValueError(f"q: key head dim must be in [1, {MAX_KEY_DIM}], got {key_dim}")
    for name, t in (("a", a), ("b", b)):
        if t.shape != (num_tokens, num_v_heads) or t.stride(1) != 1:
            raise ValueError(f"{name} must be [T={num_tokens}, Hv={num_v_heads}] contiguous in its last dim, got "
                             f"{tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), ("a", a), ("b", b)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, "
                             f"{t.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, t in (("a_log", a_log), ("dt_bias", dt_bias)):
        if t.shape != (num_v_heads,) or t.dtype != torch.float32 or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [Hv={num_v_heads}] on {q.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, segments: torch.Tensor | SegmentTable, plan: LinearAttentionPlan | None = None, *,
    state_in: Sequence[torch.Tensor | None] | None = None, state_out: Sequence[torch.Tensor | None] | None = None,
    state_snap: Sequence[tuple[int, torch.Tensor] | None] | None = None,
    scale: float | None = None, out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:
    """q/k [T, Hk, Dk], v [T, Hv, Dv] (token and head strides free), a/b [T, Hv] (the decay and update-rate
    projections), a_log/dt_bias float32 [Hv], segments (as for causal_conv1d) -> o [T, Hv, Dv] in q's dtype. L2
    norms of q and k, the gates and the fp32 recurrence are inside (see the op header,
    csrc/gated_delta_rule/gated_delta_rule.h). state_in / state_out: per segment
    a contiguous float32 [Hv, Dk, Dv] tensor or None. state_snap: per segment None or (n, such a tensor), which
    receives the state after the segment's first n tokens (1 <= n <= its length; a segment without a prefix).
    backend: "auto" | "kernel" | "reference"."""
    _check_rule_inputs(q, k, v, a, b, a_log, dt_bias)
    num_tokens, _, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1], v.shape[2]
    scale = key_dim**-0.5 if scale is None else float(scale)
    _check_out(out, v, "[T, Hv, Dv]")
    plan = _plan_for(segments, plan, num_tokens, q.device)
    state_shape = (num_v_heads, key_dim, value_dim)
    states_in = _pointers("state_in", state_in, plan, state_shape, torch.float32, q.device, lead_only=True)
    states_out = _pointers("state_out", state_out, plan, state_shape, torch.float32, q.device, lead_only=False)
    snaps, snap_at = _snapshots(state_snap, plan, state_shape, q.device)
    module = _ext.kernel_for("gated_delta_rule", q.device, q.dtype, backend)
    if module is None:
        at = None if state_snap is None else [0 if x is None else x[0] for x in state_snap]
        o, ends, mids = gated_delta_rule_ref(q, k, v, a, b, a_log, dt_bias, plan.table.host, state_in, scale, at)
        _from_reference(o, mids, [None if x is None else x[1] for x in state_snap or []], None)
        return _from_reference(o, ends, state_out, out)
    if out is None:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    args = rule_args(q, k, v, a, b, a_log, dt_bias, out, plan.table.device, plan.state_slot, plan.num_slots, scale,
                     (_address(states_in), _address(states_out), _address(snaps), _address(snap_at)))
    module.gated_delta_rule(*args, *((_ext.cuda_stream(q.device),) if q.is_cuda else ()))
    return out


def rule_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              a_log: torch.Tensor, dt_bias: torch.Tensor, out: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
              num_slots: int, scale: float, states: tuple[int, int, int, int]) -> tuple:
    """The rule kernel's arguments for checked tensors; `states`: the addresses of the per-segment address tables
    of states in, out and snapshots, and of the snapshots' token counts (0: none)."""
    return (q.data_ptr(), (q.stride(0), q.stride(1)), k.data_ptr(), (k.stride(0), k.stride(1)), v.data_ptr(),
            (v.stride(0), v.stride(1)), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), a_log.data_ptr(),
            dt_bias.data_ptr(), out.data_ptr(), (out.stride(0), out.stride(1)), table.data_ptr(), table.shape[0],
            q.shape[0], slots.data_ptr(), num_slots, q.shape[1], v.shape[1], q.shape[2], v.shape[2], scale, *states,
            _ext.torch_dtype_name(q.dtype))
