"""Qwen3-8B (random weights in the published shapes, a bf16 safetensors checkpoint written by
`python -m bench.memory --write qwen3-8b DIR`) on a 24 GiB machine with `--kv-cache-mb 3328`, one child process per
way of serving it (each alone, one after another): dtype auto (fp32 at tier avx2, the projections, embedding and LM
head held in bf16) and dtype bf16 (what dtype auto fell back to before the embedding and LM head were held in bf16,
when fp32 did not fit). Per child: the dtype chosen, the plan, load time and peak RSS, a 2-candidate MIS question
(median of 3 after one warm-up) and a decode step of one generation (median of 16). It wrote section 5 of
bench/results/tiers/kernels/labels_avx2_bf16_head_ab.txt (on e0039aa's tree, 2 threads), two rounds in opposite
orders:

    python -m bench.probes.qwen3_8b_fit DIR auto bfloat16
    python -m bench.probes.qwen3_8b_fit DIR bfloat16 auto

(then run as an uncommitted q8b_fit.py, the same code; as a module each child runs `-m bench.probes.qwen3_8b_fit`
from the repository root instead of the script's file). Needs the ~16.4 GB checkpoint and the memory to load it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def child(path: str, dtype: str) -> dict[str, Any]:
    from bench.common import elapsed_ms, question
    from bench.engine import step_ms
    from pyscore.engine import Engine
    from server.memory import proc_status_kib

    start = time.perf_counter()
    e = Engine.from_pretrained(path, dtype=dtype, device="cpu", threads=2, kv_cache_mb=3328)
    load_s = time.perf_counter() - start
    query, items = question(2, seed=0)

    def score() -> Any:
        return e.score(query, items, labels=[" Yes", " No"], mode="mis", bypass_prefix_cache=True)

    result = score()
    mis = statistics.median(elapsed_ms(score) for _ in range(3))
    step = step_ms(e, [query + items[0]], 16)[0]
    status = proc_status_kib("VmHWM", "VmRSS")
    return dict(dtype_asked=dtype, served=str(e.decoder.dtype), bf16_weights=e.decoder.bf16_weights,
                weights_gib=round(e.memory.weight_bytes / 2**30, 2),
                expected_total_gib=round(e.memory.expected_total_bytes / 2**30, 2),
                available_gib=round(e.memory.available_bytes / 2**30, 2) if getattr(e.memory, "available_bytes", 0)
                else None,
                load_s=round(load_s, 1), peak_rss_gib=round(status["VmHWM"] / 2**20, 2),
                rss_gib=round(status["VmRSS"] / 2**20, 2), mis2_ms=round(mis, 1), mis_tokens=result.usage.prompt_tokens,
                decode_step_ms=round(step, 1), linear=e.info().ops["linear"], label=e.info().ops["label_logprobs"])


def main() -> None:
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    from bench.common import machine

    print(f"machine: {machine()}")
    print("MemAvailable before:", next(line for line in Path("/proc/meminfo").read_text().splitlines()
                                       if "MemAvailable" in line))
    for dtype in sys.argv[2:] or ["auto", "bfloat16"]:
        out = subprocess.run([sys.executable, "-m", "bench.probes.qwen3_8b_fit", "--child", sys.argv[1], dtype],
                             cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            print(f"{dtype}: exit {out.returncode}: {out.stderr.strip().splitlines()[-3:]}")
        else:
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
