"""bench/results/INDEX.md: every recorded result with the command that wrote it, the commit, the CPU and its
one-line purpose, read from the record's first lines; data files (JSON, plots, raw samples) are listed under the
record they belong to. `python -m bench.index` rewrites the index; `--check` writes nothing and exits 1 when it is
stale (tests/test_bench_index.py runs the same comparison and checks that every record is cited)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .summary import LATEST

RESULTS = LATEST.parent
FOLDER = f"{RESULTS.parent.name}/{RESULTS.name}/"  # as the docs name it
INDEX = RESULTS / "INDEX.md"
HEAD_LINES = 15  # a record's header: the lines the fields are read from
RECORDS = (".txt", ".md")  # a record; anything else is data of a record
FOLDERS = {
    ".": "Single records: the first kernel and engine figures, install, the README example, fairness",
    "tiers/kernels": "One op against torch's, per CPU tier (bench.kernels and alternated A/Bs)",
    "tiers/engine": "The engine in process against stock transformers, decode steps and profiles (bench.engine)",
    "tiers/probes": "Probes: measurements that explain a choice without landing one",
    "hardening": "Overload, soak, hostile input (bench.hardening, bench.bad_input_latency)",
    "memory": "Memory per model and KV sharing (bench.memory)",
    "deploy": "Several replicas behind Envoy (bench.deploy)",
}

COMMAND = re.compile(r"((?:[A-Z_]+=\S+ )*(?:(?:PYTHONPATH=\S+ )?python3? -m (?:bench|deploy)\.[\w.]+|make bench[\w-]*|"
                     r"bench/gpu_check\.sh)[^\n`;|]*)")
COMMIT = re.compile(r"\b(?:commit|at|pyscore|HEAD)\s+([0-9a-f]{7,40})\b")
CPU = re.compile(r"(Intel\(R\) Xeon\(R\)[^|;\n(]*(?:\([^)]*\))?|AMD EPYC[^|;\n(]*(?:\([^)]*\))?|family \d+ model \d+)")
FIELD = re.compile(r"^(?:# |<!-- )?(command|commit|cpu): (.+?)(?: -->)?$", re.MULTILINE)


@dataclass
class Record:
    path: str  # relative to bench/results
    purpose: str
    command: str
    commit: str
    cpu: str
    data: list[str] = field(default_factory=list)


def clip(text: str, width: int) -> str:
    text = " ".join(text.replace("|", "/").split())
    return text if len(text) <= width else text[: text.rfind(" ", 0, width)] + " …"


def purpose_of(lines: list[str]) -> str:
    """The record's first line of prose: its title, without comment or heading marks."""
    for line in lines:
        text = line.strip().lstrip("#").strip().removeprefix("<!--").strip()
        if text and not FIELD.match(line.strip()) and not text.startswith(("header added", "-->")):
            return clip(text, 160)
    return "(empty)"


def read_record(path: Path) -> Record:
    """The record's header fields: `command:` / `commit:` / `cpu:` lines where it has them, else what its first
    lines say in prose."""
    lines = path.read_text(errors="replace").splitlines()[:HEAD_LINES]
    head = "\n".join(lines)
    fields = dict(FIELD.findall(head))
    command = fields.get("command") or next(iter(COMMAND.findall(head)), "")
    commit = fields.get("commit") or next(iter(COMMIT.findall(head)), "")
    cpu = fields.get("cpu") or next(iter(CPU.findall(head)), "")
    return Record(str(path.relative_to(RESULTS)), purpose_of(lines), clip(command.strip(" `"), 110),
                  clip(commit, 60), clip(cpu, 70))


def read_json_record(path: Path) -> Record:
    """A JSON record of its own (no text record beside it): the header fields are its top-level keys."""
    data = json.loads(path.read_text())
    return Record(str(path.relative_to(RESULTS)), clip(str(data.get("purpose", "")), 160),
                  clip(str(data.get("command", "")), 110), clip(str(data.get("commit", "")), 60),
                  clip(str(data.get("machine") or data.get("cpu") or ""), 70))


def owner(data: Path, records: dict[Path, Record]) -> Record | None:
    """The record a data file belongs to: the record of the same name in its folder, else the folder's report."""
    stem = data.name.split(".")[0].removesuffix("_rss")
    for candidate in (data.with_name(stem + ".txt"), data.with_name(stem + ".md"), data.parent / "report.md"):
        if candidate in records:
            return records[candidate]
    return None


def all_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and p != INDEX and LATEST not in p.parents)


def records() -> list[Record]:
    files = all_files()
    found = {p: read_record(p) for p in files if p.suffix in RECORDS}
    for data in (p for p in files if p.suffix not in RECORDS):
        record = owner(data, found)
        if record is not None:
            record.data.append(data.name)
        elif data.suffix == ".json":
            found[data] = read_json_record(data)
        else:
            raise ValueError(f"{data.relative_to(RESULTS)}: no record of the same name or report.md beside it")
    return sorted(found.values(), key=lambda r: r.path)


def folder_of(record: Record) -> str:
    parent = str(Path(record.path).parent)
    return parent if parent in FOLDERS or parent == "." else parent.split("/")[0]


def index_text() -> str:
    groups: dict[str, list[Record]] = {}
    for record in records():
        groups.setdefault(folder_of(record), []).append(record)
    out = ["# Recorded results", "",
           "<!-- generated by `python -m bench.index` from each record's first lines: edit the record, not this -->",
           "", f"Every record under `{FOLDER}`, with the command that wrote it, the commit and the CPU as its "
           "header states them (a header marked *added afterwards* was reconstructed from git log and the record's "
           "body). How to record one: `docs/contributing.md` (Recording a benchmark). A record is "
           "cited by the docs, the tier table or a kernel's comment; `tests/test_bench_index.py` fails on one that "
           "nothing cites or that is missing here.", ""]
    order = [*FOLDERS, *sorted(g for g in groups if g not in FOLDERS)]
    for name in (g for g in order if g in groups):
        title = FOLDERS.get(name, "Serving runs against a peer or a sweep (bench.peers, bench.serving)"
                            if name.startswith(("peers", "serving")) else name)
        out += [f"## {name if name != '.' else FOLDER}", "", title, "",
                "| record | purpose | command | commit | CPU |", "| --- | --- | --- | --- | --- |"]
        for r in sorted(groups[name], key=lambda r: r.path):
            data = f" (+ {', '.join(r.data)})" if r.data else ""
            out.append(f"| [{r.path}]({r.path}){data} | {r.purpose} | {f'`{r.command}`' if r.command else '—'} | "
                       f"{r.commit or '—'} | {r.cpu or '—'} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if INDEX.md is stale")
    a = p.parse_args(argv)
    text = index_text()
    if INDEX.exists() and INDEX.read_text() == text:
        return 0
    if a.check:
        print(f"{INDEX} is stale: run python -m bench.index", file=sys.stderr)
        return 1
    INDEX.write_text(text)
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
