"""A decode step on the CPU as a fixed list of kernel calls, bound once per batch size.

Why: a decode step's kernels read every weight once and run near this CPU's DRAM rate; what is left is Python, the op
wrappers checking their tensors, resolving their path and allocating their output on every call, ~8 calls a layer
(its share of a step: bench/results/tiers/probes/decode_step_overhead_zen4.txt). This module is to a CPU step what a
captured CUDA graph is to a GPU one: the checks, the paths and the buffers are fixed once, and a step replays them.

Contract:
- `DecodeProgram.of(decoder)` says whether the step can run this way: a CPU model whose every weight is packed for our
  kernel (linear's, or linear_int8's under quantize="int8") and every op of whose step (the projections, the norms,
  the attention and, per family, the rotary or Qwen3.5's conv and rule) is on our kernel's path in the registry as it
  stands now (tier, dtype, backend and the environment switches). Otherwise the decoder runs its general path.
- A program for B sequences owns the step's buffers and every call's arguments, except what changes per step: the
  block tables of the KV store (the DecodePlan) and, for a hybrid model, the addresses of each sequence's conv tails
  and recurrent states (current and next: they swap at every commit), which `run` binds. The layers of every family
  take the general path's kernels with the same arguments in the same order, and Qwen3.5's few torch ops (its
  partial rotary, the attention gate, the linear layers' output gate) are the general path's own functions or the
  same exact IEEE products into a kept buffer: a step's bits are the general path's
  (tests/model/test_decode_program.py).
- `run` returns the final-normed hidden states [B, H] in a fresh tensor (the buffers are the next step's).
- Nothing is checked per call: the program made its buffers and read the shapes once; what it takes per step (token
  ids, positions, the DecodePlan, the caches Decoder.new_cache made) the decoder has validated (plan_decode)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from pyscore.model import hybrid
from pyscore.ops import _ext
from pyscore.ops.add_rms_norm import kernel_args as norm_args
from pyscore.ops.decode_attention import DecodePlan, step_args
from pyscore.ops.decode_attention import kernel_args as attention_args
from pyscore.ops.gated_delta_rule import conv_args, rule_args
from pyscore.ops.linear import PackedLinear
from pyscore.ops.linear import kernel_args as linear_args
from pyscore.ops.linear_int8 import PackedQuantLinear
from pyscore.ops.linear_int8 import kernel_args as int8_args
from pyscore.ops.rotary import kernel_args as rotary_args
from pyscore.ops.segments import SegmentTable

if TYPE_CHECKING:
    from pyscore.model.decoder import Decoder, KVCache
    from pyscore.model.weights import LayerWeights, LinearAttentionWeights

Call = Callable[[], Any]


class DecodeProgram:
    """The bound calls of a decode step of `batch` sequences; `run` replays them."""

    @staticmethod
    def ops(decoder: Decoder) -> tuple[str, ...]:
        """The ops a step of this decoder calls."""
        plain_attention = decoder.num_attention_layers and not decoder.cfg.attn_output_gate  # gated: torch's rotary
        return ("linear_int8" if decoder.int8_weights else "linear", "add_rms_norm", "decode_attention",
                *(("rotary",) if plain_attention else ()),
                *(("causal_conv1d", "gated_delta_rule") if decoder.num_linear else ()))

    @staticmethod
    def of(decoder: Decoder) -> Any:
        """The CPU module whose kernels can run `decoder`'s decode steps as a program now, else None (see above)."""
        device, dtype = decoder.device, decoder.dtype
        if device.type != "cpu":
            return None
        module = None
        for op in DecodeProgram.ops(decoder):
            module, path, _ = _ext.resolve_path(op, device, dtype, decoder.op_backend)
            if path != "kernel":
                return None
        return module if decoder.packed_weights else None  # decided at load: of() runs every decode step

    def __init__(self, decoder: Decoder, module: Any, batch: int) -> None:
        # What the calls read of the decoder, not the decoder itself: it holds its programs, and a cycle would keep
        # an engine's memory until a full collection.
        self.cfg, self.rotary, self.slot = decoder.cfg, decoder.rotary, decoder.slot
        self.num_linear = decoder.num_linear
        self.embed, self.final_norm = decoder.w.embed, decoder.w.final_norm
        self.batch, self.module = batch, module
        self.dtype = decoder.dtype
        self.eps = float(decoder.cfg.rms_norm_eps)
        self.buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}  # the calls hold addresses
        self.tokens = self._buffer("tokens", batch, dtype=torch.long)
        self.positions = self._buffer("positions", batch, dtype=torch.long)
        self.x = self._buffer("x", batch, decoder.cfg.hidden_size)  # the residual stream
        # The embedding's rows as held (bf16 under fp32 with bf16 weights: gathered here, then widened into x).
        self.rows = self.x if self.embed.dtype == self.dtype else self._buffer(
            "rows", batch, decoder.cfg.hidden_size, dtype=self.embed.dtype)
        self.h = self._buffer("h", batch, decoder.cfg.hidden_size)  # a norm's output, the next projection's input
        # Per step: the KV store's pool and block tables (the plan, in a holder the calls read: a closure over the
        # program itself would make it a cycle); a hybrid model's state addresses ([4, L_lin, B] int64: conv tails
        # in, out, states in, out).
        self.step = SimpleNamespace(plan=None)
        self.states = torch.zeros(4, decoder.num_linear, batch, dtype=torch.long)
        steps = torch.tensor([[b, 1, b, 0] for b in range(batch)], dtype=torch.int32).reshape(-1, 4)
        self.segments = SegmentTable.of(steps, batch, decoder.device)  # one token per sequence (linear layers)
        self.no_slots = torch.full((batch,), -1, dtype=torch.int32)
        self.layers = [self._layer(i, layer) for i, layer in enumerate(decoder.w.layers)]

    def _buffer(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer of the program, one per (name, shape, dtype): layers of one shape share it."""
        key = (name, shape, dtype or self.dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(shape, dtype=key[2])
        return self.buffers[key]

    # ---- bound kernel calls, with their op wrappers' arguments ------------------------------------------------
    def _norm(self, weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> Call:
        """add_rms_norm(x) into out (no delta)."""
        return partial(self.module.add_rms_norm, *norm_args(x, weight, self.eps, None, out))

    def _linear(self, x: torch.Tensor, w: PackedLinear | PackedQuantLinear, out: torch.Tensor,
                residual: bool = False) -> Call:
        """linear(x, w) into out (residual: out += x @ W.T, out being the residual); an int8 weight: linear_int8's."""
        if isinstance(w, PackedQuantLinear):
            return partial(self.module.linear_int8, *int8_args(x, w, out if residual else None, out))
        return partial(self.module.linear, *linear_args(x, w, out if residual else None, out))

    def _attend(self, slot: int, q: torch.Tensor, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Call:
        """decode_attention of layer `slot`: q [B, Hq, D] into out, writing k / v (one pair of strides) first; the
        pool and the block tables are the step's plan's."""
        cfg = self.cfg
        bound = step_args(q, out, k, v, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
        attend, step = self.module.decode_attention, self.step
        return lambda: attend(*attention_args(bound, step.plan, slot))

    # ---- layers ---------------------------------------------------------------------------------------------
    def _layer(self, i: int, layer: LayerWeights) -> list[Call]:
        """Layer i's calls: norm, mixer, o / out_proj (+ the residual), norm, gate_up, down (+ the residual)."""
        slot = self.slot[i]
        if layer.linear is not None:
            (mixer, mixed), out = self._linear_mixer(slot, layer.linear), layer.linear.out
        elif self.cfg.attn_output_gate:
            (mixer, mixed), out = self._gated_attention(slot, layer), layer.o
        else:
            (mixer, mixed), out = self._attention(slot, layer), layer.o
        act = self._buffer("act", self.batch, layer.gate_up.out_features)
        return [self._norm(layer.input_norm, self.x, self.h), *mixer,
                self._linear(mixed, out, self.x, residual=True),
                self._norm(layer.post_norm, self.x, self.h),
                self._linear(self.h, layer.gate_up, act),
                self._linear(act, layer.down, self.x, residual=True)]

    def _attention(self, slot: int, layer: LayerWeights) -> tuple[list[Call], torch.Tensor]:
        """qkv -> rotary (with Qwen3's qk-norm) -> decode_attention: (the calls, their output [B, Hq D])."""
        cfg, b, rot = self.cfg, self.batch, self.rotary
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._buffer("qkv", b, (hq + 2 * hkv) * d)
        q, k, v = qkv.view(b, -1, d).split([hq, hkv, hkv], dim=1)
        attn = self._buffer("attn", b, hq * d).view(b, hq, d)
        rotate = partial(self.module.rotary,
                         *rotary_args(q, k, self.positions, rot.cos, rot.sin, layer.q_norm, layer.k_norm, self.eps))
        return [self._linear(self.h, layer.qkv, qkv), rotate, self._attend(slot, q, attn, k, v)], attn.view(b, -1)

    def _gated_attention(self, slot: int, layer: LayerWeights) -> tuple[list[Call], torch.Tensor]:
        """Qwen3.5's full attention (hybrid.gated_attention_inputs, then the gate) -> (the calls, their output): q and k
        copied out of the projection and normed per head, the leading dims rotated, v copied beside k (the kernel
        takes one pair of strides for both, as decode_attention's wrapper makes them)."""
        cfg, b = self.cfg, self.batch
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        proj = self._buffer("gated_qkv", b, (2 * hq + 2 * hkv) * d)
        query_gate = proj[:, : 2 * hq * d].view(b, hq, 2 * d)
        k_in, v_in = proj[:, 2 * hq * d : (2 * hq + hkv) * d], proj[:, (2 * hq + hkv) * d :]
        q_raw, k_raw = self._buffer("q_raw", b * hq, d), self._buffer("k_raw", b * hkv, d)
        q, k, v = self._buffer("q", b, hq, d), self._buffer("k", b, hkv, d), self._buffer("v", b, hkv, d)
        attn, gated = self._buffer("attn", b, hq * d), self._buffer("gated", b, hq * d)
        rot, rotary_dims, positions = self.rotary, cfg.rotary_dims, self.positions

        def inputs() -> None:
            q_raw.view(b, hq, d).copy_(query_gate[..., :d])
            k_raw.view(b, hkv * d).copy_(k_in)
            v.copy_(v_in.view(b, hkv, d))

        def rotate() -> None:
            hybrid.rotate_leading(q, k, positions, rot.cos, rot.sin, rotary_dims)

        def gate() -> None:
            hybrid.sigmoid_gate(attn, query_gate[..., d:].reshape(b, hq * d), out=gated)

        return [self._linear(self.h, layer.qkv, proj), inputs,
                self._norm(layer.q_norm, q_raw, q.view(-1, d)), self._norm(layer.k_norm, k_raw, k.view(-1, d)),
                rotate, self._attend(slot, q, attn.view(b, hq, d), k, v), gate], gated

    def _linear_mixer(self, slot: int, w: LinearAttentionWeights) -> tuple[list[Call], torch.Tensor]:
        """Qwen3.5's Gated DeltaNet (hybrid.linear_attention at one token per sequence) -> (the calls, their output
        [B, Hv Dv])."""
        lin, b = self.cfg.linear, self.batch
        channels, hk, hv, dk, dv = lin.conv_channels, lin.num_k_heads, lin.num_v_heads, lin.k_dim, lin.v_dim
        proj = self._buffer("in_proj", b, channels + hv * dv + 2 * hv)
        mixed = self._buffer("mixed", b, channels)
        o = self._buffer("o", b, hv, dv)
        normed = self._buffer("normed", b * hv, dv)
        wide = self._buffer("gated_wide", b, hv, dv, dtype=torch.float32)
        gated_out = self._buffer("gated_out", b, hv * dv)
        x, z = proj[:, :channels], proj[:, channels : channels + hv * dv].view(b, hv, dv)
        beta, alpha = proj[:, channels + hv * dv : channels + hv * dv + hv], proj[:, channels + hv * dv + hv :]
        q = mixed[:, : hk * dk].view(b, hk, dk)
        k = mixed[:, hk * dk : 2 * hk * dk].view(b, hk, dk)
        v = mixed[:, 2 * hk * dk :].view(b, hv, dv)
        table = self.segments.device
        states = self.states.data_ptr()
        layer_stride, which_stride = b * 8, self.states.shape[1] * b * 8  # bytes: [4, L_lin, B] int64
        address = [states + which * which_stride + slot * layer_stride for which in range(4)]
        conv = conv_args(x, w.conv, mixed, table, address[0], address[1])
        rule = rule_args(q, k, v, alpha, beta, w.a_log, w.dt_bias, o, table, self.no_slots, 0, dk**-0.5,
                         (address[2], address[3], 0, 0))

        def output_gate() -> None:  # hybrid.gated_rms_norm's tail, into the kept buffers
            hybrid.silu_gate(normed.view(b, hv, dv), z, out=gated_out.view(b, hv, dv), wide=wide)

        return [self._linear(self.h, w.in_proj, proj), partial(self.module.causal_conv1d, *conv),
                partial(self.module.gated_delta_rule, *rule),
                self._norm(w.norm, o.view(-1, dv), normed), output_gate], gated_out

    # ---- a step -----------------------------------------------------------------------------------------------
    def run(self, tokens: torch.Tensor, positions: list[int], plan: DecodePlan, caches: list[KVCache],
            boundary: Callable[[], None]) -> torch.Tensor:
        """One step: tokens [B] at `positions`, keys and values through `plan`, a hybrid model's states in `caches`
        (read from conv / state, written to next_conv / next_state); `boundary()` before each layer (the decoder's
        interrupt point). Returns the final-normed hidden states [B, H]."""
        self.tokens.copy_(tokens)
        self.positions.copy_(torch.tensor(positions, dtype=torch.long))
        self.step.plan = plan
        if self.num_linear:
            self._bind_states(caches)
        torch.index_select(self.embed, 0, self.tokens, out=self.rows)
        if self.rows is not self.x:
            self.x.copy_(self.rows)
        try:
            for calls in self.layers:
                boundary()
                for call in calls:
                    call()
        finally:
            self.step.plan = None  # the step's: never read by a later one
        out = torch.empty_like(self.x)
        self._norm(self.final_norm, self.x, out)()
        return out

    def _bind_states(self, caches: list[KVCache]) -> None:
        """Every linear layer's state addresses for this step: per sequence, its buffer's base plus the layer's
        offset (each a contiguous [L_lin, ...] tensor from Decoder.new_cache)."""
        first = caches[0]
        strides = [t.stride(0) * t.element_size() for t in (first.conv, first.next_conv, first.state,
                                                              first.next_state)]
        bases = torch.tensor([[c.conv.data_ptr(), c.next_conv.data_ptr(), c.state.data_ptr(), c.next_state.data_ptr()]
                              for c in caches], dtype=torch.long)  # [B, 4]
        layers = torch.arange(self.num_linear, dtype=torch.long)
        torch.add(bases.T[:, None, :], layers[None, :, None] * torch.tensor(strides)[:, None, None], out=self.states)
