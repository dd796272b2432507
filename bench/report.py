"""`python -m bench.report RESULTS_DIR`: reads the summaries of a serving benchmark (RESULTS_DIR/results.json, or
every runs/**/summary.json), aggregates the repetitions of each load point (median, with the min-max spread) and
writes RESULTS_DIR/report.md (the issue's targets, tables per loop and per candidate count) and two plots: p95 vs
offered QPS per path and p95 by candidate count per path."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.dataset import BUCKETS
from bench.summary import fmt, write_report

SLO_MS = 1000.0
PATH_ORDER = ("mis", "sis", "generate", "setwise", "fused")
COLORS = {"mis": "tab:blue", "sis": "tab:orange", "generate": "tab:red", "setwise": "tab:green", "fused": "tab:purple"}
# The targets for a 16-candidate question at concurrency 1 (CPU, embedded model, 2 cores).
MIS16_MAX_MS = 200.0
MIS_SIS_MAX, MIS_GEN_MAX, MIS16_MIS2_MAX = 0.35, 0.25, 1.6


@dataclass
class Point:
    """The repetitions of one (target, path, load point)."""

    target: str
    path: str
    loop: str
    load: float  # concurrency or offered QPS
    runs: list[dict[str, Any]]

    def values(self, *keys: str) -> list[float]:
        out = []
        for r in self.runs:
            v: Any = r
            for k in keys:
                v = v.get(k) if isinstance(v, dict) else None
            if isinstance(v, (int, float)) and not math.isnan(v):
                out.append(float(v))
        return out

    def median(self, *keys: str) -> float | None:
        vs = self.values(*keys)
        return statistics.median(vs) if vs else None

    def spread(self, *keys: str) -> tuple[float, float] | None:
        vs = self.values(*keys)
        return (min(vs), max(vs)) if vs else None

    @property
    def errors(self) -> int:
        return sum(int(r["num_errors"]) for r in self.runs)

    @property
    def questions(self) -> int:
        return sum(int(r["num_questions"]) for r in self.runs)

    @property
    def is_local(self) -> bool:
        return self.target.startswith("inprocess")


def load_summaries(results_dir: Path) -> list[dict[str, Any]]:
    combined = results_dir / "results.json"
    if combined.exists():
        return json.loads(combined.read_text())
    return [json.loads(p.read_text()) for p in sorted(results_dir.glob("runs/**/summary.json"))]


def group(summaries: Sequence[dict[str, Any]]) -> list[Point]:
    groups: dict[tuple[str, str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for s in summaries:
        load = s["concurrency"] if s["loop"] == "closed" else s["target_qps"]
        groups[(s["target"], s["path"], s["loop"], float(load))].append(s)
    points = [Point(t, p, loop, load, runs) for (t, p, loop, load), runs in groups.items()]
    rank = {p: i for i, p in enumerate(PATH_ORDER)}
    return sorted(points, key=lambda p: (p.is_local, p.target, rank.get(p.path, 99), p.loop, p.load))


def ms(x: float | None) -> str:
    return fmt(x, ",.0f")


def spread_ms(point: Point, *keys: str) -> str:
    s = point.spread(*keys)
    return "" if s is None or len(point.runs) < 2 else f" ({s[0]:,.0f}–{s[1]:,.0f})"


def e2e_cells(point: Point) -> str:
    """The p50 | p95 (min–max) | p99 cells of a point's time to decision: medians over its repetitions."""
    e2e = "end_to_end_latency_ms"
    return (f"{ms(point.median(e2e, 'p50'))} | {ms(point.median(e2e, 'p95'))}{spread_ms(point, e2e, 'p95')}"
            f" | {ms(point.median(e2e, 'p99'))}")


def label(point: Point, many_targets: bool) -> str:
    if point.is_local:
        return f"{point.path} (in-process)"
    return f"{point.path} @ {point.target}" if many_targets else point.path


def c1(points: Sequence[Point], path: str, local: bool = False) -> Point | None:
    """The lowest-concurrency closed-loop point of a path (concurrency 1 in the default sweeps)."""
    found = [p for p in points if p.path == path and p.loop == "closed" and p.is_local == local]
    return min(found, key=lambda p: p.load) if found else None


def max_qps_under_slo(points: Sequence[Point], target: str, path: str, slo_ms: float = SLO_MS) -> float | None:
    """The highest offered QPS whose median p95 stays under the SLO with no errors (None if none does)."""
    ok = [p.load for p in points if p.target == target and p.path == path and p.loop == "open" and p.errors == 0
          and (p.median("end_to_end_latency_ms", "p95") or math.inf) < slo_ms]
    return max(ok) if ok else None


# --- markdown --------------------------------------------------------------------------------------------
def targets_section(points: Sequence[Point]) -> list[str]:
    """The issue's targets, each with the measured number and whether it holds."""
    lines = ["## Targets (16-candidate question at concurrency 1 unless stated; median over repetitions)", ""]

    def bucket(path: str, b: int, stat: str = "p50_by_candidates") -> float | None:
        p = c1(points, path)
        return None if p is None else p.median(stat, str(b))

    mis16, mis2 = bucket("mis", 16), bucket("mis", 2)
    sis16, gen16 = bucket("sis", 16), bucket("generate", 16)
    rows = []

    def check(name: str, value: float | None, limit: float, unit: str) -> None:
        if value is None:
            rows.append(f"| {name} | not measured | ≤ {limit:g}{unit} | – |")
            return
        held = value <= limit
        verdict = "**met**" if held else f"**missed** by {value / limit:.2f}×"
        shown = f"{value:,.0f} ms" if unit == " ms" else f"{value:.3f}"
        rows.append(f"| {name} | {shown} | ≤ {limit:g}{unit} | {verdict} |")

    check("MIS time to decision, p50", mis16, MIS16_MAX_MS, " ms")
    check("MIS time to decision, p95", bucket("mis", 16, "p95_by_candidates"), MIS16_MAX_MS, " ms")
    check("MIS / SIS (p50)", None if mis16 is None or sis16 is None else mis16 / sis16, MIS_SIS_MAX, "")
    check("MIS / Generate (p50)", None if mis16 is None or gen16 is None else mis16 / gen16, MIS_GEN_MAX, "")
    check("MIS(16) / MIS(2) (p50)", None if mis16 is None or mis2 is None else mis16 / mis2, MIS16_MIS2_MAX, "")
    lines += ["| target | measured | goal | verdict |", "| --- | --- | --- | --- |", *rows, ""]
    grpc_targets = sorted({p.target for p in points if p.loop == "open" and not p.is_local})
    for target in grpc_targets:
        best = {path: max_qps_under_slo(points, target, path) for path in ("mis", "sis", "generate")}
        measured = {path for path in best if any(p.path == path and p.loop == "open" and p.target == target
                                                 for p in points)}
        if not measured:
            continue
        shown = ", ".join(f"{path} {'–' if best[path] is None else f'{best[path]:g}'} q/s" for path in best
                          if path in measured)
        others = [v for k, v in best.items() if k != "mis" and k in measured and v is not None]
        verdict = ("**met**: MIS sustains the highest load" if best["mis"] is not None
                   and all(best["mis"] > v for v in others) else "**not met** (or not measured for MIS)")
        lines += [f"Open loop on `{target}`: highest offered QPS with p95 < {SLO_MS / 1000:g} s and no errors "
                  f"(offered loads of the sweep only): {shown}. {verdict}.", ""]
    return lines


LOOPS = {  # loop: (title and how its time to decision is taken, the table's columns after path and load)
    "closed": ("## Closed loop\n\nTime to decision (ms) = last candidate's completion − dispatch. Median over "
               "repetitions, (min–max) across them.", "concurrency | reps | p50 | p95 | p99 | achieved q/s | errors | "
               "accuracy"),
    "open": ("## Open loop\n\nPoisson arrivals from a seeded schedule (a new seed per repetition, the same schedules "
             "for every path). Time to decision = last candidate's completion − scheduled arrival. Dispatch lag = "
             "dispatch − scheduled arrival (the client's own delay).", "offered q/s | achieved q/s | p50 | p95 | p99 | "
             "dispatch lag p99 | errors"),
}


def row(p: Point, many: bool) -> str:
    achieved, errors = f"{p.median('achieved_qps') or 0:.2f}", f"{p.errors}/{p.questions}"
    if p.loop == "open":
        return (f"| {label(p, many)} | {p.load:g} | {achieved} | {e2e_cells(p)} | "
                f"{p.median('dispatch_lag_ms', 'p99') or 0:.1f} | {errors} |")
    acc = p.median("accuracy")
    return (f"| {label(p, many)} | {p.load:g} | {len(p.runs)} | {e2e_cells(p)} | {achieved} | {errors} | "
            f"{'–' if acc is None else f'{acc:.2f}'} |")


def loop_table(points: Sequence[Point], many: bool, loop: str) -> list[str]:
    rows = [p for p in points if p.loop == loop]
    if not rows:
        return []
    intro, columns = LOOPS[loop]
    lines = [*intro.split("\n"), "", f"| path | {columns} |", "| --- |" + " ---: |" * (columns.count("|") + 1),
             *(row(p, many) for p in rows)]
    if loop == "closed":
        return [*lines, ""]
    worst = max(rows, key=lambda p: (p.median("dispatch_lag_ms", "p99") or 0)
                / max(p.median("end_to_end_latency_ms", "p50") or 1, 1))
    lag, p50 = worst.median("dispatch_lag_ms", "p99") or 0, worst.median("end_to_end_latency_ms", "p50") or 0
    verdict = (" — **not negligible**: the client shaped part of these latencies." if lag > max(5, 0.02 * p50)
               else " — negligible against the latencies measured (≤ 5 ms or ≤ 2 % of p50).")
    lines += ["", f"Largest client dispatch lag relative to the time to decision: p99 {lag:.1f} ms at {worst.path} "
              f"{worst.load:g} q/s (p50 {p50:,.0f} ms){verdict}", ""]
    return lines


def candidates_table(points: Sequence[Point], many: bool) -> list[str]:
    rows = [p for p in points if p.loop == "closed" and p.load == min(q.load for q in points if q.loop == "closed")]
    if not rows:
        return []
    head = " | ".join(f"{b}: p50 / p95" for b in BUCKETS)
    lines = [f"## By candidate count (closed loop, concurrency {rows[0].load:g})", "",
             f"| path | {head} |", "| --- |" + " ---: |" * len(BUCKETS)]
    for p in rows:
        cells = [f"{ms(p.median('p50_by_candidates', str(b)))} / {ms(p.median('p95_by_candidates', str(b)))}"
                 for b in BUCKETS]
        lines.append(f"| {label(p, many)} | " + " | ".join(cells) + " |")
    local = [p for p in rows if p.is_local]
    if local:
        lines += ["", "Service layer cost (gRPC − in-process, p50 ms):", "", "| path | " + " | ".join(
            str(b) for b in BUCKETS) + " |", "| --- |" + " ---: |" * len(BUCKETS)]
        for lp in local:
            remote = c1(points, lp.path)
            if remote is None:
                continue
            cells = []
            for b in BUCKETS:
                r, loc = remote.median("p50_by_candidates", str(b)), lp.median("p50_by_candidates", str(b))
                cells.append("–" if r is None or loc is None else f"{r - loc:+,.0f}")
            lines.append(f"| {lp.path} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def header(summaries: Sequence[dict[str, Any]]) -> list[str]:
    s0 = summaries[0]
    m = s0["machine"]
    gpu = ", ".join(m["gpu"]) if m.get("gpu") else "none"
    commits = sorted({s.get("git_commit") or "unknown" for s in summaries})
    loads = sorted(s["loadavg_before"][0] for s in summaries if s.get("loadavg_before"))
    dirty = [c for c in commits if c.endswith("+dirty") or c == "unknown"]
    warning = [f"> **WARNING: not from a clean commit ({', '.join(dirty)})**: these numbers are of code no commit "
               "holds; rerun `make bench` on a clean tree before quoting them.", ""] if dirty else []
    return ["# Serving benchmark", "", *warning,
            f"- machine: {m['cpu']}, {m['cores']} cores, GPU: {gpu} ({m.get('platform', '')})",
            f"- model: {s0['model']} ({s0.get('target_details', {}).get('dtype', '?')}); "
            f"targets: {', '.join(sorted({s['target'] for s in summaries}))}",
            f"- dataset: {s0['dataset']}; setwise marker {s0.get('marker')!r}; labels {s0.get('label_token_ids')}",
            f"- commit: {', '.join(commits)}",
            f"- 1-minute load average before each run (it includes this benchmark's own busy server, ~2): median "
            f"{statistics.median(loads) if loads else 0:.2f}, max {max(loads, default=0):.2f}"
            + (" — **other work was running: numbers are pessimistic**" if max(loads, default=0) > 3 else ""),
            f"- {len(summaries)} runs", ""]


def write_markdown(results_dir: Path, summaries: Sequence[dict[str, Any]], points: Sequence[Point],
                   plots: Sequence[str]) -> Path:
    many = len({p.target for p in points if not p.is_local}) > 1
    lines = header(summaries) + targets_section(points) + candidates_table(points, many)
    lines += loop_table(points, many, "closed") + loop_table(points, many, "open")
    lines += ["## Plots", ""] + [f"![{name}]({name})" for name in plots] + [""]
    path = results_dir / "report.md"
    write_report(lines, path, echo=False)
    return path


# --- plots -----------------------------------------------------------------------------------------------
def _errorbar(ax: Any, p0: Point, xs: Sequence[float], mid: Sequence[float], spread: Sequence[tuple[float, float]],
              many: bool) -> None:
    """Medians over repetitions at `xs`, their min-max spread as error bars; the in-process engine dashed."""
    style = ({"linestyle": "--", "marker": "x", "alpha": 0.6, "linewidth": 1} if p0.is_local
             else {"linestyle": "-", "marker": "o"})
    ax.errorbar(xs, mid, yerr=[[m - lo for m, (lo, _) in zip(mid, spread, strict=True)],
                               [hi - m for m, (_, hi) in zip(mid, spread, strict=True)]],
                capsize=3, label=label(p0, many), color=COLORS.get(p0.path), **style)


def make_plots(results_dir: Path, points: Sequence[Point]) -> list[str]:
    """p95 vs offered QPS (open loop) and p95 by candidate count (lowest closed-loop concurrency), log y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len({p.target for p in points if not p.is_local}) > 1
    written = []

    def figure(name: str, title: str, xlabel: str, draw: Any) -> None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax)
        ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel="p95 time to decision (ms, log)", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(results_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)

    series: dict[tuple[str, str], list[Point]] = defaultdict(list)
    for p in points:
        if p.loop == "open":
            series[(p.target, p.path)].append(p)

    def by_qps(ax: Any) -> None:
        for ps in series.values():
            keys = ("end_to_end_latency_ms", "p95")
            _errorbar(ax, ps[0], [p.load for p in ps], [p.median(*keys) or math.nan for p in ps],
                      [p.spread(*keys) or (math.nan, math.nan) for p in ps], many)
        ax.axhline(SLO_MS, color="grey", linewidth=0.8, linestyle=":", label="1 s")

    closed = [p for p in points if p.loop == "closed"]
    low = min((p.load for p in closed), default=None)

    def by_candidates(ax: Any) -> None:
        for p in closed:
            buckets = [str(b) for b in BUCKETS if p.median("p95_by_candidates", str(b)) is not None]
            if p.load == low and buckets:
                _errorbar(ax, p, [int(b) for b in buckets], [p.median("p95_by_candidates", b) for b in buckets],
                          [p.spread("p95_by_candidates", b) for b in buckets], many)
        ax.set_xticks(list(BUCKETS))

    if series:
        figure("p95_vs_qps.png", "p95 time to decision vs offered load (open loop)", "offered load (questions/s)",
               by_qps)
    if closed:
        figure("p95_by_candidates.png", f"p95 time to decision by candidate count (concurrency {low:g})",
               "candidates per question", by_candidates)
    return written


def report(results_dir: str | Path) -> Path:
    results_dir = Path(results_dir)
    summaries = load_summaries(results_dir)
    if not summaries:
        raise SystemExit(f"no summaries under {results_dir}")
    points = group(summaries)
    plots = make_plots(results_dir, points)
    return write_markdown(results_dir, summaries, points, plots)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir")
    print(report(p.parse_args().results_dir))


if __name__ == "__main__":
    main()
