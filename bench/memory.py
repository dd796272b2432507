"""What serving a model costs in memory, two measurements, each recorded in bench/results/memory/ (`--out
bench/results/memory`; without it, bench/results/latest/memory):

- load (issue 20, memory.md): per model, a fresh child process imports torch and pyscore.engine, notes its RSS
  (the baseline), resets its peak (/proc/self/clear_refs), loads the model in bf16 and scores one 2-candidate MIS
  question: the peak RSS while loading (VmHWM) and the steady RSS after, above the baseline, against the targets
  peak <= 1.25 x weights + 0.5 GiB and steady <= 1.10 x weights + 0.5 GiB. Models: the embedded SmolLM2-135M and
  random-weight bf16 checkpoints of the Qwen3-1.7B/4B/8B and Qwen3.5-4B shapes, written once under `--cache`
  (tensor by tensor) with the embedded tokenizer. Each run adds its rows to memory.json (a row measured again
  replaces the old one), so big models can be measured one at a time (`--models qwen3-8b` needs ~19 GiB free).
- `--kv-sharing` (issue 21, kv_sharing.md): 32 greedy generations, each a 1,000-token system prompt already in the
  prefix cache followed by its own user turn, decoded together: the KV store's pages held (cache and sequences,
  each page once) against what the tokens need (one prefix + the 32 suffixes; target <= 1.2 x) at the last step at
  which all of them run, and what the allocation rule before the paged store (each sequence a buffer of prompt +
  max_tokens, the prefix copied in) would have held. A sequence's own tokens round up to whole pages (16 tokens on
  the CPU), so the ratio falls as the user turn grows: it is recorded for a short and a long one.

    python -m bench.memory [--models embedded,qwen3-1.7b] [--cache DIR] [--out bench/results/memory]
    python -m bench.memory --quantize int8 --models embedded,qwen3-8b --out bench/results/memory

With `--quantize int8` (issue 52) the models load with quantize="int8" and the rows go to memory_int8.md/.json,
against the int8 target steady <= 1.15 x weights + 0.5 GiB (weights: the plan's, projections in int8).
    python -m bench.memory --kv-sharing [--users 32] [--system 1000] [--suffixes 64,448] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import REPO, git_commit, machine, machine_info, question
from bench.summary import default_out
from server.memory import proc_status_kib

GiB = 2**30
MODELS = ["embedded", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3.5-4b"]
LABELS = [" Yes", " No"]
THREADS = 2
KV_CACHE_MB = 1024.0  # the KV store a bench engine is planned with (--kv-cache-mb; pages take memory once written)
KV_TARGET = 1.2


# --- the checkpoints ---------------------------------------------------------------------------------------------
def write_checkpoint(shape_name: str, out: Path) -> None:
    """A random-weight bf16 checkpoint of the shape (config.json, model.safetensors, the embedded tokenizer),
    written tensor by tensor; the names and shapes are transformers' own (its model class built on meta)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.models import SHAPES, hf_config, random_getter
    from pyscore.model.checkpoint import TensorSpec, write_safetensors
    from pyscore.model.config import ModelConfig
    from pyscore.model.loading import resolve_model_dir

    hf = hf_config(SHAPES[shape_name])
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf)
    names = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()
             if not (hf.tie_word_embeddings and k == "lm_head.weight")}
    fp32 = ("A_log", "dt_bias")  # kept in fp32 by transformers' Qwen3.5
    specs = [TensorSpec(k, torch.float32 if k.endswith(fp32) else torch.bfloat16, s) for k, s in sorted(names.items())]
    get = random_getter(ModelConfig.from_hf(hf), torch.bfloat16, torch.device("cpu"))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_safetensors(tmp / "model.safetensors", specs, lambda spec: get(spec.name).to(spec.dtype).reshape(spec.shape),
                      metadata={"format": "pt"})
    hf.save_pretrained(tmp)
    embedded, _ = resolve_model_dir(None)
    for f in embedded.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    os.replace(tmp, out)


def model_path(name: str, cache: Path) -> Path | None:
    """The model argument of a row (None: the embedded model), its checkpoint written first if missing."""
    if name == "embedded":
        return None
    path = cache / name
    if not (path / "config.json").exists():
        print(f"writing the {name} checkpoint to {path} ...", flush=True)
        subprocess.run([sys.executable, "-m", "bench.memory", "--write", name, str(path)], cwd=REPO, check=True)
    return path


# --- one measurement (a child process) ---------------------------------------------------------------------------
def status_bytes(field: str) -> int:
    return proc_status_kib(field)[field] * 1024


def measure(model: str | None, quantize: str | None = None) -> dict[str, Any]:
    import torch  # noqa: F401  (the baseline includes torch and the engine, as the issue measures)

    from pyscore.engine import Engine

    baseline = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    start = time.perf_counter()
    engine = Engine.from_pretrained(model, dtype="bfloat16", device="cpu", threads=THREADS,
                                    kv_cache_mb=KV_CACHE_MB, quantize=quantize)
    load_s = time.perf_counter() - start
    loaded, peak = status_bytes("VmRSS"), status_bytes("VmHWM")
    query, items = question(2)
    start = time.perf_counter()
    result = engine.score(query, items, labels=LABELS, mode="mis")
    score_s = time.perf_counter() - start
    plan = engine.memory
    return dict(baseline_bytes=baseline, load_peak_bytes=peak - baseline, loaded_bytes=loaded - baseline,
                steady_bytes=status_bytes("VmRSS") - baseline, peak_after_score_bytes=status_bytes("VmHWM") - baseline,
                load_s=round(load_s, 2), score_s=round(score_s, 2), weight_bytes=plan.weight_bytes,
                expected_total_bytes=plan.expected_total_bytes, mode=result.mode,
                scores=[row[0] for row in result.scores], prompt_tokens=result.usage.prompt_tokens)


def run_child(name: str, cache: Path, quantize: str | None = None) -> dict[str, Any]:
    path = model_path(name, cache)
    out = subprocess.run([sys.executable, "-m", "bench.memory", "--measure", str(path or ""),
                          *(["--quantize", quantize] if quantize else [])], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "PYSCORE_THREADS": str(THREADS)})
    if out.returncode != 0:
        return dict(error=out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), commit=git_commit())


# --- KV sharing (in this process) ------------------------------------------------------------------------------
def token_run(tokenizer: Any, text: str, n: int) -> list[int]:
    """n token ids of `text` repeated (no special tokens)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:n]


def kv_measure(engine: Any, users: int, system: int, suffix: int, max_tokens: int) -> dict[str, Any]:
    """One run on `engine` (its KV store empty of sequences): the held / needed bytes at the last step at which
    every generation still ran, and the peak ratio over those steps."""
    from pyscore.types import GenerateRequest

    tok, store = engine.tokenizer, engine.kv_store
    per_token = engine.decoder.kv_bytes_per_token
    prompt = token_run(tok, "You are a careful assistant. Answer briefly, cite the policy, never guess. ", system)
    engine.generate(GenerateRequest(prompt_token_ids=[*prompt, 13], max_tokens=1))  # the system prompt is cached
    cached_pages = store.stats.held_pages
    gens = [engine.start_generation(GenerateRequest(
        prompt_token_ids=prompt + token_run(tok, f"User {u}: my order {1000 + u} has not arrived, what now? ", suffix),
        max_tokens=max_tokens)) for u in range(users)]
    steps, start, last, peak_ratio = 0, time.perf_counter(), None, 0.0
    while not all(g.finished for g in gens):
        engine.step(gens)
        steps += 1
        if any(g.finished or g.cache is None for g in gens):
            continue
        own = sum(g.cache.length - system for g in gens)
        needed = per_token * (system + own)
        held = store.stats.held_bytes
        tables = [set(g.cache.table.pages) for g in gens]
        last = dict(step=steps, held_bytes=held, needed_bytes=needed, own_tokens=own,
                    held_pages=store.stats.held_pages, shared_pages=len(set.intersection(*tables)),
                    table_pages=sum(len(t) for t in tables))
        peak_ratio = max(peak_ratio, held / needed)
    if last is None or any(g.error is not None for g in gens):
        raise RuntimeError(f"the generations did not all run together: {[g.error for g in gens if g.error]}")
    before = per_token * sum(len(g.prompt) + max_tokens for g in gens) + cached_pages * store.block_bytes
    return dict(users=users, system_tokens=system, suffix_tokens=suffix, max_tokens=max_tokens, steps=steps,
                seconds=round(time.perf_counter() - start, 1), bytes_per_token=per_token,
                page_bytes=store.block_bytes, page_tokens=store.block_tokens,
                ratio=last["held_bytes"] / last["needed_bytes"],
                peak_ratio=peak_ratio, before_bytes=before, **last)


def kv_table(rows: list[dict[str, Any]]) -> list[str]:
    MiB = 2**20
    lines = ["| user turn (tokens) | new tokens | own tokens (all 32) | needed MiB (1 prefix + 32 suffixes) | "
             "held MiB | held / needed (target <= 1.2) | | peak over steps | pages in every table | "
             "pages of the tables (held) | before: 32 prefixes MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ok = "pass" if r["peak_ratio"] <= KV_TARGET else "FAIL"
        lines.append(f"| {r['suffix_tokens']} | {r['max_tokens']} | {r['own_tokens']} | {r['needed_bytes'] / MiB:.1f} "
                     f"| {r['held_bytes'] / MiB:.1f} | {r['ratio']:.3f} | {ok} | {r['peak_ratio']:.3f} | "
                     f"{r['shared_pages']} | {r['table_pages']} ({r['held_pages']}) | {r['before_bytes'] / MiB:.1f} |")
    return lines


# --- the report --------------------------------------------------------------------------------------------------
STEADY = {None: 1.10, "int8": 1.15}  # the steady-RSS target's factor on the weights, per quantize


def targets(row: dict[str, Any], quantize: str | None = None) -> dict[str, float]:
    w = row["weight_bytes"]
    return dict(peak=1.25 * w + 0.5 * GiB, steady=STEADY[quantize] * w + 0.5 * GiB)


def table(rows: dict[str, dict[str, Any]], quantize: str | None = None) -> list[str]:
    lines = ["| model | weights GiB | load peak GiB (target) | | steady GiB (target) | | peak / weights | "
             "steady / weights | load s | 2-candidate MIS scores (Yes, No) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        t, w = targets(r, quantize), r["weight_bytes"]
        ok = {k: "pass" if r[f"{k}_bytes" if k == "steady" else "load_peak_bytes"] <= t[k] else "FAIL"
              for k in ("peak", "steady")}
        scores = "; ".join(f"{s[0]:.4g}, {s[1]:.4g}" for s in r["scores"])
        lines.append(f"| {name} | {w / GiB:.2f} | {r['load_peak_bytes'] / GiB:.2f} ({t['peak'] / GiB:.2f}) | "
                     f"{ok['peak']} | {r['steady_bytes'] / GiB:.2f} ({t['steady'] / GiB:.2f}) | {ok['steady']} | "
                     f"{r['load_peak_bytes'] / w:.2f}x | {r['steady_bytes'] / w:.2f}x | {r['load_s']} | {scores} |")
    return lines


def record(out: Path, name: str, header: Sequence[str], lines: Sequence[str], data: dict[str, Any]) -> str:
    """Writes OUT/NAME.md (the machine, `header`, `lines`) and OUT/NAME.json (the machine and `data`)."""
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join([f"{header[0]}: {machine()}", *header[1:], *lines]) + "\n"
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(dict(machine=machine_info(), **data), indent=2) + "\n")
    return text


def record_name(quantize: str | None) -> str:
    return f"memory_{quantize}" if quantize else "memory"


def report(rows: dict[str, dict[str, Any]], out: Path, quantize: str | None = None) -> None:
    commits = sorted({r.get("commit") or "?" for r in rows.values()})
    missing = [m for m in MODELS if m not in rows]
    flag = f" --quantize {quantize}" if quantize else ""
    footer = ["", f"Not measured: {', '.join(missing)} (`python -m bench.memory{flag} --models "
              f"{','.join(missing)}`; each run adds its rows to {record_name(quantize)}.json)."] if missing else []
    served = f"bf16 with the projections in {quantize}" if quantize else "bf16"
    print(record(out, record_name(quantize), [
        f"# pyscore memory ({'issue 52' if quantize else 'issue 20'})", "",
        f"`python -m bench.memory{flag} --models ...`; commit {', '.join(commits)}; {served}, {THREADS} threads; "
        "RSS above the RSS after `import torch, pyscore.engine` in a fresh process per model; peak = VmHWM while "
        "loading; steady = VmRSS after one 2-candidate MIS question. Targets: peak <= 1.25 x weights + 0.5 GiB, "
        f"steady <= {STEADY[quantize]:.2f} x weights + 0.5 GiB.",
        ""], table(rows, quantize) + footer, dict(threads=THREADS, quantize=quantize, rows=rows)), end="")


def kv_report(rows: list[dict[str, Any]], out: Path) -> str:
    r = rows[0]
    b = r["page_tokens"]
    whole, tail = divmod(r["system_tokens"], b)
    return record(out, "kv_sharing", [
        f"# KV bytes held by {r['users']} generations sharing a {r['system_tokens']}-token system prompt (issue 21)",
        "", f"commit {git_commit()}; the embedded SmolLM2-135M in bf16 ({r['bytes_per_token']} bytes of keys and "
        f"values a token, {r['page_bytes'] / 2**20:.2f} MiB a {b}-token page), greedy, {THREADS} threads, "
        "`python -m bench.memory --kv-sharing`. Held: the KV store's pages in use (the cached system prompt once, "
        "each sequence's own pages), at the last step at which all generations ran. Needed: the keys and values of "
        "one prefix + every sequence's own tokens. Before: what main allocated before the paged store (each "
        "sequence a buffer of prompt + max_tokens, the prefix copied in; computed from that rule).", ""],
        [*kv_table(rows), "", f"Every sequence holds the system prompt's {whole} whole pages ({r['system_tokens']} = "
         f"{whole} x {b} + {tail}) by reference; its own pages hold the prompt's last {tail} system tokens, its user "
         f"turn and what it generates, rounded up to whole {b}-token pages, so held / needed falls as the user turn "
         "grows."], dict(rows=rows))


def kv_sharing(a: argparse.Namespace) -> None:
    from pyscore.engine import Engine

    rows = []
    for suffix in (int(s) for s in a.suffixes.split(",")):
        engine = Engine.from_pretrained(None, dtype="bfloat16", device="cpu", threads=THREADS)
        rows.append(kv_measure(engine, a.users, a.system, suffix, a.max_tokens))
        print(json.dumps(rows[-1]), flush=True)
    print(kv_report(rows, a.out), end="")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="embedded,qwen3-1.7b",
                   help=f"comma-separated, of {', '.join(MODELS)} (default %(default)s)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pyscore" / "bench-memory",
                   help="where the random checkpoints are written once (default %(default)s)")
    p.add_argument("--out", type=Path, default=default_out("memory"))
    p.add_argument("--kv-sharing", action="store_true", help="KV bytes held by generations sharing a prompt")
    p.add_argument("--users", type=int, default=32, help="--kv-sharing: generations")
    p.add_argument("--system", type=int, default=1000, help="--kv-sharing: system prompt tokens")
    p.add_argument("--suffixes", default="64,448", help="--kv-sharing: user-turn lengths in tokens, one run each")
    p.add_argument("--max-tokens", type=int, default=16, help="--kv-sharing: tokens each generates")
    p.add_argument("--write", nargs=2, metavar=("SHAPE", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--measure", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--quantize", choices=["int8"], default=None, help="load the models with this quantize")
    a = p.parse_args()
    if a.write:
        write_checkpoint(a.write[0], Path(a.write[1]))
        return
    if a.measure is not None:
        print(json.dumps(measure(a.measure or None, a.quantize)))
        return
    if a.kv_sharing:
        kv_sharing(a)
        return
    rows = {}
    previous = a.out / f"{record_name(a.quantize)}.json"
    if previous.exists():  # rows measured earlier (e.g. a big model alone) stay unless re-measured
        rows = json.loads(previous.read_text()).get("rows", {})
    for name in filter(None, a.models.split(",")):  # --models "": rewrite the report from the recorded rows
        if name not in MODELS:
            p.error(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
        print(f"measuring {name} ...", flush=True)
        rows[name] = run_child(name, a.cache, a.quantize)
    report({n: rows[n] for n in MODELS if n in rows}, a.out, a.quantize)


if __name__ == "__main__":
    main()
