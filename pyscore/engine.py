"""pyscore.Engine: label scoring (SIS / MIS / setwise, causal LMs and classification heads) and generation
over the packed decoder. The engine knows nothing of gRPC: it takes and returns `pyscore.types` objects and
raises `pyscore.errors` for bad requests. It is not thread-safe: one worker owns it (see server/batcher)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pyscore.errors import FailedPrecondition, ScoreError
from pyscore.generation import Generation, choose_tokens, validate_generate
from pyscore.model.decoder import Decoder
from pyscore.model.loading import LoadedModel, load_model
from pyscore.model.packing import Group, pack
from pyscore.ops import _ext, label_logprobs
from pyscore.scoring import ModelTraits, PreparedScore, prepare_score
from pyscore.types import GenerateRequest, GenerateResult, ModelInfo, ScoreRequest, ScoreResult, Usage

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        cuda = _ext.cuda_module()
        usable = torch.cuda.is_available() and cuda is not None and cuda.available()
        return torch.device("cuda" if usable else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16  # AVX512-BF16 / AMX on CPUs, tensor cores on GPUs
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def set_threads(threads: int | None) -> None:
    threads = threads or int(os.environ.get("PYSCORE_THREADS", 0)) or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    cpu = _ext.cpu_module()
    if cpu is not None:
        cpu.set_num_threads(threads)


class Engine:
    def __init__(self, loaded: LoadedModel, max_batch_tokens: int = 8192, op_backend: str = "auto"):
        self.model = loaded
        self.cfg = loaded.cfg
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_batch_tokens = max_batch_tokens
        self.decoder = Decoder(loaded.cfg, loaded.weights, loaded.rotary, op_backend)
        self.traits = ModelTraits(tokenizer=loaded.tokenizer, vocab_size=loaded.cfg.vocab_size,
                                  max_context=loaded.cfg.max_position_embeddings,
                                  is_classifier=loaded.cfg.is_classifier, num_labels=loaded.cfg.num_labels,
                                  id2label=loaded.cfg.id2label)
        eos = getattr(loaded.hf_config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if loaded.tokenizer.eos_token_id is not None:
            eos_ids.add(loaded.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
                        device: str = "auto", threads: int | None = None, max_batch_tokens: int = 8192,
                        op_backend: str = "auto") -> Engine:
        """model: a local HF directory, a .gguf file, or None for the embedded SmolLM2-135M-Instruct."""
        set_threads(threads)
        dev = resolve_device(device)
        return cls(load_model(model, resolve_dtype(dtype, dev), dev), max_batch_tokens, op_backend)

    # --- model facts ---------------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        tok = self.tokenizer
        special = {k: str(v) for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
        return ModelInfo(name=self.model_name, architecture=self.cfg.architecture,
                         kind="classifier" if self.cfg.is_classifier else "causal_lm",
                         vocab_size=self.cfg.vocab_size, max_context=self.cfg.max_position_embeddings,
                         dtype=str(self.decoder.dtype).removeprefix("torch."), device=str(self.decoder.device),
                         special_tokens=special, num_labels=self.cfg.num_labels)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        """Token ids and each token's text: its decoding alone (" Yes", not the BPE piece "ĠYes"), the same
        convention as generation's logprobs and what a label string must be."""
        ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        return ids, [self.tokenizer.decode([i]) for i in ids]

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
            except ScoreError as e:
                prepared.append(e)
        valid = [p for p in prepared if isinstance(p, PreparedScore)]
        results = iter(self.run_prepared(valid))
        return [p if isinstance(p, Exception) else next(results) for p in prepared]

    def run_prepared(self, prepared: Sequence[PreparedScore]) -> list[ScoreResult | Exception]:
        """Packs all requests' groups into as few forward passes as the token budget allows. If a pass fails,
        its requests are retried one by one so a single bad request cannot fail its batch-mates."""
        rows: list[list[list[list[float]]]] = [[[] for _ in p.items] for p in prepared]
        errors: dict[int, Exception] = {}
        for chunk in self._passes(prepared):
            try:
                self._run_pass(chunk, prepared, rows)
            except Exception as e:
                if len({r for r, _, _ in chunk}) == 1:
                    errors[chunk[0][0]] = e
                    continue
                for r in sorted({r for r, _, _ in chunk}):
                    try:
                        self._run_pass([u for u in chunk if u[0] == r], prepared, rows)
                    except Exception as e2:
                        errors[r] = e2
        return [errors.get(r) or self._result(p, rows[r]) for r, p in enumerate(prepared)]

    def _passes(self, prepared: Sequence[PreparedScore]) -> list[list[tuple[int, int, Group]]]:
        """Units (request, first item index, group) in arrival order, cut into passes of at most
        max_batch_tokens; a unit larger than the budget runs alone."""
        passes, current, used = [], [], 0
        for r, p in enumerate(prepared):
            first = 0
            for group in p.groups():
                size = len(group.prefix) + sum(len(i) for i in group.items)
                if current and used + size > self.max_batch_tokens:
                    passes.append(current)
                    current, used = [], 0
                current.append((r, first, group))
                used += size
                first += len(group.items)
        if current:
            passes.append(current)
        return passes

    def _run_pass(self, chunk: list[tuple[int, int, Group]], prepared: Sequence[PreparedScore],
                  rows: list[list[list[list[float]]]]) -> None:
        batch = pack([g for _, _, g in chunk])
        hidden = self.decoder.hidden_at(batch)  # [R, H]
        request_of_row = [r for (r, _, g), group_rows in zip(chunk, batch.rows, strict=True)
                          for item_rows in group_rows for _ in item_rows]
        values = self._row_scores(hidden, [prepared[r] for r in request_of_row])
        for (r, first, _), group_rows in zip(chunk, batch.rows, strict=True):
            for i, item_rows in enumerate(group_rows):
                rows[r][first + i] = [values[j] for j in item_rows]

    def _row_scores(self, hidden: torch.Tensor, owners: list[PreparedScore]) -> list[list[float]]:
        """Per read-out row, its request's label scores (label probabilities or label-only softmax)."""
        width = max(len(p.labels) for p in owners)
        labels = torch.full((len(owners), width), -1, dtype=torch.int32)
        for j, p in enumerate(owners):
            labels[j, : len(p.labels)] = torch.tensor(p.labels, dtype=torch.int32)
        if self.cfg.is_classifier:
            return self._class_scores(hidden, owners, labels)
        lm_head = self.decoder.w.lm_head
        logprobs, label_softmax = label_logprobs(hidden, lm_head, labels, backend=self.decoder.op_backend)
        probs, label_softmax = logprobs.exp().cpu(), label_softmax.cpu()
        return [(label_softmax[j] if p.request.apply_softmax else probs[j])[: len(p.labels)].tolist()
                for j, p in enumerate(owners)]

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
    def _result(p: PreparedScore, rows: list[list[list[float]]]) -> ScoreResult:
        return ScoreResult(scores=rows, label_token_ids=list(p.labels), mode=p.mode,
                           usage=Usage(prompt_tokens=p.prompt_tokens,
                                       computed_tokens=p.compute_tokens if p.items else 0))

    # --- generation ----------------------------------------------------------------------------------
    def start_generation(self, request: GenerateRequest) -> Generation:
        if self.cfg.is_classifier:
            raise FailedPrecondition("model", "a sequence-classification model cannot generate")
        prompt = validate_generate(request, self.tokenizer, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=self.decoder.device).manual_seed(int(request.seed))
        return Generation(request=request, prompt=prompt, tokenizer=self.tokenizer, eos_ids=self.eos_ids,
                          generator=generator)

    def step(self, generations: Sequence[Generation]) -> None:
        """Advances every unfinished generation by one token: new ones are prefilled together in one packed
        pass, running ones decode together against their KV caches. A sequence whose step fails is marked
        failed (`Generation.error`) without failing its batch-mates."""
        new = [g for g in generations if not g.finished and g.cache is None and not g.token_ids]
        running = [g for g in generations if not g.finished and g.cache is not None and g not in new]
        if new:
            self._together_or_alone(self._prefill, new)
        if running:
            self._together_or_alone(self._decode, running)

    @staticmethod
    def _together_or_alone(run, gens: list[Generation]) -> None:
        """run(gens) as one batch; if that raises, each alone, so only the failing sequence fails. Safe to
        retry: a failed pass leaves no token appended and rewrites the same KV cache slots."""
        try:
            run(gens)
        except Exception as e:
            if len(gens) == 1:
                gens[0].fail(e)
                return
            for g in gens:
                try:
                    run([g])
                except Exception as e_alone:
                    g.fail(e_alone)

    def _decode(self, gens: list[Generation]) -> None:
        last = torch.tensor([g.token_ids[-1] for g in gens], dtype=torch.long)
        self._append(gens, self.decoder.decode(last, [g.cache for g in gens]))

    def _prefill(self, gens: list[Generation]) -> None:
        batch = pack([Group(prefix=[], items=[g.prompt], readouts=[[len(g.prompt) - 1]]) for g in gens])
        for g in gens:
            g.cache = self.decoder.new_cache(len(g.prompt) + g.request.max_tokens)
        starts = batch.segments[:, 0].tolist()

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for g, s in zip(gens, starts, strict=True):
                n = len(g.prompt)
                g.cache.k[layer, :n] = k[s : s + n]
                g.cache.v[layer, :n] = v[s : s + n]

        hidden = self.decoder.hidden_at(batch, kv_sink=sink)
        for g in gens:
            g.cache.length = len(g.prompt)
        self._append(gens, hidden)

    def _append(self, gens: list[Generation], hidden: torch.Tensor) -> None:
        logits = hidden @ self.decoder.w.lm_head.T  # [B, V]: generation needs the whole distribution
        chosen = choose_tokens(logits, gens, self.tokenizer)  # all chosen before any is appended (retry-safe)
        for g, (token, logprob) in zip(gens, chosen, strict=True):
            g.append(token, logprob)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        gen = self.start_generation(request)
        while not gen.finished:
            self.step([gen])
        if gen.error is not None:
            raise gen.error
        return gen.result()

