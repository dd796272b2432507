"""The decoder for Llama / Qwen2 / Qwen3 / Qwen3.5 on packed tokens without padding:
embed -> N x (norm -> mixer -> o -> norm -> SwiGLU) -> final norm, returned only at the read-out rows. The mixer is
attention (qkv -> [qk-norm] -> rope(positions) -> prefix_item_attention) or, in Qwen3.5's linear-attention layers,
Gated DeltaNet over the same segment table (pyscore.model.hybrid). A second entry point decodes one token per running
sequence against its cache: its pages of the paged KV store for the attention layers (all sequences in one
decode_attention call per layer, through their block tables) and the conv + recurrent state of the linear ones; on
the CPU its calls are bound once per batch size and replayed (pyscore.model.decode_program), the same bits. A
batch whose groups start with prefix-cache blocks reads their keys and values from a block pool (`BlockPool`: the
KV store, pyscore.model.kv_store) in every attention layer; only the batch's own tokens run through projections,
norms and MLPs.

Every projection runs through pyscore.ops.linear, one convention on every path: the residual adds are fused into
the output projections (o / out_proj, down), the SiLU-mul into gate_up, and a row's bits never depend on the rows
around it. The decoder turns each loaded weight into the form its linear path reads (packed for our kernel, plain
for torch's GEMM), replacing it: weights are held once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pyscore.errors import PassInterrupted
from pyscore.memory import release_freed_memory
from pyscore.model import hybrid
from pyscore.model.config import LINEAR_ATTENTION, ModelConfig
from pyscore.model.decode_program import DecodeProgram
from pyscore.model.kv_store import PageTable
from pyscore.model.packing import PackedBatch
from pyscore.model.rope import Rotary
from pyscore.model.weights import DecoderWeights, LayerWeights
from pyscore.ops import (
    AttentionPlan,
    CachedKeys,
    SegmentTable,
    add_rms_norm,
    decode_attention,
    linear,
    plan_decode,
    prepare_linear,
    rotary_,
)
from pyscore.ops.gated_delta_rule import plan_linear_attention
from pyscore.ops.linear import DECODE_ROWS, INT8_WEIGHTS, KERNEL_PACKED, PREFILL_ROWS
from pyscore.types import Boundary

PROGRAMS_KEPT = 4  # decode programs kept, by batch size (Decoder.programs)

# kv_sink(slot, k [T, Hkv, D], v [T, Hkv, D]) receives each attention layer's rotated keys and values (prefill);
# slot is the layer's index among the attention layers (= the layer index in all-attention models).
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> attention output [T, Hq, D].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# mix_linear(layer, h [T, H]) -> the linear-attention mixer's output [T, Hv Dv] (before out_proj).
MixLinear = Callable[[int, torch.Tensor], torch.Tensor]


class BlockPool(Protocol):
    """Where a batch's cached blocks live: num_blocks blocks of block_tokens tokens, per layer a key and a value
    view [num_blocks, block_tokens, Hkv, D]."""

    block_tokens: int

    @property
    def num_blocks(self) -> int: ...
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class StatePool(BlockPool, Protocol):
    """A block pool that also keeps a hybrid model's linear states as bytes in pages (the prefix cache)."""

    def read_state(self, pages: tuple[int, ...]) -> torch.Tensor: ...
    def write_state(self, pages: tuple[int, ...], blob: torch.Tensor) -> None: ...
    def state_view(self, pages: tuple[int, ...]) -> torch.Tensor | None: ...


@dataclass
class KVCache:
    """One sequence's cache: its pages of the KV store for the attention layers (`table`: shared cached pages, then
    its own), `length` tokens valid (positions past it may hold the writes of a step that has not been committed;
    `reserve` makes room for the next); for a hybrid model also, per
    linear-attention layer, the conv tail [L_lin, K - 1, C] and the fp32 recurrent state [L_lin, Hv, Dk, Dv], each
    with a spare of the same shape that a decode step writes, swapped in (`commit`) only once the whole step —
    the token chosen included — has succeeded, so a failed step can be retried from the state before it."""

    table: PageTable
    length: int = 0
    conv: torch.Tensor | None = None
    state: torch.Tensor | None = None
    next_conv: torch.Tensor | None = None
    next_state: torch.Tensor | None = None

    def reserve(self, tokens: int) -> None:
        """Pages for `tokens` tokens (the next decode step writes position `length`); KVStoreFull when none is left."""
        self.table.reserve(tokens)

    def release(self) -> None:
        """The sequence ended: its own pages go back to the store, its shared ones to the cache."""
        self.table.release()

    def commit(self) -> None:
        """One decoded token is final: the length advances and the linear layers' new states become current."""
        self.length += 1
        if self.state is not None:
            self.conv, self.next_conv = self.next_conv, self.conv
            self.state, self.next_state = self.next_state, self.state


class Decoder:
    """The residual stream x [T, H] is updated in place: each sublayer's output projection adds into it (linear's
    fused residual epilogue). op_backend "reference" runs every op as its torch reference (`pyscore.ops.reference`).
    The decoder owns `weights` from here on: their projections are converted in place for the linear path."""

    def __init__(self, cfg: ModelConfig, weights: DecoderWeights, rotary: Rotary, op_backend: str = "auto"):
        self.cfg = cfg
        self.w = weights
        self.rotary = rotary
        self.op_backend = op_backend
        # Each layer's index among the layers of its kind: its slot in a cache.
        kinds = [cfg.layer_type(i) for i in range(cfg.num_layers)]
        self.slot = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]
        self.num_linear = kinds.count(LINEAR_ATTENTION)
        # Asked at every layer boundary of a pass (pyscore.types.Boundary): STOP ends the pass there
        # (PassInterrupted), YIELD runs `between` there first. The engine's owner sets them (Engine.set_boundary;
        # server/scheduler: every caller of the pass gone or shutting down; short requests waiting on a chunk).
        self.decide: Callable[[], Boundary] | None = None
        self.between: Callable[[], None] | None = None
        # Decode steps as bound kernel calls (pyscore.model.decode_program), by batch size, the most recent last.
        # Bounded: each holds a few [B, width] buffers, and a server's batch sizes come and go.
        self.programs: dict[int, DecodeProgram] = {}
        for layer in weights.layers:
            self._prepare(layer)
            release_freed_memory()  # the layer's replaced plain projections, before the next layer's packs
        projections = weights.projections()
        self.packed_weights = all(isinstance(w, KERNEL_PACKED) for w in projections)  # every one for our kernel
        self.int8_weights = any(isinstance(w, INT8_WEIGHTS) for w in projections)  # quantize="int8"
        # fp32 serving with a bf16 checkpoint's matrices held in bf16 (pyscore.ops.linear.holds_bf16_weights)
        self.bf16_weights = self.dtype == torch.float32 and any(
            w.dtype == torch.bfloat16 for w in (*projections, weights.embed))

    def _prepare(self, layer: LayerWeights) -> None:
        """Each projection in the form its linear path reads, one at a time, each replacing its source so that
        only one projection is ever held twice."""
        backend = self.op_backend
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, name)
            if w is not None:
                setattr(layer, name, prepare_linear(w, backend))
        if layer.linear is not None:
            layer.linear.in_proj = prepare_linear(layer.linear.in_proj, backend)
            layer.linear.out = prepare_linear(layer.linear.out, backend)

    def replace_layer(self, i: int, layer: LayerWeights) -> None:
        """Layer i's weights replaced by `layer` (its projections as built: prepared here, as at construction)."""
        self._prepare(layer)
        self.w.layers[i] = layer
        self.programs.clear()  # bound decode steps read the old layer's weights
        release_freed_memory()

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows [T, H] in the dtype (a bf16 embedding under fp32: widened, exact)."""
        x = self.w.embed.index_select(0, tokens)  # (embed[tokens]: ~80-200 us a forward, this ~15)
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm(x) [T, H]. Zero-centred families hold fp32 weights 1 + w."""
        return add_rms_norm(x, weight, self.cfg.rms_norm_eps, backend=self.op_backend)

    def _attention(self, i: int, h: torch.Tensor, positions: torch.Tensor, attend: Attend, rows: int) -> torch.Tensor:
        """The attention mixer of layer i on h [T, H] -> [T, Hq D], before o_proj."""
        cfg, layer = self.cfg, self.w.layers[i]
        if cfg.attn_output_gate:
            q, k, v, gate = hybrid.gated_attention_inputs(h, layer, cfg, positions, self.rotary.cos, self.rotary.sin,
                                                          self.op_backend, rows)
            return hybrid.sigmoid_gate(attend(i, q, k, v).view(h.shape[0], -1), gate)
        qkv = linear(h, layer.qkv, backend=self.op_backend, rows_per_call=rows)
        qkv = qkv.view(h.shape[0], -1, cfg.head_dim)  # [T, Hq + 2 Hkv, D]
        q, k, v = qkv.split([cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
        rotary_(q, k, positions, self.rotary.cos, self.rotary.sin, layer.q_norm, layer.k_norm, cfg.rms_norm_eps,
                backend=self.op_backend)  # in place, with Qwen3's qk-norm when present
        return attend(i, q, k, v).view(h.shape[0], -1)

    def _layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend, mix_linear: MixLinear | None,
               rows_per_call: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i on the residual stream x [T, H], updated in place and returned. With `rows` (the last layer: only
        read-out rows feed the output) everything after the mixer runs on those rows alone and the returned stream
        is x[rows]. rows_per_call: the torch GEMM path's fixed call height for this pass (prefill or decode)."""
        layer, backend, n = self.w.layers[i], self.op_backend, rows_per_call
        h = self._norm(x, layer.input_norm)
        if layer.linear is not None:
            mixed, out = mix_linear(i, h), layer.linear.out
        else:
            mixed, out = self._attention(i, h, positions, attend, n), layer.o
        if rows is not None:
            x, mixed = x.index_select(0, rows), mixed.index_select(0, rows)  # (indexing: ~5x slower on the CPU)
        x = linear(mixed, out, residual=x, out=x, backend=backend, rows_per_call=n)  # x += out(mixed)
        act = linear(self._norm(x, layer.post_norm), layer.gate_up, backend=backend, rows_per_call=n)  # silu * up
        return linear(act, layer.down, residual=x, out=x, backend=backend, rows_per_call=n)

    @torch.inference_mode()
    def hidden_at(self, batch: PackedBatch, kv_sink: KVSink | None = None,
                  linear_states: list[KVCache] | None = None, blocks: BlockPool | None = None) -> torch.Tensor:
        """Final-normed hidden states [R, H] at the batch's read-out rows. The segment table is validated and
        attention (and linear attention) planned once here, for every layer. linear_states (prefill of a hybrid
        model): per segment, the cache whose conv tails and recurrent states receive that sequence's end states. A
        batch that reads cached blocks needs the pool they are in (`blocks`); the kv sink runs before each layer's
        attention, so blocks this pass writes into the pool are readable by its later groups. A hybrid model's
        batch that resumes cached blocks or keeps states at a block's end (`batch.state_reads` / `state_writes`)
        reads and writes those states in the same pool (a `StatePool`): the writes once every layer has run."""
        cfg, device = self.cfg, self.device
        tokens, positions = batch.tokens.to(device), batch.positions.to(device)
        table = SegmentTable.of(batch.segments, batch.num_tokens, device)
        cached = None
        if batch.cached is not None:
            if blocks is None:
                raise ValueError("the batch reads cached blocks: pass the block pool they are in")
            assert batch.cached_blocks is not None
            cached = CachedKeys.of(table, batch.cached, batch.cached_blocks, blocks.block_tokens, blocks.num_blocks,
                                   device)
        plan = AttentionPlan(table, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype, device,
                             self.op_backend, cached)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kv_sink is not None:
                kv_sink(self.slot[i], k, v)
            if cached is None:
                return plan.run(q, k, v)
            assert blocks is not None
            cache_k, cache_v = blocks.layer(self.slot[i])
            return plan.run(q, k, v, cache_k=cache_k, cache_v=cache_v)

        mix_linear = None
        kept: list[tuple[tuple[int, ...], hybrid.LinearStates]] = []
        if self.num_linear:
            linear_plan = plan_linear_attention(table)
            leave = linear_states is not None
            starts, kept, snaps = self._cached_states(batch, blocks, table.num_segments)
            leads = [not prefix_length for prefix_length in table.host[:, 3].tolist()] if starts else []

            def mix_linear(i: int, h: torch.Tensor) -> torch.Tensor:
                j, w = self.slot[i], self.w.layers[i].linear
                return hybrid.linear_attention(
                    h, w, self.cfg, linear_plan, self.op_backend, PREFILL_ROWS,
                    tails_in=[None if x is None else x.conv[j] for x in starts] if starts else None,
                    states_in=[None if x is None or not lead else x.state[j]  # an item continues its prefix's state
                               for x, lead in zip(starts, leads, strict=True)] if starts else None,
                    tails_out=[c.conv[j] for c in linear_states] if leave else None,
                    states_out=[c.state[j] for c in linear_states] if leave else None,
                    snapshots=[(s, n, x.conv[j], x.state[j]) for s, n, x in snaps])

        x = self._embed(tokens)
        readout, last = batch.readout.to(device), len(self.w.layers) - 1
        for i in range(len(self.w.layers)):
            self._layer_boundary()
            x = self._layer(i, x, positions, attend, mix_linear, PREFILL_ROWS, rows=readout if i == last else None)
        for pages, states in kept:
            blocks.write_state(pages, states.to_bytes())  # type: ignore[union-attr]
        return self._norm(x, self.w.final_norm)  # [R, H]

    def _cached_states(self, batch: PackedBatch, blocks: BlockPool | None, num_segments: int
                       ) -> tuple[list[hybrid.LinearStates | None], list[tuple[tuple[int, ...], hybrid.LinearStates]],
                                  list[tuple[int, int, hybrid.LinearStates]]]:
        """A hybrid batch's prefix-cache states: per segment the states it starts from (empty list: none), the
        (pages, buffers) to store after the pass and the snapshots (segment, tokens, buffers) that fill them."""
        if not batch.state_reads and not batch.state_writes:
            return [], [], []
        if not hasattr(blocks, "read_state"):
            raise ValueError("the batch resumes or keeps linear states: pass the prefix cache that holds them")
        pool: StatePool = blocks  # type: ignore[assignment]
        starts: list[hybrid.LinearStates | None] = [None] * num_segments
        loaded: dict[tuple[int, ...], hybrid.LinearStates] = {}  # a group's segments share its states
        for s, pages in batch.state_reads:
            if pages not in loaded:
                loaded[pages] = self._states_at(pool, pages) or self.new_linear_states().load_bytes(
                    pool.read_state(pages))
            starts[s] = loaded[pages]
        kept, snaps = [], []
        for s, n, pages in batch.state_writes:
            states = self._states_at(pool, pages)  # written in place by the kernels...
            if states is None:
                states = self.new_linear_states()
                kept.append((pages, states))  # ...or copied in after the last layer
            snaps.append((s, n, states))
        return (starts if batch.state_reads else []), kept, snaps

    def _states_at(self, pool: StatePool, pages: tuple[int, ...]) -> hybrid.LinearStates | None:
        """The states kept in `pages` as views of the pool (consecutive pages), else None."""
        blob = pool.state_view(pages)
        if blob is None:
            return None
        return hybrid.LinearStates.view_of(blob, self._states_like())

    def _states_like(self) -> hybrid.LinearStates:
        """Zero-size stand-ins with the states' shapes and dtypes (for view_of)."""
        lin = self.cfg.linear
        return hybrid.LinearStates(
            torch.empty((self.num_linear, lin.conv_kernel - 1, lin.conv_channels), dtype=self.dtype, device="meta"),
            torch.empty((self.num_linear, lin.num_v_heads, lin.k_dim, lin.v_dim), device="meta"))

    def new_linear_states(self) -> hybrid.LinearStates:
        """Uninitialised buffers for every linear layer's states at one token."""
        return hybrid.LinearStates.empty(self.cfg, self.num_linear, self.dtype, self.device)

    @property
    def linear_state_bytes(self) -> int:
        """What every linear layer's states at one token weigh (0 without linear layers): the prefix cache keeps
        one such set at the end of each cached sequence of a hybrid model."""
        return hybrid.LinearStates.nbytes(self.cfg, self.num_linear, self.dtype) if self.num_linear else 0

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One new token per sequence (tokens [B]) at position cache.length (its pages must hold it: `reserve`):
        writes its keys and values there (and a hybrid model's new linear states into the spares), attends over
        positions [0, length] and returns final-normed hidden states [B, H]. It commits nothing: the caller calls
        cache.commit() once the whole step has succeeded, so a failed step retried rewrites the same slot. A
        sequence's result never depends on its batch-mates."""
        device = self.device
        pool = caches[0].table.store.pool  # [pages, 2, L, B, Hkv, D]: every sequence's pages are in one store
        plan = plan_decode(pool[:, 0], pool[:, 1], [c.table.pages for c in caches], [c.length + 1 for c in caches])
        module = DecodeProgram.of(self)
        if module is not None:
            return self._program(module, len(caches)).run(tokens, [c.length for c in caches], plan, caches,
                                                           self._layer_boundary)
        positions = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # every sequence at once; writes k, v at position length first
            return decode_attention(q, plan, self.slot[i], k, v, backend=self.op_backend)  # [B, Hq, D]

        mix_linear = None
        if self.num_linear:
            steps = torch.tensor([[b, 1, b, 0] for b in range(len(caches))], dtype=torch.int32).reshape(-1, 4)
            linear_plan = plan_linear_attention(SegmentTable.of(steps, len(caches), device))

            def mix_linear(i: int, h: torch.Tensor) -> torch.Tensor:
                j, w = self.slot[i], self.w.layers[i].linear
                return hybrid.linear_attention(
                    h, w, self.cfg, linear_plan, self.op_backend, DECODE_ROWS, tails_in=[c.conv[j] for c in caches],
                    tails_out=[c.next_conv[j] for c in caches], states_in=[c.state[j] for c in caches],
                    states_out=[c.next_state[j] for c in caches])

        x = self._embed(tokens.to(device))  # [B, H]
        for i in range(len(self.w.layers)):
            self._layer_boundary()
            x = self._layer(i, x, positions, attend, mix_linear, DECODE_ROWS)
        return self._norm(x, self.w.final_norm)

    def _program(self, module: Any, batch: int) -> DecodeProgram:
        """The decode program for `batch` sequences, made on first use; at most PROGRAMS_KEPT are kept."""
        program = self.programs.pop(batch, None)
        if program is None or program.module is not module:
            program = DecodeProgram(self, module, batch)
            while len(self.programs) >= PROGRAMS_KEPT:
                del self.programs[next(iter(self.programs))]  # the least recently used
        self.programs[batch] = program
        return program

    def _layer_boundary(self) -> None:
        """A safe point: the pass has written only its own buffers (and pending cache blocks), so it can stop, or
        let other passes run (they read and change nothing of its state) and go on from here."""
        decision = Boundary.CONTINUE if self.decide is None else self.decide()
        if decision is Boundary.STOP:
            raise PassInterrupted("the forward pass was interrupted at a layer boundary")
        if decision is Boundary.YIELD and self.between is not None:
            self.between()

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's keys and values weigh in the KV store (its attention layers; a hybrid model's linear
        layers hold a fixed-size state per sequence instead, outside this count)."""
        return 2 * self.num_attention_layers * self.cfg.num_kv_heads * self.cfg.head_dim * self.dtype.itemsize

    @property
    def num_attention_layers(self) -> int:
        return self.cfg.num_layers - self.num_linear

    def new_cache(self, table: PageTable) -> KVCache:
        """A sequence's cache over its pages, with a hybrid model's linear states (zeros)."""
        cfg = self.cfg
        cache = KVCache(table)
        if self.num_linear:
            lin = cfg.linear
            conv = (self.num_linear, lin.conv_kernel - 1, lin.conv_channels)
            state = (self.num_linear, lin.num_v_heads, lin.k_dim, lin.v_dim)
            cache.conv, cache.next_conv = (torch.zeros(conv, dtype=self.dtype, device=self.device) for _ in range(2))
            cache.state, cache.next_state = (torch.zeros(state, device=self.device) for _ in range(2))
        return cache
