"""Generation: a sequence's state (waiting for its prefill, running with a KV cache, finished) and the runner
that steps sequences over the decoder (prefill, decode, cache bookkeeping). A sequence's keys and values are pages
of the paged KV store (pyscore.model.kv_store): a prompt's leading full blocks found in the prefix cache are
referenced in place (pinned, never copied) and only the rest is prefilled, into the prompt's full blocks that the
prefix cache takes (published once the pass succeeded, as every cache write) and pages the sequence owns; decode
takes a new page every `block_tokens` tokens (16 on the CPU). A finished sequence gives its own pages back and
unpins its shared ones. A prompt longer than the prefill budget is prefilled in chunks (pyscore.chunked_prefill)
into the prefix cache's blocks, one chunk per step, so running sequences keep decoding meanwhile; its table then
references those blocks. Like the engine, the runner is not thread-safe.

Its parts live beside it: request validation in `pyscore.gen_validate`, the stop-string and streaming text rule
in `pyscore.gen_text`, the next-token choice (sampling, raw-distribution logprobs) in `pyscore.gen_sampling`.
Their public names are importable from here too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pyscore import branch_points, chunked_prefill
from pyscore.branch_points import Head
from pyscore.chunked_prefill import ChunkedPrefill
from pyscore.errors import FailedPrecondition, PassInterrupted
from pyscore.gen_sampling import Choice, NonFiniteLogits, choose_tokens, prompt_token_logprobs
from pyscore.gen_text import StopText
from pyscore.gen_validate import MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, validate_generate
from pyscore.model.decoder import Decoder, KVCache
from pyscore.model.kv_store import KVStore, PageTable, Reservation
from pyscore.model.packing import CacheUse, Group, pack
from pyscore.model.prefix_cache import Block, CacheLease, PrefixCache, pass_lease
from pyscore.ops.label_logprobs import lm_head_logits
from pyscore.types import GenerateRequest, GenerateResult, TokenLogprob, Usage

__all__ = ["MAX_STOP_LENGTH", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "Choice", "Generation", "GenerationRunner",
           "NonFiniteLogits", "SeqState", "choose_tokens", "eos_token_ids", "validate_generate"]


class SeqState(enum.Enum):
    """Where a sequence is: WAITING for its prefill (no KV cache yet), RUNNING (decodes against `cache`), or
    FINISHED (`finish_reason` says why; its pages are released)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Generation:
    request: GenerateRequest
    prompt: list[int]
    tokenizer: Any
    eos_ids: frozenset[int]
    generator: torch.Generator | None
    state: SeqState = SeqState.WAITING
    cache: KVCache | None = None  # set exactly while RUNNING
    finish_reason: str | None = None
    error: Exception | None = None  # set when this sequence failed; its batch-mates go on
    cached_tokens: int = 0  # prompt tokens the prefill read from the prefix cache
    chunks: ChunkedPrefill | None = None  # while a long prompt is prefilled in chunks (still WAITING)
    computed: int = 0  # tokens generated (an ending stop_token excluded), including any cut off by a stop string
    prompt_logprobs: list[TokenLogprob] | None = None  # set by the prefill when the request asks for them
    prompt_logprobs_taken: bool = False  # a stream has carried them (in its first delta)
    reservation: Reservation | None = None  # the KV-store tokens it was admitted with (GenerationRunner.reserve)
    stop_token: TokenLogprob | None = None  # the end-of-sequence / stop_token_ids token that ended it
    out: StopText = field(init=False)  # the result's tokens and text (see pyscore.gen_text's rule)
    stop_ids: frozenset[int] = field(init=False)  # the request's stop_token_ids

    def __post_init__(self) -> None:
        self.out = StopText(self.request.stop, self.tokenizer)
        self.stop_ids = frozenset(self.request.stop_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.out.token_ids

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.out.logprobs

    @property
    def text(self) -> str:
        return self.out.text

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED

    def run_with(self, cache: KVCache) -> None:
        """The sequence's first pass succeeded: it now decodes against `cache`."""
        self.cache, self.state = cache, SeqState.RUNNING

    def _finish(self, reason: str) -> None:
        self.finish_reason = self.finish_reason or reason
        if self.cache is not None:
            self.cache.release()  # its pages go back as soon as the sequence ends
        self.state, self.cache = SeqState.FINISHED, None
        self._unreserve()

    def _unreserve(self) -> None:
        if self.reservation is not None:
            self.reservation.release()

    def fail(self, error: Exception) -> None:
        """Marks the generation finished without a result (its request failed); frees the cache."""
        self.error = error
        self.abandon()
        self._finish("error")

    def end_at_prompt(self) -> None:
        """max_tokens 0: the prefill read the prompt's logprobs and no token is chosen; the sequence ends there."""
        self._finish("length")

    def abandon(self) -> None:
        """Nobody wants this sequence any more: a prompt being prefilled in chunks gives its cache blocks back
        unpublished, and its KV reservation is given back. The caller stops stepping it."""
        if self.chunks is not None:
            self.chunks.close(ok=False)
        self._unreserve()

    def append(self, token: int, logprob: TokenLogprob) -> None:
        """Records the chosen token and decides whether generation is over (eos / stop / length). An
        end-of-sequence id (checked first, as vLLM checks its EOS before its stop_token_ids) or a stop_token_ids
        entry ends it as the result's stop_token, kept out of its text, tokens and logprobs."""
        if token in self.eos_ids or token in self.stop_ids:
            self.stop_token = logprob
            self._finish("eos" if token in self.eos_ids else "stop")
            return
        self.computed += 1
        if self.out.add(token, logprob):
            self._finish("stop")
        elif len(self.out.token_ids) >= self.request.max_tokens:
            self._finish("length")

    def take_delta(self) -> tuple[list[int], list[TokenLogprob], str]:
        """What became final since the last call (pyscore.gen_text's streaming rule)."""
        return self.out.take_delta(self.finished)

    def take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's logprob entries the first time they are there, then None (a stream sends them once)."""
        if self.prompt_logprobs is None or self.prompt_logprobs_taken:
            return None
        self.prompt_logprobs_taken = True
        return self.prompt_logprobs

    def result(self) -> GenerateResult:
        return GenerateResult(text=self.text, token_ids=list(self.token_ids), logprobs=list(self.logprobs),
                              finish_reason=self.finish_reason or "length",
                              usage=Usage(prompt_tokens=len(self.prompt),
                                          computed_tokens=len(self.prompt) - self.cached_tokens + self.computed,
                                          cached_tokens=self.cached_tokens),
                              prompt_logprobs=self.prompt_logprobs, stop_token=self.stop_token,
                              stop_string=self.out.matched)


def eos_token_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a generation: the model config's eos_token_id (an int or a list; a Qwen3.5 image-text
    config keeps it in its text config) and the tokenizer's."""
    eos = getattr(hf_config.get_text_config(), "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class GenerationRunner:
    """Steps generations over the decoder: new sequences are prefilled together in one packed pass of at most
    `max_prefill_tokens` prompt tokens (taken in arrival order; one larger prompt alone; the others wait for
    the next step), running ones decode together against their KV caches, and each then gets its next token.
    A prompt larger than the budget is prefilled in chunks of `prefill_chunk_tokens` (default: the budget) when
    the prefix cache can hold it: one chunk per step (one prompt at a time; the other new prompts prefill beside
    it as usual), then its last pass alone.
    A pass that fails is retried one sequence at a time, so only the failing sequence fails
    (`Generation.error`). How many sequences run at once is the caller's bound (server/scheduler admits them
    against --max-running-generations and, through `reserve`, the KV store's pages, prompt + max_tokens each: then
    a page is always there when a sequence needs one; without that bound a sequence that finds none fails with
    KVStoreFull)."""

    def __init__(self, decoder: Decoder, tokenizer: Any, eos_ids: frozenset[int], max_prefill_tokens: int = 8192,
                 prefix_cache: PrefixCache | None = None, store: KVStore | None = None,
                 prefill_chunk_tokens: int | None = None) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_tokens = min(prefill_chunk_tokens or max_prefill_tokens, max_prefill_tokens)
        self.prefix_cache = prefix_cache
        if store is None:
            if prefix_cache is None:
                raise ValueError("a generation runner needs a KV store (or a prefix cache, whose store it uses)")
            store = prefix_cache.store
        self.store = store

    def start(self, request: GenerateRequest) -> Generation:
        """Validates and tokenizes the request; no model work (the first `step` prefills it)."""
        cfg = self.decoder.cfg
        if cfg.is_classifier:
            raise FailedPrecondition("model", "a sequence-classification model cannot generate")
        prompt = validate_generate(request, self.tokenizer, cfg.vocab_size, cfg.max_position_embeddings)
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=self.decoder.device).manual_seed(int(request.seed))
        return Generation(request=request, prompt=prompt, tokenizer=self.tokenizer, eos_ids=self.eos_ids,
                          generator=generator)

    def check_admissible(self, g: Generation) -> None:
        """Refuses (ResourceExhausted) a generation whose prompt + max_tokens could never fit the KV store."""
        self.store.reservations.check(len(g.prompt) + g.request.max_tokens)

    def reserve(self, g: Generation) -> bool:
        """Admits `g` if its prompt + max_tokens (whole pages) fit the KV store beside what the admitted
        generations reserve; held until it finishes or is abandoned. False: not now."""
        g.reservation = g.reservation or self.store.reservations.take(len(g.prompt) + g.request.max_tokens)
        return g.reservation is not None

    def step(self, generations: list[Generation]) -> None:
        """Advances every running generation by one token and prefills (which yields the first token) as many
        new ones as the prefill budget allows."""
        new = [g for g in generations if g.state is SeqState.WAITING]
        running = [g for g in generations if g.state is SeqState.RUNNING]
        new = self._advance_chunked(new)
        prefill = self._within_prefill_budget(new)
        if prefill:
            self._together_or_alone(self._prefill, prefill)
        if running:
            self._together_or_alone(self._decode, running)

    def _advance_chunked(self, new: list[Generation]) -> list[Generation]:
        """Advances the prompt being prefilled in chunks by one chunk (or, every chunk done, runs its last prefill
        pass alone), first planning one for the first new prompt larger than the budget if none is under way.
        Returns the new sequences left to prefill as usual: the others, and a long prompt that cannot be chunked
        (it runs alone as one pass); while one is chunked, other long prompts wait."""
        long = next((g for g in new if g.chunks is not None), None)
        if long is None:
            long = next((g for g in new if len(g.prompt) > self.max_prefill_tokens), None)
            if long is None or not self._plan_chunks(long):
                return new
        assert long.chunks is not None
        try:  # (its last pass retries alone itself: _together_or_alone)
            long.chunks.advance(self.decoder, lambda: self._together_or_alone(self._prefill, [long]))
        except PassInterrupted:
            raise
        except Exception as e:
            long.fail(e)
        return [g for g in new if g is not long and len(g.prompt) <= self.max_prefill_tokens]

    def _plan_chunks(self, g: Generation) -> bool:
        """A prompt that bypasses the cache runs as one pass: its sequence's table would reference the chunks'
        private blocks, which the end of the chunking drops (they are never published). So does one asking for its
        prompt's logprobs: the positions read out must be in the pass."""
        n, r = len(g.prompt), g.request
        if r.bypass_prefix_cache or r.prompt_logprobs is not None:
            return False
        g.chunks = chunked_prefill.plan(self.prefix_cache, g.prompt, n - 1, self.chunk_tokens, r.prefix_cache_salt)
        return g.chunks is not None

    def _within_prefill_budget(self, new: list[Generation]) -> list[Generation]:
        """The longest arrival-order prefix of `new` whose prompts fit max_prefill_tokens (at least one)."""
        taken, tokens = [], 0
        for g in new:
            if taken and tokens + len(g.prompt) > self.max_prefill_tokens:
                break
            taken.append(g)
            tokens += len(g.prompt)
        return taken

    def generate(self, request: GenerateRequest) -> GenerateResult:
        gen = self.start(request)
        while not gen.finished:
            self.step([gen])
        if gen.error is not None:
            raise gen.error
        return gen.result()

    @staticmethod
    def _together_or_alone(run: Any, gens: list[Generation]) -> None:
        """run(gens) as one batch; if that raises, each alone, so only the failing sequence fails. Safe to
        retry: a pass commits nothing (no cache length, no token) until it has succeeded, and a retried pass
        rewrites the same KV slots."""
        try:
            run(gens)
        except PassInterrupted:
            raise  # asked to stop, not a failure: nothing is committed, the sequences are as before
        except Exception as e:
            if len(gens) == 1:
                gens[0].fail(e)
                return
            for g in gens:
                try:
                    run([g])
                except PassInterrupted:
                    raise
                except Exception as e_alone:
                    g.fail(e_alone)

    @staticmethod
    def _readouts(g: Generation) -> list[int]:
        """The prompt positions whose output the prefill reads: the last (the first token's distribution), and,
        when the request asks for the prompt's logprobs, every one from the token before prompt_logprobs_start."""
        n, r = len(g.prompt), g.request
        return list(range(max(r.prompt_logprobs_start, 1) - 1, n)) if r.prompt_logprobs is not None else [n - 1]

    def _prefill(self, gens: list[Generation]) -> None:
        """One packed pass over the new sequences' prompts (`_prefill_pass`), the prompt logprobs of those that ask
        for them, then each sequence's first token (none for max_tokens 0: it ends there). A cache no sequence took
        (its token failed, or this raised) gives its pages back. A hybrid model's prompts first get the parts they
        share with the cache's blocks or with each other computed once (pyscore.branch_points)."""
        branched = self._branch_pass(gens)
        hidden, kv, skips, rows = self._prefill_pass(gens)

        def commit(c: KVCache, g: Generation) -> None:
            c.length = len(g.prompt)  # prefill wrote the linear layers' states into the cache's current ones

        try:
            logprobs = [None if g.request.prompt_logprobs is None else prompt_token_logprobs(
                hidden[r], g.prompt, g.request.prompt_logprobs_start, g.request.prompt_logprobs,
                self.decoder.w.lm_head, self.decoder.op_backend, self.tokenizer)
                for g, r in zip(gens, rows, strict=True)]
            for g, skip, lps, own in zip(gens, skips, logprobs, branched, strict=True):
                # reported only if the sequence gets its first token (else it failed); a chunked prompt's blocks
                # and a branch computed for it were computed by this sequence, not cached
                g.cached_tokens = skip - (g.chunks.computed if g.chunks else 0) - own
                g.prompt_logprobs = lps
            going = [i for i, g in enumerate(gens) if g.request.max_tokens > 0]
            if going:
                self._commit([gens[i] for i in going], hidden[[rows[i][-1] for i in going]],
                             [kv[i] for i in going], commit)
            for g in gens:
                if g.request.max_tokens == 0:
                    g.end_at_prompt()
        finally:
            for g, c in zip(gens, kv, strict=True):
                if g.cache is not c:
                    c.release()
        for g in gens:  # (a _commit that raised leaves them open: the pass is retried one sequence at a time)
            if g.chunks is not None:
                g.chunks.close(ok=g.error is None)  # published once its first token is chosen; its table holds them

    def _branch_pass(self, gens: list[Generation]) -> list[int]:
        """The branch pass of the prompts that cache their blocks (not chunked, not bypassing the cache); per
        prompt the tokens it computed for it."""
        return branch_points.run(self.decoder, self.prefix_cache, [
            Head(g.prompt, self._readouts(g)[0], g.request.prefix_cache_salt)
            if g.chunks is None and not g.request.bypass_prefix_cache else None for g in gens])

    def _prefill_pass(self, gens: list[Generation]) -> tuple[torch.Tensor, list[KVCache], list[int], list[list[int]]]:
        """With the prefix cache a prompt's leading full blocks (leaving at least its last token, whose output
        chooses the first token) are read in place from the cache; the prompt's other full blocks are written into
        blocks the cache takes, visible to later passes once this one succeeded (they hold the prompt's keys
        whatever token is chosen next). The sequence's block table starts with these blocks; the rest of its prompt
        goes into pages it owns. Returns the final hidden states at the read-out rows, the caches, the tokens read
        from the cache and each sequence's read-out rows (`_readouts`' positions, in order)."""
        cache = self.prefix_cache
        with pass_lease(cache) as lease:
            kv: list[KVCache] = []
            try:
                groups, shared = [], []
                for g in gens:
                    use, blocks = self._cache_use(lease, g)
                    groups.append(Group(prefix=[], items=[g.prompt], readouts=[self._readouts(g)], cache=use))
                    shared.append(len(blocks))
                    kv.append(self.decoder.new_cache(PageTable(self.store, cache, blocks)))
                    kv[-1].reserve(len(g.prompt))
                batch = pack(groups)
                skips = [group.cached_tokens for group in groups]
                starts = batch.segments[:, 0].tolist()
                b = self.store.block_tokens
                firsts = [n * b for n in shared]  # the rest of each prompt goes into the sequence's own pages
                to_pages = self.store.writer([c.table.pages for c in kv],
                                             [s + f - k for s, f, k in zip(starts, firsts, skips, strict=True)],
                                             firsts, [len(g.prompt) - f for g, f in zip(gens, firsts, strict=True)])
                to_pool = cache.writer(batch.block_writes) if cache else None

                def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                    to_pages(layer, k, v)
                    if to_pool is not None:
                        to_pool(layer, k, v)

                hidden = self.decoder.hidden_at(batch, kv_sink=sink, linear_states=kv,
                                                blocks=self.store if cache is None else cache)
            except BaseException:
                for c in kv:  # before the lease drops the blocks it wrote
                    c.release()
                raise
        return hidden, kv, skips, [rows[0] for rows in batch.rows]

    def _cache_use(self, lease: CacheLease | None, g: Generation) -> tuple[CacheUse | None, list[Block]]:
        """The prompt's use of the cache (read: the cached blocks; write: the full blocks the cache takes) and the
        blocks its table starts with: the cached ones, then the ones it writes up to the first it could not."""
        n = len(g.prompt)
        if g.chunks is not None:  # its whole-block prompt, prefilled in chunks under its own lease
            return g.chunks.read_all(), list(g.chunks.blocks)
        if lease is None or g.request.bypass_prefix_cache:
            return None, []
        salt, limit = g.request.prefix_cache_salt, self._readouts(g)[0]
        chain = lease.match(g.prompt, limit, salt)  # every position read out is computed
        written = lease.store(chain, g.prompt, n, salt)
        blocks = list(chain)
        for j, block in written:  # another pass's published block breaks the run: the rest is the sequence's
            if j != len(blocks):
                break
            blocks.append(block)
        state, snapshot = (), None
        if lease.cache.state_pages:  # a hybrid model: resume at the chain's states, keep the pass's in a block
            state = lease.cache.states_after(chain)
            snapshot = lease.snapshot(blocks, len(chain), limit)
        use = CacheUse(self.store.block_tokens, read=tuple(block.slot for block in chain),
                       write=tuple((j, block.slot) for j, block in written), state=state, snapshot=snapshot)
        return use, blocks

    def _decode(self, gens: list[Generation]) -> None:
        last = torch.tensor([g.token_ids[-1] for g in gens], dtype=torch.long)
        caches = [g.cache for g in gens]
        for c in caches:
            c.reserve(c.length + 1)  # a new page every block_tokens tokens (kept if the step is retried)
        hidden = self.decoder.decode(last, caches)  # writes slot `length` of each cache, commits nothing
        self._commit(gens, hidden, caches, lambda c, g: c.commit())

    def _commit(self, gens: list[Generation], hidden: torch.Tensor, caches: list[KVCache],
                commit: Callable[[KVCache, Generation], None]) -> None:
        """Chooses every sequence's next token from hidden [B, H]; only then commits, per sequence, its cache
        (`commit`: the pass's slot becomes valid, a hybrid model's new states current) and its token. A row whose
        choice failed fails that sequence alone; if this raises before the loop, nothing has changed and the
        pass can be retried."""
        # [B, V]: generation needs the whole distribution (on CPU the label read-out's walk, with each row's logZ)
        logits, logz = lm_head_logits(hidden, self.decoder.w.lm_head, self.decoder.op_backend)
        chosen = choose_tokens(logits, gens, self.tokenizer, logz)
        for g, cache, choice in zip(gens, caches, chosen, strict=True):
            if isinstance(choice, Exception):
                g.fail(choice)  # a running sequence's pages go back here; a new one's in _prefill
                continue
            commit(cache, g)
            g.run_with(cache)
            g.append(*choice)
