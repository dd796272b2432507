"""A decode step of an all-attention model on the CPU as a fixed list of kernel calls, bound once per batch size.

Why: a decode step's kernels read every weight once and are near this CPU's DRAM rate; what is left is Python. The op
wrappers check their tensors, resolve their path and allocate their output on every call, ~8 calls a layer: on
SmolLM2 (30 layers) that was 25-29% of a step (bench/results/tiers/decode_step_overhead_zen4.txt). This module is
to a CPU step what a captured CUDA graph is to a GPU one: the checks, the paths and the buffers are fixed once, and
a step only replays the kernel calls.

Contract:
- `DecodeProgram.of(decoder)` says whether the step can run this way: a CPU model whose every layer is attention
  (Llama, Qwen2, Qwen3; not Qwen3.5's gated or linear layers), every weight packed for our kernel, and every op of
  the step (linear, add_rms_norm, rotary, decode_attention) on our kernel's path in the registry as it stands now
  (tier, dtype, backend and the environment switches). Otherwise the decoder runs its general path.
- A program for B sequences owns the step's buffers ([B, H] residual stream and norm output, the qkv projection, the
  attention output, the MLP activation, the positions) and every call's arguments except the step's block tables,
  which `run` binds per step. It calls the same kernels with the same arguments, in the same order, as the op
  wrappers do on the general path: a step's bits are the general path's (tests/model/test_decode_program.py).
- `run` returns the final-normed hidden states [B, H] in a fresh tensor (the buffers are the next step's).
- Nothing is checked per call: the program made the buffers and read the shapes itself, once; the inputs it takes
  per step (token ids, positions, the DecodePlan) come from the decoder, which validated them (plan_decode)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pyscore.ops import _ext
from pyscore.ops.decode_attention import DecodePlan
from pyscore.ops.linear import PackedLinear

if TYPE_CHECKING:
    from pyscore.model.decoder import Decoder

OPS = ("linear", "add_rms_norm", "rotary", "decode_attention")
Call = tuple[Callable[..., Any], tuple[Any, ...]]


class DecodeProgram:
    """The bound calls of a decode step of `batch` sequences; `run` replays them."""

    def __init__(self, decoder: Decoder, module: Any, batch: int) -> None:
        cfg, dtype = decoder.cfg, decoder.dtype
        self.decoder, self.batch, self.module = decoder, batch, module
        self.dtype_name = _ext.torch_dtype_name(dtype)
        hidden, hq, hkv, d = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_width = (hq + 2 * hkv) * d
        self.tokens = torch.empty(batch, dtype=torch.long)
        self.positions = torch.empty(batch, dtype=torch.long)
        self.x = torch.empty(batch, hidden, dtype=dtype)  # the residual stream
        self.h = torch.empty(batch, hidden, dtype=dtype)  # a norm's output, the next projection's input
        self.qkv = torch.empty(batch, qkv_width, dtype=dtype)
        self.attn = torch.empty(batch, hq, d, dtype=dtype)
        # The MLP activation [B, I], one per width (every layer's, in practice). Held here: the calls hold only
        # addresses.
        self.acts: dict[int, torch.Tensor] = {}
        q, k, v = self.qkv.view(batch, -1, d).split([hq, hkv, hkv], dim=1)
        self.before: list[list[Call]] = []  # per layer: the calls up to its attention
        self.after: list[list[Call]] = []  # and from its o projection on
        self.attention: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []  # its args around the step's tables
        rot, self.slots = decoder.rotary, decoder.slot
        for layer in decoder.w.layers:
            width = layer.gate_up.out_features
            if width not in self.acts:
                self.acts[width] = torch.empty(batch, width, dtype=dtype)
            act = self.acts[width]
            self.before.append([
                self._norm(layer.input_norm, self.x, self.h),
                self._linear(self.h, layer.qkv, self.qkv),
                (module.rotary, (
                    q.data_ptr(), (q.stride(0), q.stride(1)), k.data_ptr(), (k.stride(0), k.stride(1)),
                    self.positions.data_ptr(), rot.cos.data_ptr(), rot.sin.data_ptr(), rot.cos.shape[0],
                    _ptr(layer.q_norm), _ptr(layer.k_norm), float(cfg.rms_norm_eps), batch, hq, hkv, d,
                    self.dtype_name)),
            ])
            a = self.attn
            self.attention.append((
                (q.data_ptr(), (q.stride(0), q.stride(1)), a.data_ptr(), (a.stride(0), a.stride(1)), k.data_ptr(),
                 v.data_ptr(), (k.stride(0), k.stride(1))),
                (batch, hq, hkv, d, d**-0.5, self.dtype_name)))
            self.after.append([
                self._linear(self.attn.view(batch, -1), layer.o, self.x, residual=True),
                self._norm(layer.post_norm, self.x, self.h),
                self._linear(self.h, layer.gate_up, act),
                self._linear(act, layer.down, self.x, residual=True),
            ])

    @staticmethod
    def of(decoder: Decoder) -> Any:
        """The CPU module whose kernels can run `decoder`'s decode steps as a program now, else None (see above)."""
        cfg, device, dtype = decoder.cfg, decoder.device, decoder.dtype
        if device.type != "cpu" or decoder.num_linear or cfg.attn_output_gate or cfg.rotary_dim:
            return None
        module = None
        for op in OPS:
            module, path, _ = _ext.resolve_path(op, device, dtype, decoder.op_backend)
            if path != "kernel":
                return None
        weights = [w for layer in decoder.w.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return module if all(isinstance(w, PackedLinear) for w in weights) else None

    def _norm(self, weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> Call:
        """add_rms_norm(x) into out, as pyscore.ops.add_rms_norm passes it (no delta)."""
        return (self.module.add_rms_norm, (
            x.data_ptr(), x.stride(0), 0, 0, weight.data_ptr(), weight.dtype != x.dtype, out.data_ptr(),
            out.stride(0), x.shape[0], x.shape[1], float(self.decoder.cfg.rms_norm_eps), self.dtype_name))

    def _linear(self, x: torch.Tensor, w: PackedLinear, out: torch.Tensor, residual: bool = False) -> Call:
        """linear(x, w) into out (residual: out += x @ W.T, out being the residual), as pyscore.ops.linear passes it."""
        packed, bias, k, columns, n_out, gated = w._kernel_args
        res = (out.data_ptr(), out.stride(0)) if residual else (0, 0)
        return (self.module.linear, (x.data_ptr(), x.stride(0), packed, bias, *res, out.data_ptr(), out.stride(0),
                                     x.shape[0], k, columns, n_out, gated, self.dtype_name))

    def run(self, tokens: torch.Tensor, positions: list[int], plan: DecodePlan,
            boundary: Callable[[], None]) -> torch.Tensor:
        """One step: tokens [B] at `positions`, keys and values through `plan`; `boundary()` before each layer (the
        decoder's interrupt point). Returns the final-normed hidden states [B, H]."""
        self.tokens.copy_(tokens)
        self.positions.copy_(torch.tensor(positions, dtype=torch.long))
        torch.index_select(self.decoder.w.embed, 0, self.tokens, out=self.x)
        pool, table, attend = plan.pool_args, plan.table_args, self.module.decode_attention
        for i, (before, (head, tail), after) in enumerate(zip(self.before, self.attention, self.after, strict=True)):
            boundary()
            for fn, args in before:
                fn(*args)
            attend(*head, *pool, self.slots[i], *table, *tail)
            for fn, args in after:
                fn(*args)
        out = torch.empty_like(self.x)
        fn, args = self._norm(self.decoder.w.final_norm, self.x, out)
        fn(*args)
        return out


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
