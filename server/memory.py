"""Memory diagnostics of the server process, off unless PYSCORE_MEMORY_LOG=<file> is set (bench.hardening soak sets it):
every PYSCORE_MEMORY_EVERY_S seconds (default 60) a daemon thread appends one JSON line with the RSS and peak RSS
(/proc/self/status), glibc's mallinfo2 (heap in use / free / mmapped) and the totals of malloc_info's XML (arenas,
fast/rest free chunks, mmapped, system bytes), and, when Python's tracemalloc is tracing (PYTHONTRACEMALLOC=N),
the bytes Python has traced and the allocation sites that grew most since the first snapshot. Under another
allocator (jemalloc / tcmalloc by LD_PRELOAD) glibc's numbers describe only what still goes through glibc."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
import tracemalloc
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                    "keepcost")
TOP_SITES = 15


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2"):  # glibc < 2.33
        return None
    libc.mallinfo2.restype = _Mallinfo2
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def proc_status_kib(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            out[name] = int(value.split()[0])
    return out


def mallinfo2(libc: ctypes.CDLL) -> dict[str, int]:
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name in MALLINFO2_FIELDS}


def malloc_info_totals(libc: ctypes.CDLL) -> dict[str, int]:
    """The process-wide totals of malloc_info(3): heaps (arenas), and bytes by kind (fast/rest free chunks,
    mmap, system current/max, address space)."""
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return {}
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)
    text = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    root = ET.fromstring(text)
    totals: dict[str, int] = {"heaps": len(root.findall("heap"))}
    for element in root:
        if element.tag in ("total", "system", "aspace"):
            totals[f"{element.tag}_{element.get('type')}"] = int(element.get("size", 0))
    return totals


class MemoryProbe:
    def __init__(self, path: Path, every_s: float) -> None:
        self.path, self.every_s = path, every_s
        self._libc = _libc()
        self._first: tracemalloc.Snapshot | None = None
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pyscore-memory-probe", daemon=True)

    @classmethod
    def from_env(cls) -> MemoryProbe | None:
        path = os.environ.get("PYSCORE_MEMORY_LOG")
        return cls(Path(path), float(os.environ.get("PYSCORE_MEMORY_EVERY_S", "60"))) if path else None

    def start(self) -> None:
        log.warning("memory probe: a line every %.0f s to %s (tracemalloc %s)", self.every_s, self.path,
                    "on" if tracemalloc.is_tracing() else "off")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()  # the last word

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        try:
            line = self.measure()
        except Exception:  # diagnostics must never take the server down
            log.exception("memory probe failed")
            return
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def measure(self) -> dict[str, Any]:
        line: dict[str, Any] = dict(t=round(time.monotonic() - self._start, 1), **proc_status_kib(
            "VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"))
        if self._libc is not None:
            line["mallinfo2"] = mallinfo2(self._libc)
            line["malloc_info"] = malloc_info_totals(self._libc)
        if tracemalloc.is_tracing():
            line["tracemalloc"] = self._python_allocations()
        return line

    def _python_allocations(self) -> dict[str, Any]:
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        current, peak = tracemalloc.get_traced_memory()
        out: dict[str, Any] = dict(traced=current, peak=peak)
        if self._first is None:
            self._first = snapshot
        else:
            growth = snapshot.compare_to(self._first, "lineno")[:TOP_SITES]
            out["grown_since_first"] = [dict(site=str(s.traceback[0]), bytes=s.size_diff, count=s.count_diff)
                                        for s in growth if s.size_diff > 0]
        return out
