"""What loading and serving a model costs in memory (issue 20): for each model, a fresh child process imports torch
and pyscore.engine, notes its RSS (the baseline), resets its peak (/proc/self/clear_refs), loads the model in bf16
and scores one 2-candidate MIS question. Recorded above the baseline: the peak RSS while loading (VmHWM), the
steady RSS after the question, the load time and the question's scores; checked against the issue's targets,
peak <= 1.25 x weights + 0.5 GiB and steady <= 1.10 x weights + 0.5 GiB (weights: the memory plan's weight bytes).

Models: the embedded SmolLM2-135M, and random-weight bf16 checkpoints of the Qwen3-1.7B, Qwen3-4B, Qwen3-8B and
Qwen3.5-4B (text model) shapes, written once under `--cache` (tensor by tensor: the writer holds one tensor) with
the embedded model's tokenizer. Big models need the memory: run one at a time, and mind what else the machine runs.

    python -m bench.memory [--models embedded,qwen3-1.7b] [--cache ~/.cache/pyscore/bench-memory]
                           [--out bench/results/memory]

Each run adds its rows to bench/results/memory/memory.json (a row measured again replaces the old one), so the big
models can be measured one at a time: `--models qwen3-8b` needs ~19 GiB free (its weights are 15.3 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, git_commit, machine, machine_info, question
from server.memory import proc_status_kib

GiB = 2**30
MODELS = ["embedded", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3.5-4b"]
LABELS = [" Yes", " No"]
THREADS = 2
# The pools a bench engine is planned with: a generation budget of 8k tokens; the prefix cache as served.
MAX_KV_TOKENS = 8192


def shapes() -> dict[str, Any]:
    from bench.gpu.models import SHAPES, Shape

    extra = {  # config.json of Qwen/Qwen3-1.7B and Qwen/Qwen3-4B
        "qwen3-1.7b": Shape(hidden=2048, layers=28, q_heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                            vocab=151936, tied=True),
        "qwen3-4b": Shape(hidden=2560, layers=36, q_heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                          vocab=151936, tied=True),
    }
    return {**SHAPES, **extra}


# --- the checkpoints ---------------------------------------------------------------------------------------------
def write_checkpoint(shape_name: str, out: Path) -> None:
    """A random-weight bf16 checkpoint of the shape (config.json, model.safetensors, the embedded tokenizer),
    written tensor by tensor; the names and shapes are transformers' own (its model class built on meta)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.gpu.models import hf_config, random_getter
    from pyscore.model.checkpoint import TensorSpec, write_safetensors
    from pyscore.model.config import ModelConfig
    from pyscore.model.loading import resolve_model_dir

    hf = hf_config(shapes()[shape_name])
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


def measure(model: str | None) -> dict[str, Any]:
    import torch  # noqa: F401  (the baseline includes torch and the engine, as the issue measures)

    from pyscore.engine import Engine

    baseline = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    start = time.perf_counter()
    engine = Engine.from_pretrained(model, dtype="bfloat16", device="cpu", threads=THREADS,
                                    max_kv_tokens=MAX_KV_TOKENS)
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


def run_child(name: str, cache: Path) -> dict[str, Any]:
    path = model_path(name, cache)
    out = subprocess.run([sys.executable, "-m", "bench.memory", "--measure", str(path or "")], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "PYSCORE_THREADS": str(THREADS)})
    if out.returncode != 0:
        return dict(error=out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), commit=git_commit())


# --- the report --------------------------------------------------------------------------------------------------
def targets(row: dict[str, Any]) -> dict[str, float]:
    w = row["weight_bytes"]
    return dict(peak=1.25 * w + 0.5 * GiB, steady=1.10 * w + 0.5 * GiB)


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| model | weights GiB | load peak GiB (target) | | steady GiB (target) | | peak / weights | "
             "steady / weights | load s | 2-candidate MIS scores (Yes, No) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        t, w = targets(r), r["weight_bytes"]
        ok = {k: "pass" if r[f"{k}_bytes" if k == "steady" else "load_peak_bytes"] <= t[k] else "FAIL"
              for k in ("peak", "steady")}
        scores = "; ".join(f"{s[0]:.4g}, {s[1]:.4g}" for s in r["scores"])
        lines.append(f"| {name} | {w / GiB:.2f} | {r['load_peak_bytes'] / GiB:.2f} ({t['peak'] / GiB:.2f}) | "
                     f"{ok['peak']} | {r['steady_bytes'] / GiB:.2f} ({t['steady'] / GiB:.2f}) | {ok['steady']} | "
                     f"{r['load_peak_bytes'] / w:.2f}x | {r['steady_bytes'] / w:.2f}x | {r['load_s']} | {scores} |")
    return lines


def report(rows: dict[str, dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    commits = sorted({r.get("commit") or "?" for r in rows.values()})
    header = [f"# pyscore memory (issue 20): {machine()}", "",
              f"commit {', '.join(commits)}; bf16, {THREADS} threads; RSS above the RSS after `import torch, "
              "pyscore.engine` in a fresh process per model; peak = VmHWM while loading; steady = VmRSS after "
              "one 2-candidate MIS question. Targets: peak <= 1.25 x weights + 0.5 GiB, steady <= 1.10 x weights "
              "+ 0.5 GiB.", ""]
    missing = [m for m in MODELS if m not in rows]
    footer = ["", f"Not measured: {', '.join(missing)} (`python -m bench.memory --models {','.join(missing)}`; "
              "each run adds its rows to memory.json)."] if missing else []
    text = "\n".join(header + table(rows) + footer) + "\n"
    (out / "memory.md").write_text(text)
    (out / "memory.json").write_text(json.dumps(dict(machine=machine_info(), threads=THREADS, rows=rows),
                                                indent=2) + "\n")
    print(text, end="")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="embedded,qwen3-1.7b",
                   help=f"comma-separated, of {', '.join(MODELS)} (default %(default)s)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pyscore" / "bench-memory",
                   help="where the random checkpoints are written once (default %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "memory")
    p.add_argument("--write", nargs=2, metavar=("SHAPE", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--measure", metavar="MODEL", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.write:
        write_checkpoint(a.write[0], Path(a.write[1]))
        return
    if a.measure is not None:
        print(json.dumps(measure(a.measure or None)))
        return
    rows = {}
    previous = a.out / "memory.json"
    if previous.exists():  # rows measured earlier (e.g. a big model alone) stay unless re-measured
        rows = json.loads(previous.read_text()).get("rows", {})
    for name in filter(None, a.models.split(",")):  # --models "": rewrite the report from the recorded rows
        if name not in MODELS:
            p.error(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
        print(f"measuring {name} ...", flush=True)
        rows[name] = run_child(name, a.cache)
    report({n: rows[n] for n in MODELS if n in rows}, a.out)


if __name__ == "__main__":
    main()
