"""fp32 serving of a bf16 SmolLM2-135M-Instruct checkpoint (the embedded model's weights rounded to bf16 and saved as
an HF checkpoint in /tmp/smollm2-bf16, written on first use), three ways in one process, alternating round by round:
everything the policy holds in bf16 (projections, tied embedding / LM head: the default at tier avx2), the
projections only (the embedding / LM head replaced by an fp32 copy after loading: the default before e0039aa), and
nothing (PYSCORE_FP32_WEIGHTS=1); and stock transformers (fp32) on the same checkpoint for the same greedy
generation. Per round: a 16-candidate MIS (median of 3), decode steps of 1, 4 and 8 generations (median of 32
steps) and a 64-token greedy generation. It wrote section 3 of
bench/results/tiers/kernels/labels_avx2_bf16_head_ab.txt (tier avx2, 2 threads):

    python -m bench.probes.bf16_head_engine 3

(then run as an uncommitted head_probe.py, the same code; an unused helper that summed the held tensors' bytes is
left out, and the checkpoint's writing is bf16_checkpoint() below, which bench.probes.linear_bf16_panel_rows and
bench.probes.bf16_decode_steps use too).
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import elapsed_ms, machine, question
from bench.engine import greedy_generations, step_ms
from pyscore.engine import Engine
from pyscore.model.loading import resolve_model_dir
from pyscore.ops import _ext

BF16_DIR = Path("/tmp/smollm2-bf16")


def bf16_checkpoint(path: Path = BF16_DIR) -> Path:
    """The embedded SmolLM2-135M-Instruct's weights rounded to bf16, saved as an HF checkpoint at `path` (once)."""
    if not (path / "model.safetensors").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src, _ = resolve_model_dir(None)
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        m.to(torch.bfloat16).save_pretrained(path)
        AutoTokenizer.from_pretrained(src).save_pretrained(path)
    return path


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    path = bf16_checkpoint()

    os.environ.pop("PYSCORE_FP32_WEIGHTS", None)
    held = Engine.from_pretrained(path, threads=2)
    proj = Engine.from_pretrained(path, threads=2)
    w = proj.decoder.w
    assert w.lm_head is w.embed  # tied
    w.embed = w.lm_head = w.embed.float()  # before any step: no decode program holds the bf16 one
    os.environ["PYSCORE_FP32_WEIGHTS"] = "1"
    wide = Engine.from_pretrained(path, threads=2)
    os.environ.pop("PYSCORE_FP32_WEIGHTS")
    engines = {"all-bf16": held, "proj-bf16": proj, "fp32": wide}

    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    print(f"machine: {machine()}")
    print(f"tier {_ext.cpu_tier()}, torch {torch.__version__}, threads 2; serving dtype {held.decoder.dtype}; "
          f"engine's weight plan: all-bf16 {held.memory.weight_bytes / 2**20:.0f} MiB, "
          f"fp32 {wide.memory.weight_bytes / 2**20:.0f} MiB")
    print("label_logprobs path:", held.info().ops["label_logprobs"])

    query, items = question(16, seed=0)
    labels = [" Yes", " No"]

    def mis(e: Engine) -> Callable[[], object]:
        return lambda: e.score(query, items, labels=labels, mode="mis", bypass_prefix_cache=True)

    scores = {n: mis(e)().scores for n, e in engines.items()}
    print("16-candidate MIS scores bitwise equal across the three: "
          f"{scores['all-bf16'] == scores['proj-bf16'] == scores['fp32']}")
    gen_prompts = question(8, seed=3)
    prompts8 = [gen_prompts[0] + it for it in gen_prompts[1]]
    ids1 = [held.tokenize(prompts8[0])[0]]
    runs = {name: greedy_generations(e, stock, ids1, 64)["ours"] for name, e in engines.items()}
    runs["stock"] = greedy_generations(held, stock, ids1, 64)["stock"]
    toks = {k: f() for k, f in runs.items()}
    same = next((i for i, (a, b) in enumerate(zip(toks["all-bf16"][0], toks["stock"][0], strict=False)) if a != b), 64)
    print(f"greedy 64 tokens equal across the three: {toks['all-bf16'] == toks['proj-bf16'] == toks['fp32']}, "
          f"== stock for the first {same} tokens")

    kinds = ("mis", "step1", "step4", "step8", "gen64")
    cells: dict[tuple[str, str], list[float]] = {(k, n): [] for k in kinds for n in [*engines, "stock"]}
    for r in range(rounds):
        for name, e in engines.items():
            cells[("mis", name)].append(statistics.median(elapsed_ms(mis(e)) for _ in range(3)))
            cells[("step1", name)].append(step_ms(e, prompts8[:1], 32)[0])
            cells[("step4", name)].append(step_ms(e, prompts8[:4], 32)[0])
            cells[("step8", name)].append(step_ms(e, prompts8, 32)[0])
            cells[("gen64", name)].append(elapsed_ms(runs[name]))
        cells[("gen64", "stock")].append(elapsed_ms(runs["stock"]))
        print(f"round {r}: " + "; ".join(f"{k}/{n} {v[-1]:.1f}" for (k, n), v in cells.items() if v), flush=True)
    print("\nmedian over rounds, ms (MIS: median of 3 calls a round; steps: median of 32 decode steps a round):")
    for k in kinds:
        row = {n: statistics.median(v) for (kk, n), v in cells.items() if kk == k and v}
        extra = (f"  stock generate() {row['stock']:.0f} ms = {row['stock'] / row['all-bf16']:.2f}x all-bf16"
                 if "stock" in row else "")
        print(f"{k:6} all-bf16 {row['all-bf16']:8.1f}  proj-bf16 {row['proj-bf16']:8.1f} "
              f"({row['proj-bf16'] / row['all-bf16']:.2f}x)  "
              f"fp32 {row['fp32']:8.1f} ({row['fp32'] / row['all-bf16']:.2f}x){extra}")


if __name__ == "__main__":
    main()
