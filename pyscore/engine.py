"""pyscore.Engine: construction of one loaded model and the facade over it. Label scoring (SIS / MIS / setwise,
causal LMs and classification heads) runs here; generation is stepped by `pyscore.generation.GenerationRunner`.
Both reuse the keys and values of earlier query / prompt prefixes through the prefix cache
(`pyscore.model.prefix_cache`), whose blocks are pages of the one paged KV store (`pyscore.model.kv_store`) that
running generations keep their keys and values in: one byte budget for both. The engine knows nothing of gRPC: it
takes and returns `pyscore.types` objects and raises `pyscore.errors` for bad requests. It is not thread-safe: one
worker owns it (see server/batcher)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from pyscore import branch_points, chunked_prefill
from pyscore.branch_points import Head
from pyscore.budget import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_RUNNING_GENERATIONS, count_within_budget
from pyscore.chunked_prefill import ChunkedPrefill
from pyscore.errors import PassInterrupted, RequestError
from pyscore.gen_validate import render_chat
from pyscore.generation import Generation, GenerationRunner, eos_token_ids
from pyscore.memory import (
    Pools,
    describe,
    keep_activation_pages,
    plan_memory,
    release_freed_memory,
    resident_bytes,
)
from pyscore.model import smoothing
from pyscore.model.decoder import Decoder
from pyscore.model.kv_store import KVStore, KVStoreStats
from pyscore.model.loading import LoadedModel, load_model
from pyscore.model.packing import Group, pack
from pyscore.model.prefix_cache import CacheLease, PrefixCache, PrefixCacheStats, pass_lease, unsupported_reason
from pyscore.ops import _ext, label_logprobs, linear_int8
from pyscore.scoring import ModelTraits, PreparedScore, prepare_score
from pyscore.types import (
    Boundary,
    GenerateRequest,
    GenerateResult,
    MemoryPlan,
    ModelInfo,
    ScoreRequest,
    ScoreResult,
    Usage,
)

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """"auto": CUDA when pyscore's CUDA kernels can run, else the CPU; a GPU that torch sees but pyscore cannot
    use (e.g. `_C_cuda` was not built or failed to load) is a WARNING, never a silent fall-back."""
    if device != "auto":
        return torch.device(device)
    usable, why = _ext.cuda_status()
    if usable:
        return torch.device("cuda")
    if torch.cuda.is_available():
        log.warning("torch sees %d CUDA device(s) but pyscore cannot use them (%s): serving on the CPU. Fix the "
                    "CUDA build, or pass --device cpu to choose the CPU deliberately.", torch.cuda.device_count(), why)
    return torch.device("cpu")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """float16 on the CPU is served, correctly, by the ops' PyTorch references (no CPU kernel takes fp16 and
    x86 CPUs without AVX512-FP16 have no fp16 arithmetic): several times slower than bfloat16, so a WARNING."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto" and device.type == "cpu":
        resolved, why = _ext.default_cpu_dtype()  # bf16 only where the CPU multiplies bf16
        log.info("dtype auto -> %s", why)
    elif dtype == "auto":
        resolved = torch.bfloat16  # tensor cores
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(DTYPES)}")
    if resolved == torch.float16 and device.type == "cpu":
        log.warning("float16 on the CPU: no CPU kernel takes fp16, so every op runs its PyTorch reference (correct, "
                    "several times slower than bfloat16). Use --dtype bfloat16 (the default) or float32 on the CPU.")
    return resolved


def smaller_dtype(dtype: str | torch.dtype, resolved: torch.dtype) -> torch.dtype | None:
    """bfloat16 for dtype "auto" resolved to float32 (a CPU without bf16 arithmetic): the loader serves a model in it
    where the model fits only in it (pyscore.model.loading.choose_dtype). None otherwise: an asked dtype is kept."""
    return torch.bfloat16 if isinstance(dtype, str) and dtype == "auto" and resolved == torch.float32 else None


def set_threads(threads: int | None) -> None:
    threads = threads or int(os.environ.get("PYSCORE_THREADS", 0)) or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    cpu = _ext.cpu_module()
    if cpu is not None:
        cpu.set_num_threads(threads)


def make_kv_store(decoder: Decoder, budget_bytes: int) -> KVStore:
    """The engine's paged KV store (raises ValueError naming the budget when it holds no page)."""
    cfg = decoder.cfg
    try:
        return KVStore(budget_bytes, num_layers=decoder.num_attention_layers, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, dtype=decoder.dtype, device=decoder.device)
    except ValueError as e:
        raise ValueError(f"--kv-cache-mb: {e}") from None


def make_prefix_cache(loaded: LoadedModel, decoder: Decoder, store: KVStore) -> PrefixCache | None:
    """The engine's prefix cache over the pages of `store` (all of them may hold cached blocks: the least recently
    used that no sequence holds are evicted when one needs a page), or None for a model it cannot serve (logged
    with why)."""
    cfg = loaded.cfg
    reason = unsupported_reason(cfg)
    if reason is not None:
        log.warning("prefix cache off for %s: %s", loaded.name, reason)
        return None
    identity = f"{loaded.name}|{loaded.path}|{cfg}"
    states = decoder.linear_state_bytes  # a hybrid model's: kept at each cached sequence's end
    try:
        return PrefixCache(None, identity=identity, store=store, state_bytes=states)
    except ValueError as e:
        log.warning("prefix cache off: %s", e)
        return None


def tensor_bytes(obj: object) -> int:
    """Bytes of the tensors in a tree of dataclasses and lists (each storage once: a tied head is the embedding)."""
    seen: dict[int, int] = {}

    def walk(o: object) -> None:
        if isinstance(o, torch.Tensor):
            seen[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif dataclasses.is_dataclass(o):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name))

    walk(obj)
    return sum(seen.values())


def final_memory_plan(loaded: LoadedModel, decoder: Decoder, pools: Pools, kv_store_bytes: int) -> MemoryPlan:
    """The loader's plan with the KV store the engine really got (whole pages); for a model built in code (no
    checkpoint to plan from), planned from the weights it holds."""
    if loaded.memory is None:
        return plan_memory(loaded.cfg, tensor_bytes(loaded.weights), decoder.dtype, pools, kv_store_bytes)
    return replace(loaded.memory, kv_budget_bytes=kv_store_bytes, prefix_cache_bytes=0)


def _label_table(owners: Sequence[PreparedScore]) -> torch.Tensor:
    """[R, K] int32 label ids of each row's request, -1 past a request's own labels (rows may ask for different
    label sets)."""
    labels = torch.full((len(owners), max(len(p.labels) for p in owners)), -1, dtype=torch.int32)
    for j, p in enumerate(owners):
        labels[j, : len(p.labels)] = torch.tensor(p.labels, dtype=torch.int32)
    return labels


class Engine:
    def __init__(self, loaded: LoadedModel, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, op_backend: str = "auto",
                 prefix_cache: bool = True, max_running_generations: int = DEFAULT_MAX_RUNNING_GENERATIONS,
                 kv_cache_mb: float | None = None, prefill_chunk_tokens: int | None = None):
        """kv_cache_mb: the KV store's byte budget in MiB, for the prefix cache and running generations together
        (None: pyscore.budget's default). prefix_cache False: no prefix cache (every query and prompt computed in
        full; no chunked prefill)."""
        self.model = loaded
        self.cfg = loaded.cfg
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_batch_tokens = max_batch_tokens
        # A request that computes more than max_batch_tokens is prefilled in chunks of at most this many (whole
        # blocks; plan_chunks).
        self.prefill_chunk_tokens = min(prefill_chunk_tokens or max_batch_tokens, max_batch_tokens)
        self.decoder = Decoder(loaded.cfg, loaded.weights, loaded.rotary, op_backend)
        release_freed_memory()
        if loaded.read_layer is not None:  # quantize="int8": SmoothQuant's calibration and second pass
            smoothing.smooth(self.decoder, loaded.read_layer, loaded.tokenizer)
            loaded.read_layer = None
        self.traits = ModelTraits(tokenizer=loaded.tokenizer, vocab_size=loaded.cfg.vocab_size,
                                  max_context=loaded.cfg.max_position_embeddings,
                                  is_classifier=loaded.cfg.is_classifier, num_labels=loaded.cfg.num_labels,
                                  id2label=loaded.cfg.id2label)
        pools = Pools(max_batch_tokens, max_running_generations, kv_cache_mb)
        self.kv_store = make_kv_store(self.decoder, pools.kv_store_bytes(self.decoder.kv_bytes_per_token))
        self.prefix_cache = make_prefix_cache(loaded, self.decoder, self.kv_store) if prefix_cache else None
        self.generation = GenerationRunner(self.decoder, loaded.tokenizer,
                                           eos_token_ids(loaded.hf_config, loaded.tokenizer), max_batch_tokens,
                                           self.prefix_cache, self.kv_store, self.prefill_chunk_tokens)
        # Which path every op takes on this model's device and dtype, decided once by the op registry.
        self.op_paths = _ext.op_paths(self.decoder.device, self.decoder.dtype, op_backend)
        self.quantize = "int8" if self.decoder.int8_weights else ""
        if self.quantize:
            self.op_paths["linear"] = (f"{linear_int8.describe(self.decoder.device)}; SmoothQuant folded in at "
                                       f"load (alpha {smoothing.ALPHA}, pyscore.model.smoothing)")
        if self.decoder.bf16_weights:  # (the registry knows the dtype, not the checkpoint)
            self.op_paths["linear"] += "; the checkpoint's bf16 projections held in bf16, widened exactly"
            self.op_paths["label_logprobs"] += "; the checkpoint's bf16 LM head held in bf16, widened exactly"
        self.cpu_tier = _ext.cpu_tier() if self.decoder.device.type == "cpu" else ""
        log.info("%s; model on %s in %s%s%s", _ext.cuda_status()[1], self.decoder.device,
                 str(self.decoder.dtype).removeprefix("torch."), ", projections in int8" * bool(self.quantize),
                 f", CPU tier {self.cpu_tier}" * bool(self.cpu_tier))
        for op, path in self.op_paths.items():
            log.info("op %s: %s", op, path)
        store = self.kv_store
        log.info("KV store: %d pages of %d tokens (%.0f MiB, %d bytes a token) for the prefix cache (%s) and "
                 "running generations", store.capacity, store.block_tokens, store.capacity * store.block_bytes / 2**20,
                 self.decoder.kv_bytes_per_token,
                 "off" if self.prefix_cache is None else f"up to {self.prefix_cache.capacity} pages")
        self.memory = final_memory_plan(loaded, self.decoder, pools, store.capacity * store.block_bytes)
        log.info("memory: %s expected when every pool is full (--kv-cache-mb %.0f, --max-batch-tokens %d); "
                 "resident now %.2f GiB", describe(self.memory), store.capacity * store.block_bytes / 2**20,
                 max_batch_tokens, resident_bytes() / 2**30)
        log.info(keep_activation_pages())  # last: the weights and the KV store keep glibc's own placement

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
                        device: str = "auto", threads: int | None = None,
                        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, op_backend: str = "auto",
                        prefix_cache: bool = True, max_running_generations: int = DEFAULT_MAX_RUNNING_GENERATIONS,
                        kv_cache_mb: float | None = None, prefill_chunk_tokens: int | None = None,
                        quantize: str | None = None) -> Engine:
        """model: a local HF directory, a .gguf file, or None for the embedded SmolLM2-135M-Instruct.
        kv_cache_mb: the KV store's byte budget in MiB (prefix cache and running generations; default: 65536
        tokens' worth + 1024 MiB); prefix_cache False turns the prefix cache off. The engine plans memory with these
        and max_running_generations and
        refuses, before loading, a model that cannot fit (pyscore.memory.InsufficientMemoryError).
        prefill_chunk_tokens: a request computing more than max_batch_tokens has its query / prompt prefilled in
        chunks of at most this size (default and at most max_batch_tokens; pyscore.chunked_prefill).
        quantize: None (the dtype) or "int8": the layers' projections in int8 W8A8, the rest in the dtype
        (pyscore.ops.linear_int8: exact int32 sums, so MIS = SIS and batch invariance hold; its drift from the
        dtype's scores is measured in docs/guarantees.md; another value: ValueError, from
        pyscore.model.weights.build_weights)."""
        set_threads(threads)
        dev = resolve_device(device)
        _ext.check_switches()  # before the tier picks the dtype and the load takes its time
        pools = Pools(max_batch_tokens, max_running_generations, kv_cache_mb)
        resolved = resolve_dtype(dtype, dev)
        loaded = load_model(model, resolved, dev, pools, smaller_dtype(dtype, resolved), op_backend, quantize)
        return cls(loaded, max_batch_tokens, op_backend, prefix_cache, max_running_generations, kv_cache_mb,
                   prefill_chunk_tokens)

    # --- model facts ---------------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        tok = self.tokenizer
        special = {k: str(v) for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
        return ModelInfo(name=self.model_name, architecture=self.cfg.architecture,
                         kind="classifier" if self.cfg.is_classifier else "causal_lm",
                         vocab_size=self.cfg.vocab_size, max_context=self.cfg.max_position_embeddings,
                         dtype=str(self.decoder.dtype).removeprefix("torch."), device=str(self.decoder.device),
                         special_tokens=special, num_labels=self.cfg.num_labels, ops=dict(self.op_paths),
                         quantize=self.quantize,
                         cpu_tier=self.cpu_tier,
                         prefix_cache_block_tokens=self.prefix_cache.block_tokens if self.prefix_cache else 0,
                         prefix_cache_bytes=self.prefix_cache.stats.capacity_bytes if self.prefix_cache else 0,
                         memory=self.memory)

    def kv_tokens_reserved(self) -> int:
        """KV-store tokens the admitted generations reserve (prompt + max_tokens each, whole pages); safe to read
        from another thread."""
        return self.kv_store.reservations.reserved

    def kv_store_stats(self) -> KVStoreStats:
        """The KV store's pages held now; safe to read from another thread."""
        return self.kv_store.stats

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters and what it holds (None when off); safe to read from another thread."""
        return self.prefix_cache.stats if self.prefix_cache else None

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        """Token ids and each token's text: its decoding alone (" Yes", not the BPE piece "ĠYes"), the same
        convention as generation's logprobs and what a label string must be."""
        ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        return ids, [self.tokenizer.decode([i]) for i in ids]

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's token ids, in one tokenizer call (no per-token text: cheaper than `tokenize` each)."""
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_pieces(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry as the tokenizer stores it (the BPE piece "ĠYes", not its text " Yes"):
        what vLLM's /tokenize returns as token_strs."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def render_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                    add_generation_prompt: bool = True, *, add_special_tokens: bool = False) -> list[int]:
        """The prompt token ids of a chat under the model's chat template (pyscore.gen_validate.render_chat)."""
        return render_chat(self.tokenizer, messages, template_kwargs, add_generation_prompt,
                           add_special_tokens=add_special_tokens)

    # --- scoring -------------------------------------------------------------------------------------
    def prepare_score(self, request: ScoreRequest) -> PreparedScore:
        return prepare_score(request, self.traits)

    def score(self, query: str | list[int], items: Sequence[str] | Sequence[list[int]], **kwargs) -> ScoreResult:
        result = self.score_batch([ScoreRequest(query=query, items=list(items), **kwargs)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult | Exception]:
        prepared: list[PreparedScore | Exception] = []
        for request in requests:
            try:
                prepared.append(self.prepare_score(request))
            except RequestError as e:
                prepared.append(e)
        valid = [p for p in prepared if isinstance(p, PreparedScore)]
        results = iter(self.run_prepared(valid))
        return [p if isinstance(p, Exception) else next(results) for p in prepared]

    def set_boundary(self, decide: Callable[[], Boundary] | None, between: Callable[[], None] | None = None) -> None:
        """`decide()` is asked at every layer boundary of every forward pass (Score and Generate). STOP: the pass
        stops there and `run_prepared` / `step` / `advance_chunked` raise PassInterrupted, having committed
        nothing. YIELD: `between()` runs there (other passes of this engine: each keeps its state in its own
        tensors, and a chunk's cache blocks are private to its lease, so the pass then goes on unchanged)."""
        self.decoder.decide, self.decoder.between = decide, between

    def run_prepared(self, prepared: Sequence[PreparedScore]) -> list[ScoreResult | Exception]:
        """Packs all requests' groups into as few forward passes as the token budget allows. If a pass fails,
        its requests are retried one by one so a single bad request cannot fail its batch-mates. A request larger
        than max_batch_tokens is computed in chunks (`plan_chunks`), all of them here, one request after
        another (the server's scheduler steps them itself, one per iteration, so that others run between them).
        An interrupted pass (PassInterrupted) ends the call: no request gets a result."""
        results: dict[int, ScoreResult | Exception] = {}
        for r, p in enumerate(prepared):
            plan = self.plan_chunks(p)
            if plan is not None:
                results[r] = self.run_chunked(p, plan)
        rest = [r for r in range(len(prepared)) if r not in results]
        results.update(zip(rest, self._run_in_passes([prepared[r] for r in rest]), strict=True))
        return [results[r] for r in range(len(prepared))]

    def _run_in_passes(self, prepared: Sequence[PreparedScore]) -> list[ScoreResult | Exception]:
        rows: list[list[list[list[float]]]] = [[[] for _ in p.items] for p in prepared]
        # per request: query tokens read from the prefix cache (less those the branch pass computed for it)
        cached = [-n for n in self._branch_pass(prepared)]
        errors: dict[int, Exception] = {}
        for chunk in self._passes(prepared):
            chunk = [u for u in chunk if u[0] not in errors]  # a request that failed already wastes no more passes
            if not chunk:
                continue
            try:
                self._run_pass(chunk, prepared, rows, cached)
            except PassInterrupted:
                raise  # not one request's fault: the caller asked the passes to stop
            except Exception as e:
                if len({r for r, _, _ in chunk}) == 1:
                    errors[chunk[0][0]] = e
                    continue
                for r in sorted({r for r, _, _ in chunk}):
                    try:
                        self._run_pass([u for u in chunk if u[0] == r], prepared, rows, cached)
                    except Exception as e2:
                        errors[r] = e2
        return [errors.get(r) or self._result(p, rows[r], cached[r]) for r, p in enumerate(prepared)]

    # --- chunked prefill (pyscore.chunked_prefill) ---------------------------------------------------------------
    def plan_chunks(self, p: PreparedScore) -> ChunkedPrefill | None:
        """For a request that computes more than max_batch_tokens and whose query is a prefix (MIS, SIS; not
        item_first), the plan that computes the query's whole blocks in chunks, its cache blocks reserved; None
        when it runs as one pass (no prefix cache, a cache too small for the query (and a hybrid's states), a query of
        less than one block). The caller steps it with `advance_chunked` until that returns the result, or closes
        the plan (`plan.close(ok=False)`) when it gives up on the request."""
        if p.computed_tokens <= self.max_batch_tokens or not p.items or p.request.item_first:
            return None
        r = p.request
        return chunked_prefill.plan(self.prefix_cache, p.query, len(p.query), self.prefill_chunk_tokens,
                                    r.prefix_cache_salt, r.bypass_prefix_cache)

    def advance_chunked(self, p: PreparedScore, plan: ChunkedPrefill) -> ScoreResult | Exception | None:
        """One step of a chunked request (ChunkedPrefill.advance): the next chunk's pass (None: more to come), or,
        once every chunk ran, its last passes, whose groups read the whole-block query from the cache and compute
        its tail and the items; then the request's result (or error), the plan closed: committed on success,
        aborted otherwise. PassInterrupted propagates: in a chunk it leaves the plan as before the chunk (open), in
        the last passes it closes it."""
        try:
            return plan.advance(self.decoder, lambda: self._finish_chunked(p, plan))
        except PassInterrupted:
            raise
        except Exception as e:
            plan.close(ok=False)
            return e

    def run_chunked(self, p: PreparedScore, plan: ChunkedPrefill) -> ScoreResult | Exception:
        """Every step of `advance_chunked` in one go."""
        try:
            while (result := self.advance_chunked(p, plan)) is None:
                pass
        except PassInterrupted:
            plan.close(ok=False)
            raise
        return result

    def _finish_chunked(self, p: PreparedScore, plan: ChunkedPrefill) -> ScoreResult:
        rows: list[list[list[list[float]]]] = [[[] for _ in p.items]]
        cached = [-plan.computed]  # the query blocks this request computed in its chunks were not cached
        try:
            for units in self._passes([p], skip=plan.end):
                self._run_pass(units, [p], rows, cached, plan)
        except BaseException:
            plan.close(ok=False)
            raise
        plan.close(ok=True)
        return self._result(p, rows[0], cached[0])

    def _branch_pass(self, prepared: Sequence[PreparedScore]) -> list[int]:
        """A hybrid model's queries that share a part the cache holds without states, or that batch-mates share,
        get it computed once, in a pass before theirs (pyscore.branch_points). Returns per request the query tokens
        that pass computed for it."""
        return branch_points.run(self.decoder, self.prefix_cache, [
            Head(p.query, len(p.query), p.request.prefix_cache_salt)
            if p.items and p.query and not p.request.item_first and not p.request.bypass_prefix_cache else None
            for p in prepared])  # (the requests whose query a pass caches: _with_cache)

    def _passes(self, prepared: Sequence[PreparedScore], skip: int = 0) -> list[list[tuple[int, int, Group]]]:
        """Units (request, first item index, group) in arrival order, cut into passes of at most
        max_batch_tokens; a unit larger than the budget runs alone. skip: prefix tokens already in the cache
        (a chunked request's), which take no room in a pass. A hybrid model's later groups of a request come in
        passes after the first groups' (`_resumes_next_pass`)."""
        units, later = [], []
        for r, p in enumerate(prepared):
            first = 0
            for k, group in enumerate(p.groups()):
                (later if k and not skip and self._resumes_next_pass(p, group) else units).append((r, first, group))
                first += len(group.items)
        return self._cut(units, skip) + self._cut(later, skip)

    def _resumes_next_pass(self, p: PreparedScore, group: Group) -> bool:
        """Whether a request's later group (SIS candidates, MIS item groups: the same query as its first group)
        runs in a pass after its first group's: a hybrid model's cached blocks can be resumed only from the states
        a pass publishes when it ends, so in the same pass it would compute the whole query again."""
        cache = self.prefix_cache
        return bool(cache is not None and cache.state_pages and group.prefix and not p.request.bypass_prefix_cache)

    def _cut(self, units: list[tuple[int, int, Group]], skip: int) -> list[list[tuple[int, int, Group]]]:
        sizes = [len(g.prefix) - min(skip, len(g.prefix)) + sum(len(i) for i in g.items) for _, _, g in units]
        passes = []
        while units:
            n = count_within_budget(sizes, self.max_batch_tokens)
            passes.append(units[:n])
            units, sizes = units[n:], sizes[n:]
        return passes

    def _run_pass(self, chunk: list[tuple[int, int, Group]], prepared: Sequence[PreparedScore],
                  rows: list[list[list[list[float]]]], cached: list[int], plan: ChunkedPrefill | None = None) -> None:
        """One forward pass over the chunk's groups; the prefix cache's blocks it reads stay pinned and the ones
        it writes become visible to later passes only once its scores are out. With `plan` (a chunked request's
        last passes) the groups read the plan's blocks, which its own lease holds."""
        with pass_lease(None if plan else self.prefix_cache) as lease:
            groups = [replace(g, cache=plan.read_all()) if plan else self._with_cache(lease, prepared[r], g)
                      for r, _, g in chunk]
            batch = pack(groups)
            sink = self.prefix_cache.writer(batch.block_writes) if self.prefix_cache else None
            hidden = self.decoder.hidden_at(batch, kv_sink=sink, blocks=self.prefix_cache)  # [R, H]
            request_of_row = [r for (r, _, g), group_rows in zip(chunk, batch.rows, strict=True)
                              for item_rows in group_rows for _ in item_rows]
            values = self._row_scores(hidden, [prepared[r] for r in request_of_row])
        for (r, first, _), group, group_rows in zip(chunk, groups, batch.rows, strict=True):
            cached[r] += group.cached_tokens
            for i, item_rows in enumerate(group_rows):
                rows[r][first + i] = [values[j] for j in item_rows]

    def _with_cache(self, lease: CacheLease | None, p: PreparedScore, group: Group) -> Group:
        """The group with its prefix-cache blocks: the query's leading full blocks are read where cached and
        written where not. Only causally computed query tokens are cached: a group's prefix, which is the query in
        MIS and SIS (PreparedScore.groups); an item_first sequence has none; never item tokens."""
        if lease is None or p.request.bypass_prefix_cache or not group.prefix:
            return group
        return replace(group, cache=lease.use(group.prefix, len(p.query), len(p.query), p.request.prefix_cache_salt))

    def _row_scores(self, hidden: torch.Tensor, owners: list[PreparedScore]) -> list[list[float]]:
        """Per read-out row, its request's label scores: label probabilities (apply_softmax false: the LM head's
        whole vocabulary is walked for their log-sum-exp) or the softmax over the labels alone, which needs only
        the labels' logits (`_label_softmax`)."""
        if self.cfg.is_classifier:
            return self._class_scores(hidden, owners, _label_table(owners))
        out: list[list[float]] = [[] for _ in owners]
        full = [j for j, p in enumerate(owners) if not p.request.apply_softmax]
        if full:
            chosen = [owners[j] for j in full]
            logprobs, _ = label_logprobs(hidden[full], self.decoder.w.lm_head, _label_table(chosen),
                                         backend=self.decoder.op_backend)
            for j, p, row in zip(full, chosen, logprobs.exp().cpu(), strict=True):
                out[j] = row[: len(p.labels)].tolist()
        by_labels: dict[tuple[int, ...], list[int]] = {}
        for j, p in enumerate(owners):
            if p.request.apply_softmax:
                by_labels.setdefault(tuple(p.labels), []).append(j)
        for labels, rows in by_labels.items():
            for j, row in zip(rows, self._label_softmax(hidden[rows], labels), strict=True):
                out[j] = row.tolist()
        return out

    def _label_softmax(self, hidden: torch.Tensor, labels: tuple[int, ...]) -> torch.Tensor:
        """[R, len(labels)] softmax over the labels' logits: the label kernel over an LM head of the label rows
        alone instead of the vocabulary (SmolLM2's 49k rows took 2.8 ms of a 16-candidate MIS on the AMX host;
        Qwen3's 152k rows are 311 MB (0.6B) to 1.24 GB (8B) of bf16 a pass). One call per label set: the call's
        vocabulary is the request's own labels, and the kernel computes each row independently of the others
        (csrc/label_logprobs/label_logprobs.h), so a row's bits never depend on its batch-mates."""
        ids = torch.tensor(labels, dtype=torch.long, device=hidden.device)
        head = self.decoder.w.lm_head.index_select(0, ids)  # [L, H]
        local = torch.arange(len(labels), dtype=torch.int32).expand(hidden.shape[0], -1)
        _, softmax = label_logprobs(hidden, head, local, backend=self.decoder.op_backend)
        return softmax.cpu()

    def _class_scores(self, hidden: torch.Tensor, owners: list[PreparedScore], labels: torch.Tensor):
        w = self.decoder.w
        logits = hidden.float() @ w.score_head.float().T  # [R, C]
        if w.score_bias is not None:
            logits = logits + w.score_bias.float()
        logits = logits.cpu()
        out = []
        for j, p in enumerate(owners):
            chosen = logits[j, labels[j, : len(p.labels)].long()]
            out.append((chosen.softmax(-1) if p.request.apply_softmax else chosen).tolist())
        return out

    @staticmethod
    def _result(p: PreparedScore, rows: list[list[list[float]]], cached: int) -> ScoreResult:
        return ScoreResult(scores=rows, label_token_ids=list(p.labels), mode=p.mode,
                           usage=Usage(prompt_tokens=p.prompt_tokens,
                                       computed_tokens=p.computed_tokens - cached if p.items else 0,
                                       cached_tokens=cached))

    # --- generation (pyscore.generation.GenerationRunner does the stepping) -------------------------------
    def start_generation(self, request: GenerateRequest) -> Generation:
        return self.generation.start(request)

    def check_kv(self, generation: Generation) -> None:
        """Refuses (ResourceExhausted, naming --kv-cache-mb) a generation that could never fit the KV store."""
        self.generation.check_admissible(generation)

    def reserve_kv(self, generation: Generation) -> bool:
        """Admits `generation` now if its prompt + max_tokens fit the KV store beside the admitted ones' (the one
        ledger: pyscore.model.kv_store.Reservations); False: it waits."""
        return self.generation.reserve(generation)

    def step(self, generations: Sequence[Generation]) -> None:
        """Advances every unfinished generation by one token; a sequence whose step fails is marked failed
        (`Generation.error`) without failing its batch-mates. An interrupted pass raises PassInterrupted; the
        generations are then as before the pass that stopped."""
        self.generation.step(list(generations))

    def generate(self, request: GenerateRequest) -> GenerateResult:
        return self.generation.generate(request)
