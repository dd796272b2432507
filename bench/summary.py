"""The one percentile, the one summary type and the one report writer of bench/.

Percentile, everywhere in bench/: **linear interpolation between the closest ranks** — numpy's default
(`method="linear"`), Hyndman & Fan's type 7: the p-th percentile of n sorted values x[0..n-1] sits at rank
r = (n - 1) * p / 100 and is x[floor(r)] + (x[ceil(r)] - x[floor(r)]) * (r - floor(r)). Its p50 is the
median as `statistics.median` takes it (the mean of the two middle values of an even count). Every p50 / p90 /
p95 / p99 a bench command reports comes from `percentile`, most through `Summary`. (Before issue 21 the
overload, soak and deploy commands took the nearest rank instead: the results recorded then say so in their
header; bench/results/hardening/overload.txt was re-recorded with this one.)

`write_report` prints and records a text report, `write_json` records its data; both write atomically (a reader,
or a timeout kill, never sees half a file) and make folders as needed. `default_out` is where every command writes
without --out: bench/results/latest/, which git ignores (a cited record is written with --out)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAN = math.nan

# Where a bench command writes when no --out is given: a folder git ignores, so a re-run never overwrites a record
# that the README or a closing note cites (those are written with --out and committed).
LATEST = Path(__file__).resolve().parent / "results" / "latest"


def default_out(name: str) -> Path:
    """bench/results/latest/NAME: the default output of every bench command."""
    return LATEST / name


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) by linear interpolation between closest ranks (numpy's default method);
    NaN for no values."""
    if not values:
        return NAN
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Summary:
    """What a bench command reports of one set of measurements: how many succeeded (`count`) and failed
    (`errors`), the percentiles, mean, min and max (NaN when there are none) and, given the run's wall time,
    the throughput (successes per second, drain included)."""

    count: int
    errors: int = 0
    p50: float = NAN
    p90: float = NAN
    p95: float = NAN
    p99: float = NAN
    mean: float = NAN
    min: float = NAN
    max: float = NAN
    wall_s: float | None = None

    @classmethod
    def of(cls, values: Sequence[float], errors: int = 0, wall_s: float | None = None,
           scale: float = 1.0) -> Summary:
        """The summary of `values` (each multiplied by `scale` first, e.g. 1e3 for seconds -> ms)."""
        xs = [v * scale for v in values]
        if not xs:
            return cls(0, errors, wall_s=wall_s)
        return cls(len(xs), errors, *(percentile(xs, p) for p in (50, 90, 95, 99)), mean=sum(xs) / len(xs),
                   min=min(xs), max=max(xs), wall_s=wall_s)

    @property
    def throughput(self) -> float:
        """Successes per second of wall time (0 without a positive wall time)."""
        return self.count / self.wall_s if self.wall_s and self.wall_s > 0 else 0.0

    def pick(self, *keys: str, digits: int | None = None, empty: Any = NAN) -> dict[str, Any]:
        """{key: value} for the named fields (a report's columns), rounded to `digits`; `empty` for every
        statistic when there were no values (None: JSON null)."""
        if not self.count:
            return {k: empty for k in keys}
        vals = {k: getattr(self, k) for k in keys}
        return vals if digits is None else {k: round(v, digits) for k, v in vals.items()}


def timings(times_ms: Sequence[float]) -> dict[str, Any]:
    """A timed cell as the in-process benchmarks record it: n, p50, p95, mean, min, max (ms) and every time."""
    s = Summary.of(times_ms)
    return dict(n=s.count, p50=s.p50, p95=s.p95, mean=s.mean, min=s.min, max=s.max, all=[round(t, 4) for t in times_ms])


def fmt(x: float | None, spec: str = ".0f") -> str:
    """A report cell: `x` formatted, or a dash where nothing was measured."""
    return "–" if x is None else format(x, spec)


def write_report(lines: str | Sequence[str], out: Path | None, echo: bool = True) -> str:
    """Prints a text report (unless not `echo`) and records it at `out` (None: print only); returns the text."""
    text = (lines if isinstance(lines, str) else "\n".join(lines)).rstrip() + "\n"
    if echo:
        print(text, end="")
    if out is not None:
        _atomic_write(Path(out), text)
    return text


def write_json(path: str | Path, data: Any, indent: int = 1) -> None:
    """Records `data` as JSON at `path` (objects JSON does not know as their str)."""
    _atomic_write(Path(path), json.dumps(data, indent=indent, default=str) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
