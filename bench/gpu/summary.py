"""The short table gpu_check.sh prints last: the issue's numbers from the JSON files of one run, beside the
targets and the LMSYS study's SGLang numbers (H200, p95 time to decision at 16 candidates).

    python -m bench.gpu.summary OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.summary import write_report

# p95 ms at 16 candidates, concurrency 1 (the study, SGLang on one H200)
STUDY = {"qwen3-0.6b": dict(mis=18.7, generate=39.6, sis=24.3), "qwen3-8b": dict(mis=20.6, generate=54.1, sis=53.1),
         "qwen3.5-4b": dict(mis=55.7, generate=84.8, sis=74.4)}
TARGET_MIS16 = {"qwen3-0.6b": 10.0, "qwen3-8b": 15.0}
TARGET_RATIO = 1.3


def load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "-"
    if "p95" not in stats:
        return "ERR"
    return f"{stats['p50']:.2f}/{stats['p95']:.2f}"


def engine_lines(report: dict[str, Any]) -> list[str]:
    shape = report["shape"]
    lines = [f"engine {shape} ({report['env'].get('gpu', report['env']['device'])}): p50/p95 ms"]
    for n, cell in report.get("results", {}).items():
        diff = cell.get("mis_vs_sis", {}).get("max_abs")
        floor = max(cell["floor_mis"].values())
        lines.append(f"  {n:>2} cands  generate {fmt(cell.get('generate')):>15}  sis {fmt(cell.get('sis')):>15}  "
                     f"mis {fmt(cell.get('mis')):>15}  (mis floor {floor:.2f})  |mis-sis| "
                     + (f"{diff:.1e}" if diff is not None else "-"))
    mis16 = report.get("results", {}).get("16", {}).get("mis", {}).get("p95")
    if mis16 is not None and shape in STUDY:
        target = TARGET_MIS16.get(shape, STUDY[shape]["mis"])  # no target of its own: the study's MIS
        ok = "MET" if mis16 <= target else "missed"
        lines.append(f"  MIS(16) p95 {mis16:.2f} ms vs target {target} ({ok}); study SGLang: "
                     + ", ".join(f"{k} {v}" for k, v in STUDY[shape].items()))
    if "mis16_over_mis2_p95" in report:
        r = report["mis16_over_mis2_p95"]
        verdict = "MET" if r <= TARGET_RATIO else "missed"
        lines.append(f"  MIS(16)/MIS(2) p95 {r:.2f} vs target {TARGET_RATIO} ({verdict})")
    g = report.get("overhead_mis", {})
    if g:
        ms = {k: g.get(k, float("nan")) for k in ("prepare_pack_ms", "decoder_enqueue_ms", "decoder_total_ms",
                                                    "readout_ms")}
        line = (f"  overhead@16: prepare+pack {ms['prepare_pack_ms']:.2f}  decoder enqueue "
                f"{ms['decoder_enqueue_ms']:.2f} / total {ms['decoder_total_ms']:.2f}  readout {ms['readout_ms']:.2f}")
        graph = g.get("graph")  # runs before issue 21 also replayed the decoder from a CUDA graph (prototype removed)
        if isinstance(graph, dict):
            line += (f"  graph replay {graph.get('replay_ms', '-')}  graph decision "
                     f"{fmt(graph.get('graph_decision_ms'))}  replay-vs-eager "
                     f"{graph.get('replay_vs_eager_max_abs', '-')}")
        lines.append(line)
        errors = {k: v for k, v in (graph if isinstance(graph, dict) else {}).items() if k.startswith("capture_error")}
        if errors:
            lines.append(f"  graph capture errors: {errors}")
    if report.get("skipped"):
        lines.append(f"  skipped: {report['skipped']}")
    return lines


def summary(out: Path) -> str:
    lines: list[str] = []
    kernels = load(out / "kernels.json")
    if kernels:
        from bench.gpu.kernel_bench import table

        lines += [table(kernels), ""]
    for path in sorted(out.glob("engine-*.json")):
        report = load(path)
        if report:
            lines += [*engine_lines(report), ""]
    grpc = load(out / "grpc.json")
    if grpc:
        from bench.gpu.grpc_bench import table

        lines += [table(grpc)]
    return "\n".join(lines) if lines else f"no results under {out}"


if __name__ == "__main__":
    write_report(summary(Path(sys.argv[1] if len(sys.argv) > 1 else ".")), None)
