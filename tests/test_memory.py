"""pyscore.memory: the plan's weight bytes are what the loader holds, for every family; its KV and state numbers are
the decoder's; the available memory comes from the cgroup (v2, v1) or the machine; a model that cannot fit is
refused before any tensor is read, with the numbers in the message; the engine and ModelInfo report the plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyscore.model.loading as loading
from pyscore import memory, wire
from pyscore.cli import format_info
from pyscore.engine import Engine, tensor_bytes
from pyscore.memory import InsufficientMemoryError, Pools, cgroup_room
from pyscore.model.decoder import Decoder
from pyscore.model.kv_store import KVStore, PageTable
from pyscore.types import MemoryPlan
from tests.helpers import make_model_dir

CPU = torch.device("cpu")
FAMILIES = ["qwen3", "llama", "qwen3_5", "qwen3_5_vl"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_model_dir(tmp_path_factory.mktemp(arch), arch) for arch in FAMILIES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", FAMILIES)
def test_planned_weight_bytes_are_what_the_loader_holds(model_dirs, arch: str, dtype: torch.dtype) -> None:
    """Tied heads counted once, a Qwen3.5 checkpoint's vision tower and fp32 norms as loaded."""
    loaded = loading.load_model(model_dirs[arch], dtype, CPU)
    assert loaded.memory.weight_bytes == tensor_bytes(loaded.weights)


def test_kv_and_linear_state_bytes_are_the_decoders(model_dirs) -> None:
    loaded = loading.load_model(model_dirs["qwen3_5"], torch.bfloat16, CPU)
    decoder = Decoder(loaded.cfg, loaded.weights, loaded.rotary)
    assert memory.kv_bytes_per_token(loaded.cfg, torch.bfloat16) == decoder.kv_bytes_per_token
    store = KVStore(2**20, num_layers=decoder.num_attention_layers, num_kv_heads=loaded.cfg.num_kv_heads,
                    head_dim=loaded.cfg.head_dim, dtype=torch.bfloat16, device=CPU)
    cache = decoder.new_cache(PageTable(store))  # no page yet: only the fixed-size linear-attention state
    state = sum(t.nbytes for t in (cache.conv, cache.next_conv, cache.state, cache.next_state))
    assert memory.linear_state_bytes_per_sequence(loaded.cfg, torch.bfloat16) == state > 0
    plan = loaded.memory
    # the default KV store: the two budgets it replaced, 65536 tokens + 1024 MiB
    assert plan.kv_budget_bytes == 65536 * decoder.kv_bytes_per_token + 1024 * 2**20
    assert plan.linear_state_bytes == Pools().max_running_generations * state
    assert plan.prefix_cache_bytes == 0  # the prefix cache lives in the KV store (off for a hybrid model)


def test_a_model_that_cannot_fit_is_refused_before_any_tensor_is_read(model_dirs, monkeypatch) -> None:
    reads: list[str] = []
    monkeypatch.setattr(loading.Checkpoint, "get", lambda self, name: reads.append(name))
    monkeypatch.setattr(loading, "available_memory", lambda device: (2**20, "MemAvailable of the machine"))
    # a fresh process: what this one holds already counts as allocated, and late in a full run it holds more than
    # the tiny model's whole plan (the check would find nothing left to allocate)
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    with pytest.raises(InsufficientMemoryError) as e:
        loading.load_model(model_dirs["qwen3"], torch.float32, CPU, Pools(kv_cache_mb=64))
    assert reads == []
    message = str(e.value)
    for words in ("does not fit", "weights", "KV budget", "activations", "runtime",
                  "only 0.00 GiB is available (MemAvailable of the machine)", "more memory"):
        assert words in message, (words, message)


def test_the_refusal_says_which_kv_budget_would_fit(model_dirs, monkeypatch) -> None:
    path = model_dirs["qwen3"]
    _, plan = loading.memory_plan(path, torch.float32, Pools(kv_cache_mb=40_000))
    free = plan.expected_total_bytes - plan.kv_budget_bytes // 2  # half the KV budget is missing
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    monkeypatch.setattr(loading, "available_memory", lambda device: (free, "cgroup v2 limit"))
    with pytest.raises(InsufficientMemoryError, match="Lower --kv-cache-mb \\(now 40000\\) to at most 20000"):
        loading.load_model(path, torch.float32, CPU, Pools(kv_cache_mb=40_000))
    # what the message proposes fits
    loading.load_model(path, torch.float32, CPU, Pools(kv_cache_mb=20_000))


def test_the_check_can_be_turned_off(model_dirs, monkeypatch, caplog) -> None:
    monkeypatch.setattr(loading, "available_memory", lambda device: (2**20, "test"))
    # The check subtracts what the process holds already: late in a full run this process's RSS exceeded the tiny
    # model's plan, the plan "fit" and nothing was logged (a fresh-clone run on a Zen 4 failed so, once in three).
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    monkeypatch.setenv("PYSCORE_MEMORY_CHECK", "0")
    loaded = loading.load_model(model_dirs["qwen3"], torch.float32, CPU)
    assert loaded.memory.available_bytes == 2**20
    assert "Starting anyway: PYSCORE_MEMORY_CHECK=0" in caplog.text


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_room_is_the_tightest_limit_minus_the_working_set(tmp_path: Path) -> None:
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "kubepods/pod1/memory.max", str(6 * 2**30))  # the pod's limit binds the container
    write(root / "kubepods/pod1/ctr/memory.max", "max\n")
    write(root / "kubepods/pod1/ctr/memory.current", str(2 * 2**30))
    write(root / "kubepods/pod1/ctr/memory.stat", f"anon 1\ninactive_file {2**30}\nactive_file 5\n")
    room, source = cgroup_room(root, proc)
    assert room == 5 * 2**30 and "cgroup v2 limit 6.00 GiB" in source and "1.00 GiB in use" in source
    write(root / "kubepods/pod1/memory.max", "max\n")
    assert cgroup_room(root, proc) is None


def test_cgroup_v1_room_and_no_limit(tmp_path: Path) -> None:
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    write(proc, "5:cpu,cpuacct:/\n4:memory:/docker/abc\n")  # inside the container its cgroup is the mount's root
    write(root / "memory/memory.limit_in_bytes", str(4 * 2**30))
    write(root / "memory/memory.usage_in_bytes", str(2**30))
    write(root / "memory/memory.stat", "total_inactive_file 0\n")
    room, source = cgroup_room(root, proc)
    assert room == 3 * 2**30 and source.startswith("cgroup v1 limit 4.00 GiB")
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_room(root, proc) is None


def test_available_memory_is_the_smaller_of_cgroup_and_machine(monkeypatch) -> None:
    monkeypatch.setattr(memory, "mem_available", lambda: 10 * 2**30)
    monkeypatch.setattr(memory, "cgroup_room", lambda: (3 * 2**30, "cgroup"))
    assert memory.available_memory(CPU) == (3 * 2**30, "cgroup")
    monkeypatch.setattr(memory, "cgroup_room", lambda: (30 * 2**30, "cgroup"))
    assert memory.available_memory(CPU) == (10 * 2**30, "MemAvailable of the machine")
    monkeypatch.setattr(memory, "cgroup_room", lambda: None)
    assert memory.available_memory(CPU)[1] == "MemAvailable of the machine"


def test_the_engine_and_model_info_report_the_plan(model_dirs) -> None:
    engine = Engine.from_pretrained(model_dirs["qwen3"], dtype="float32", device="cpu", threads=1,
                                    kv_cache_mb=2, max_batch_tokens=128)
    plan = engine.info().memory
    assert plan.weight_bytes == tensor_bytes(engine.model.weights)
    store = engine.kv_store  # --kv-cache-mb sizes it, in whole pages
    assert plan.kv_budget_bytes == store.capacity * store.block_bytes
    assert store.capacity == 2 * 2**20 // store.block_bytes
    # the prefix cache lives in the store (all of it may hold cached blocks): nothing more to plan
    assert plan.prefix_cache_bytes == 0 and engine.info().prefix_cache_bytes == store.capacity * store.block_bytes
    assert plan.activation_bytes == 128 * memory.activation_bytes_per_token(engine.cfg, torch.float32)
    assert plan.expected_total_bytes == (plan.weight_bytes + plan.kv_budget_bytes + plan.prefix_cache_bytes
                                         + plan.activation_bytes + plan.runtime_bytes)
    assert plan.available_bytes > 0
    msg = wire.model_info_to_proto(engine.info())
    assert msg.memory.expected_total_bytes == plan.expected_total_bytes
    assert wire.model_info_from_proto(msg).memory == plan
    shown = [line.split() for line in format_info(engine.info()).splitlines()]
    assert ["memory.expected_total_bytes", str(plan.expected_total_bytes)] in [row[:2] for row in shown]


def test_model_info_without_a_plan_leaves_the_field_unset() -> None:
    from pyscore.types import ModelInfo

    info = ModelInfo(name="m", architecture="A", kind="causal_lm", vocab_size=1, max_context=1, dtype="float32",
                     device="cpu", special_tokens={})
    msg = wire.model_info_to_proto(info)
    assert not msg.HasField("memory") and wire.model_info_from_proto(msg).memory is None
    assert MemoryPlan(weight_bytes=1, runtime_bytes=2).expected_total_bytes == 3


def test_freed_heap_pages_between_live_blocks_go_back_to_the_system() -> None:
    """What loading leaves behind (engine.release_freed_memory, called once the model is packed): blocks freed
    between blocks still in use, which glibc keeps resident."""
    import ctypes

    from pyscore.engine import release_freed_memory

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 * 1024, 2048  # 128 MiB in blocks under any mmap threshold: the heap
    blocks = [libc.malloc(block) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, block)
    for b in blocks[:-1:2]:  # every other one: holes between live blocks, nothing at the top to shrink
        libc.free(b)
    before = memory.resident_bytes()
    release_freed_memory()
    released = before - memory.resident_bytes()
    for b in blocks[1::2]:
        libc.free(b)
    assert released > 32 * 2**20, released


# Run in a fresh interpreter: in this one, earlier tests' engines have tuned glibc, and a large free heap top then
# serves big buffers whatever the threshold, so the control could not fail there.
_HEAP_PROBE = """
import ctypes, sys
from pyscore import memory
from server.memory import _Mallinfo2
libc = memory.glibc()
if libc is None or not hasattr(libc, "mallinfo2"):
    print("skip"); sys.exit()
libc.mallinfo2.restype = _Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mmapped(nbytes):
    before = libc.mallinfo2().hblks
    buf = libc.malloc(nbytes)
    try:
        return libc.mallinfo2().hblks != before
    finally:
        libc.free(buf)

control = mmapped(64 << 20)
said = memory.keep_activation_pages({})
print(control, mmapped(64 << 20), said)
"""


def test_activation_sized_buffers_come_from_the_heap_after_tuning() -> None:
    """After keep_activation_pages, a 64 MiB buffer (an activation of a big model's pass) is no fresh mapping: it
    comes from glibc's heap, whose freed pages the next pass reuses without page faults (mallinfo2's count of
    mmapped blocks, in a fresh interpreter; the control: the same buffer before the call is mapped)."""
    if memory.glibc() is None:
        pytest.skip("needs glibc")
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    if out == "skip":
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    control, tuned, said = out.split(" ", 2)
    assert control == "True", "control: glibc maps a 64 MiB buffer by default"
    assert said.startswith("heap: activations from glibc's heap"), said
    assert tuned == "False", "a 64 MiB buffer was mmapped after tuning: the threshold was not raised"


@pytest.mark.parametrize("switch", [None, "0"])
def test_an_engine_keeps_its_activation_pages(model_dirs, monkeypatch, caplog, switch: str | None) -> None:
    """Every engine, from_pretrained or built from a loaded model, tunes the heap last (or says why not)."""
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "PYSCORE_HEAP_TUNING"):
        monkeypatch.delenv(name, raising=False)
    if switch is not None:
        monkeypatch.setenv("PYSCORE_HEAP_TUNING", switch)
    caplog.set_level("INFO", logger="pyscore.engine")
    Engine(loading.load_model(model_dirs["qwen3"], torch.float32, CPU))
    heap = [r.getMessage() for r in caplog.records if r.getMessage().startswith("heap: ")]
    expected = ("heap: glibc defaults" if switch == "0" else "heap: activations from glibc's heap"
                if memory.glibc() is not None else "heap: not glibc")
    assert len(heap) == 1 and heap[0].startswith(expected), heap


@pytest.mark.parametrize("env, said", [({"PYSCORE_HEAP_TUNING": "0"}, "PYSCORE_HEAP_TUNING=0"),
                                       ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "the user's MALLOC_*_ settings")])
def test_heap_tuning_leaves_glibc_alone_when_asked(env: dict[str, str], said: str) -> None:
    assert said in memory.keep_activation_pages(env)


def test_auto_dtype_serves_bf16_where_only_bf16_fits(model_dirs, monkeypatch, caplog) -> None:
    """dtype "auto" on a CPU without bf16 arithmetic is fp32 (faster there); a model that fits only in bf16 (Qwen3-8B
    on a 24 GiB AVX2 machine) is served in bf16, with a WARNING that says why, instead of refused. A model that fits
    in fp32 stays fp32, and a dtype asked for is kept: refused where it cannot fit."""
    path, pools = model_dirs["qwen3"], Pools(kv_cache_mb=64)
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx2")
    _, fp32 = loading.memory_plan(path, torch.float32, pools)
    _, bf16 = loading.memory_plan(path, torch.bfloat16, pools)
    assert bf16.expected_total_bytes < fp32.expected_total_bytes
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    room = [(fp32.expected_total_bytes + bf16.expected_total_bytes) // 2]
    monkeypatch.setattr(loading, "available_memory", lambda device: (room[0], "cgroup v2 limit"))

    def served(dtype: str) -> torch.dtype:
        return Engine.from_pretrained(path, dtype=dtype, device="cpu", kv_cache_mb=64).decoder.dtype

    assert served("auto") == torch.bfloat16
    assert "dtype auto -> bfloat16 instead of float32" in caplog.text and "cgroup v2 limit" in caplog.text
    with pytest.raises(InsufficientMemoryError, match="does not fit"):
        served("float32")
    room[0] = bf16.expected_total_bytes - 1  # neither fits: refused with auto's own dtype's numbers
    with pytest.raises(InsufficientMemoryError, match="does not fit"):
        served("auto")
    room[0] = fp32.expected_total_bytes
    assert served("auto") == torch.float32


def test_freeze_heap_collects_then_freezes_what_is_left() -> None:
    """Garbage (a reference cycle) is collected first, not frozen for good; what is alive is frozen."""
    import gc
    import weakref

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle  # type: ignore[attr-defined]
    dead = weakref.ref(cycle)
    del cycle
    alive = Node()
    try:
        said = memory.freeze_heap()
        assert dead() is None
        # The line reports the count at the freeze; a frozen object that dies since (another thread of the suite
        # letting go of one) lowers the count, never raises it: a full run once read 622,966 after a line of 622,967.
        assert said.startswith("gc: ") and said.endswith("frozen (full collections no longer scan them)"), said
        assert 0 < gc.get_freeze_count() <= int(said.split()[1]), said
        assert not any(o is alive for o in gc.get_objects())  # the collector's generations no longer hold it
    finally:
        gc.unfreeze()
