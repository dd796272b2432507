"""Generation: validation of a GenerateRequest, the per-sequence state (KV cache, emitted tokens, stop handling,
streamed deltas), the next-token choice with top-k logprobs, and the runner that steps sequences over the
decoder (prefill, decode, token choice, cache bookkeeping). A prompt's leading full blocks found in the prefix
cache are copied into the sequence's KV cache and only the rest is prefilled; the blocks it computes are offered to
the prefix cache. Reported logprobs are those of the model's raw distribution (before temperature / top-k /
top-p). Like the engine, the runner is not thread-safe.

Stop strings. Generation ends at the first occurrence of any stop string in the generated text: `text` is
everything before it (the stop string is not included); `token_ids` and `logprobs` are the fewest generated
tokens whose text covers `text` — the last one may reach into the stop string, none begins at or after it.
An end-of-sequence token is never part of the result. Streamed chunks carry exactly these tokens and this
text, in order, and each chunk's text is what its tokens add (a token is held back until its text is final:
not an incomplete UTF-8 character, and not possibly the start of a stop string), except that the last chunk
of a stopped generation ends its text at the stop.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pyscore.errors import FailedPrecondition, InvalidArgument, PassInterrupted
from pyscore.model.decoder import Decoder, KVCache
from pyscore.model.packing import Group, pack
from pyscore.model.prefix_cache import PrefixCache, pass_lease
from pyscore.types import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    GenerateRequest,
    GenerateResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def validate_generate(req: GenerateRequest, tokenizer: Any, vocab_size: int, max_context: int) -> list[int]:
    """Checks every field and returns the prompt's token ids."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidArgument("prompt", "give prompt or prompt_token_ids, not both")
    if not req.prompt and not req.prompt_token_ids:
        raise InvalidArgument("prompt", "is empty: give prompt or prompt_token_ids")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise InvalidArgument("temperature", f"must be a finite number >= 0, got {req.temperature}")
    if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
        raise InvalidArgument("top_p", f"must be in (0, 1], got {req.top_p}")
    if req.top_k < 0:
        raise InvalidArgument("top_k", f"must be >= 0 (0 = off), got {req.top_k}")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    if any(not s or len(s) > MAX_STOP_LENGTH for s in req.stop):
        raise InvalidArgument("stop", f"stop strings must be 1..{MAX_STOP_LENGTH} characters")
    if req.prompt_token_ids:
        if req.apply_chat_template:
            raise InvalidArgument("apply_chat_template", "applies to a text prompt, not prompt_token_ids")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument("prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        prompt = [int(t) for t in req.prompt_token_ids]
    elif req.apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise FailedPrecondition("apply_chat_template", "this model's tokenizer has no chat template")
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": req.prompt}], tokenize=True,
                                                    add_generation_prompt=True, return_dict=False))
    else:
        prompt = list(tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
    if req.max_tokens <= 0:
        raise InvalidArgument("max_tokens", f"must be > 0, got {req.max_tokens}")
    if len(prompt) + req.max_tokens > max_context:
        raise InvalidArgument("max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                              f"exceeds the model's context of {max_context}")
    return prompt


@dataclass
class Generation:
    request: GenerateRequest
    prompt: list[int]
    tokenizer: Any
    eos_ids: frozenset[int]
    generator: torch.Generator | None
    cache: KVCache | None = None
    token_ids: list[int] = field(default_factory=list)  # the result's tokens (see the module's stop rule)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None  # set when this sequence failed; its batch-mates go on
    cached_tokens: int = 0  # prompt tokens the prefill read from the prefix cache
    text: str = ""
    computed: int = 0  # tokens generated (eos excluded), including any cut off by a stop string
    _covers: list[int] = field(default_factory=list)  # [i]: characters of text final after token_ids[: i + 1]
    _whole: list[bool] = field(default_factory=list)  # [i]: token_ids[: i + 1] ends on a whole character
    _sent_tokens: int = 0
    _sent_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, error: Exception) -> None:
        """Marks the generation finished without a result (its request failed); frees the cache."""
        self.error = error
        self.finish_reason = self.finish_reason or "error"
        self.cache = None

    def append(self, token: int, logprob: TokenLogprob) -> None:
        """Records the chosen token and decides whether generation is over (eos / stop / length)."""
        if token in self.eos_ids:
            self.finish_reason = "eos"
        else:
            self.computed += 1
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            final = self.text.rstrip("\ufffd")  # an incomplete UTF-8 tail is not final yet
            self._covers.append(len(final))
            self._whole.append(len(final) == len(self.text))
            cut = min((i for i in (self.text.find(s) for s in self.request.stop) if i >= 0), default=-1)
            if cut >= 0:
                self._stop_at(cut)
            elif len(self.token_ids) >= self.request.max_tokens:
                self.finish_reason = "length"
        if self.finished:
            self.cache = None  # free the KV cache as soon as the sequence ends

    def _stop_at(self, cut: int) -> None:
        """Ends the text at character `cut` and keeps the fewest tokens that cover it."""
        keep = bisect.bisect_left(self._covers, cut) + 1 if cut else 0
        del self.token_ids[keep:], self.logprobs[keep:], self._covers[keep:], self._whole[keep:]
        self.text, self.finish_reason = self.text[:cut], "stop"

    def take_delta(self) -> tuple[list[int], list[TokenLogprob], str]:
        """The tokens, their logprobs and the text that became final since the last call: tokens that end on a
        whole character before the last (longest stop - 1) characters, which might begin a stop string; on the
        last call, everything left."""
        if self.finished:
            tokens, chars = len(self.token_ids), len(self.text)
        else:
            hold = max((len(s) - 1 for s in self.request.stop), default=0)
            tokens = bisect.bisect_right(self._covers, self._covers[-1] - hold) if self._covers else 0
            while tokens > self._sent_tokens and not self._whole[tokens - 1]:
                tokens -= 1
            tokens = max(tokens, self._sent_tokens)
            chars = self._covers[tokens - 1] if tokens else 0
        delta = (self.token_ids[self._sent_tokens : tokens], self.logprobs[self._sent_tokens : tokens],
                 self.text[self._sent_chars : chars])
        self._sent_tokens, self._sent_chars = tokens, chars
        return delta

    def result(self) -> GenerateResult:
        return GenerateResult(text=self.text, token_ids=list(self.token_ids), logprobs=list(self.logprobs),
                              finish_reason=self.finish_reason or "length",
                              usage=Usage(prompt_tokens=len(self.prompt),
                                          computed_tokens=len(self.prompt) - self.cached_tokens + self.computed,
                                          cached_tokens=self.cached_tokens))


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


Choice = tuple[int, TokenLogprob]


def choose_tokens(logits: torch.Tensor, gens: list[Generation], tokenizer: Any) -> list[Choice | Exception]:
    """logits [B, V] (any dtype) -> per generation its next token and logprob entry, or the exception that
    fails that sequence alone (NonFiniteLogits for a NaN / inf row)."""
    logits = logits.float()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    logp = torch.log_softmax(logits, dim=-1)
    out: list[Choice | Exception] = []
    for row, gen in enumerate(gens):
        if not finite[row]:
            out.append(NonFiniteLogits(f"the model's logits for this sequence are not finite (NaN or inf) at "
                                       f"generated token {len(gen.token_ids) + 1}; its generation stopped"))
            continue
        out.append(_choose(logits[row], logp[row], gen.request, gen.generator, tokenizer))
    return out


def _choose(logits: torch.Tensor, logp: torch.Tensor, req: GenerateRequest, generator: torch.Generator | None,
            tokenizer: Any) -> Choice:
    """One row: the next token (greedy or sampled) and its logprob entry with the top alternatives."""
    if req.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        probs = _filtered_logits(logits, req).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    top = []
    if req.top_logprobs:
        values, ids = torch.topk(logp, req.top_logprobs)
        top = [TopLogprob(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids, strict=True)]
    return token, TokenLogprob(token, tokenizer.decode([token]), float(logp[token]), top)


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
    A pass that fails is retried one sequence at a time, so only the failing sequence fails
    (`Generation.error`). How many sequences run at once is the caller's bound (server/batcher admits them
    against --max-running-generations and --max-kv-tokens)."""

    def __init__(self, decoder: Decoder, tokenizer: Any, eos_ids: frozenset[int], max_prefill_tokens: int = 8192,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = prefix_cache

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

    def step(self, generations: list[Generation]) -> None:
        """Advances every running generation by one token and prefills (which yields the first token) as many
        new ones as the prefill budget allows."""
        new = [g for g in generations if not g.finished and g.cache is None]
        running = [g for g in generations if not g.finished and g.cache is not None]
        prefill = self._within_prefill_budget(new)
        if prefill:
            self._together_or_alone(self._prefill, prefill)
        if running:
            self._together_or_alone(self._decode, running)

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

    def _prefill(self, gens: list[Generation]) -> None:
        """One packed pass over the new sequences' prompts. With the prefix cache a prompt's leading full blocks
        (leaving at least its last token, whose output chooses the first token) are read from the cache and
        copied into the sequence's KV cache; the prompt's other full blocks are written to the cache, visible to
        later passes once this one succeeded (they hold the prompt's keys whatever token is chosen next)."""
        cache = self.prefix_cache
        with pass_lease(cache) as lease:
            groups = []
            for g in gens:
                n, use = len(g.prompt), None
                if lease is not None and not g.request.bypass_prefix_cache:
                    use = lease.use(g.prompt, n - 1, n, g.request.prefix_cache_salt)
                groups.append(Group(prefix=[], items=[g.prompt], readouts=[[n - 1]], cache=use))
            batch = pack(groups)
            kv = [self.decoder.new_cache(len(g.prompt) + g.request.max_tokens) for g in gens]
            skips = [group.cached_tokens for group in groups]
            starts = batch.segments[:, 0].tolist()
            to_pool = cache.writer(batch.block_writes) if cache else None

            def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                for g, c, s, skip in zip(gens, kv, starts, skips, strict=True):
                    n = len(g.prompt) - skip
                    c.k[layer, skip : skip + n] = k[s : s + n]
                    c.v[layer, skip : skip + n] = v[s : s + n]
                if to_pool is not None:
                    to_pool(layer, k, v)

            hidden = self.decoder.hidden_at(batch, kv_sink=sink, linear_states=kv, blocks=cache)
            if cache is not None:
                for c, group in zip(kv, groups, strict=True):
                    cache.read_into(group.cache.read if group.cache else (), c.k, c.v)
        for g, skip in zip(gens, skips, strict=True):
            g.cached_tokens = skip  # reported only if the sequence gets its first token (else it failed)

        def commit(c: KVCache, g: Generation) -> None:
            c.length = len(g.prompt)  # prefill wrote the linear layers' states into the cache's current ones

        self._commit(gens, hidden, kv, commit)

    def _decode(self, gens: list[Generation]) -> None:
        last = torch.tensor([g.token_ids[-1] for g in gens], dtype=torch.long)
        caches = [g.cache for g in gens]
        hidden = self.decoder.decode(last, caches)  # writes slot `length` of each cache, commits nothing
        self._commit(gens, hidden, caches, lambda c, g: c.commit())

    def _commit(self, gens: list[Generation], hidden: torch.Tensor, caches: list[KVCache],
                commit: Callable[[KVCache, Generation], None]) -> None:
        """Chooses every sequence's next token from hidden [B, H]; only then commits, per sequence, its cache
        (`commit`: the pass's slot becomes valid, a hybrid model's new states current) and its token. A row whose
        choice failed fails that sequence alone; if this raises before the loop, nothing has changed and the
        pass can be retried."""
        logits = hidden @ self.decoder.w.lm_head.T  # [B, V]: generation needs the whole distribution
        chosen = choose_tokens(logits, gens, self.tokenizer)
        for g, cache, choice in zip(gens, caches, chosen, strict=True):
            if isinstance(choice, Exception):
                g.fail(choice)
                continue
            commit(cache, g)
            g.cache = cache
            g.append(*choice)
