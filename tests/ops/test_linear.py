"""linear (prepacked weights, fused epilogues) against F.linear in fp32 at every decoder projection shape of SmolLM2
and Qwen3-0.6B plus awkward sizes (odd K, N and I off the block sizes), bias, gated SiLU-mul, residual add (also in
place), strided rows; both bf16 product paths bitwise (and the AMX tiles at tier amx, within the same tolerance);
the AVX2 + FMA kernel forced on this CPU (tier avx2), K past its cache block included; and batch invariance: a row's
output is bitwise the same whatever the batch around it. Tolerances follow the other ops: bf16 within 2x torch's own
bf16 error. A bf16 weight under fp32 x is bitwise the fp32 weight of the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyscore.ops import _ext, linear, pack_linear
from pyscore.ops.reference import linear_ref, silu_mul_ref
from tests.helpers import force_cpu_isa, force_cpu_tier

# name: (K, N, gated); gated N is 2I (the gate_up projection)
DECODER_SHAPES = {
    "smollm-qkv": (576, 960, False), "smollm-o": (576, 576, False), "smollm-gate_up": (576, 3072, True),
    "smollm-down": (1536, 576, False), "qwen3-qkv": (1024, 4096, False), "qwen3-o": (2048, 1024, False),
    "qwen3-gate_up": (1024, 6144, True), "qwen3-down": (3072, 1024, False),
}
AWKWARD_SHAPES = {
    "odd-k": (77, 96, False), "n-off-blocks": (64, 40, False), "n-one": (32, 1, False),
    "tiny-gated": (50, 2 * 24, True), "gated-i-odd": (66, 2 * 37, True), "k-one": (1, 20, False),
}
# K past the AVX2 kernel's cache block (1024): partial sums carried between K blocks
K_BLOCKED_SHAPES = {"k-blocked": (2049, 80, False), "k-blocked-gated": (3000, 2 * 40, True)}
ALL_SHAPES = {**DECODER_SHAPES, **AWKWARD_SHAPES, **K_BLOCKED_SHAPES}


def make_inputs(m, k, n, gated, dtype, bias: bool, residual: bool, strided: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + (8 if strided else 0), generator=gen)[:, :k]
    w = torch.randn(n, k, generator=gen) * k**-0.5
    b = torch.randn(n, generator=gen) if bias else None
    r = torch.randn(m, n // 2 if gated else n, generator=gen) if residual else None
    return tuple(None if t is None else t.to(dtype) for t in (x, w, b, r))


def torch_in_dtype(x, w, b, gated, residual) -> torch.Tensor:
    """The same computation as plain torch ops in x's dtype (F.linear, silu * up, + residual): the bf16 yardstick."""
    y = F.linear(x, w, b)
    if gated:
        y = silu_mul_ref(y)
    return y if residual is None else residual + y


def assert_within(out: torch.Tensor, ref: torch.Tensor, atol: float, what: str) -> None:
    diff = (out.float() - ref.float()).abs()
    assert diff.max().item() <= atol, (
        f"{what}: max diff {diff.max().item():.3g} (allowed {atol:.3g}), mean diff {diff.mean().item():.3g}")


def check_linear(m, k, n, gated, dtype, bias=False, residual=False, strided=False, in_place=False, seed=0):
    x, w, b, r = make_inputs(m, k, n, gated, dtype, bias, residual, strided, seed)
    packed = pack_linear(w, b, gated=gated)
    out = r.clone() if in_place else None
    got = linear(x, packed, residual=out if in_place else r, out=out, backend="kernel")
    ref = linear_ref(x, w, b, gated=gated, residual=r)
    assert got.dtype == dtype and got.shape == ref.shape
    what = f"M={m} K={k} N={n} gated={gated} bias={bias} residual={residual} {dtype}"
    if dtype == torch.float32:
        assert_within(got, ref, 2e-5 * max(1.0, ref.abs().max().item()), what)
    else:
        torch_err = (torch_in_dtype(x, w, b, gated, r).float() - ref).abs().max().item()
        assert_within(got, ref, 2 * torch_err + 1e-6, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 16, 97])
@pytest.mark.parametrize("shape", list(DECODER_SHAPES))
def test_linear_at_decoder_shapes(shape, m, dtype):
    k, n, gated = DECODER_SHAPES[shape]
    check_linear(m, k, n, gated, dtype, residual=shape.endswith(("-o", "-down")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(AWKWARD_SHAPES))
def test_linear_awkward_shapes_and_epilogues(shape, dtype):
    k, n, gated = AWKWARD_SHAPES[shape]
    for m in (1, 5, 7, 13):
        check_linear(m, k, n, gated, dtype, bias=True, residual=m % 2 == 1, strided=m > 5, seed=m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_residual_in_place(dtype):
    check_linear(11, 576, 576, False, dtype, bias=True, residual=True, in_place=True)


def test_pack_round_trip():
    for k, n, gated in [*AWKWARD_SHAPES.values(), DECODER_SHAPES["smollm-gate_up"]]:
        _, w, b, _ = make_inputs(1, k, n, gated, torch.bfloat16, bias=True, residual=False)
        packed = pack_linear(w, b, gated=gated)
        w2, b2 = packed.unpacked()
        assert torch.equal(w2, w) and torch.equal(b2, b.float())
        assert packed.packed_columns % 64 == 0


def rows_alone(x, packed) -> torch.Tensor:
    return torch.cat([linear(x[i : i + 1], packed, backend="kernel") for i in range(x.shape[0])])


def assert_batch_invariant(shape: str, dtype: torch.dtype) -> None:
    """Every row of a batch of M = 1..17 is bitwise the row computed alone, and a row placed at random positions of
    random batches (other rows random) always comes out with the same bits; with 1 or 2 kernel threads."""
    k, n, gated = ALL_SHAPES[shape]
    x, w, b, _ = make_inputs(17, k, n, gated, dtype, bias=True, residual=False)
    packed = pack_linear(w, b, gated=gated)
    alone = rows_alone(x, packed)
    for m in range(1, 18):
        assert torch.equal(linear(x[:m], packed, backend="kernel"), alone[:m]), f"M={m}"
    gen = torch.Generator().manual_seed(1)
    module = _ext.cpu_module()
    threads = module.get_num_threads()
    try:
        for trial in range(12):
            module.set_num_threads(1 + trial % 2)
            m = int(torch.randint(1, 40, (1,), generator=gen))
            pos = int(torch.randint(0, m, (1,), generator=gen))
            batch = torch.randn(m, k, generator=gen).to(dtype)
            batch[pos] = x[3]
            assert torch.equal(linear(batch, packed, backend="kernel")[pos], alone[3]), f"M={m} at row {pos}"
    finally:
        module.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["smollm-qkv", "smollm-gate_up", "n-one", "odd-k"])
def test_batch_invariance(shape, dtype):
    assert_batch_invariant(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_avx2_kernel_matches_the_reference(monkeypatch, dtype):
    """The AVX2 + FMA kernel (tier avx2, forced): decoder shapes at M from one row to several row tiles plus a short
    one, awkward sizes and every epilogue, and K over several cache blocks."""
    force_cpu_isa(monkeypatch, "avx2")
    for shape in ("smollm-qkv", "smollm-gate_up", "smollm-down", "qwen3-down"):
        k, n, gated = DECODER_SHAPES[shape]
        for m in (1, 8, 97):
            check_linear(m, k, n, gated, dtype, residual=shape.endswith("-down"), seed=m)
    for k, n, gated in (*AWKWARD_SHAPES.values(), *K_BLOCKED_SHAPES.values()):
        for m in (1, 6, 13):
            check_linear(m, k, n, gated, dtype, bias=True, residual=m % 2 == 1, strided=m > 5, seed=m)
    check_linear(11, 576, 576, False, dtype, bias=True, residual=True, in_place=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["smollm-gate_up", "odd-k", "n-one", "k-blocked-gated"])
def test_avx2_kernel_is_batch_invariant(monkeypatch, shape, dtype):
    force_cpu_isa(monkeypatch, "avx2")
    assert_batch_invariant(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["smollm-gate_up", "smollm-down", "k-blocked", "fma-k-blocked"])
def test_avx512_tier_bits_are_the_other_tiers(monkeypatch, shape, dtype):
    """Tier avx512 (AVX-512F without BF16), K blocks included, runs linear_simd.h's avx512 unit in fp32 and in bf16
    (pairs widened to fp32: the code needs no BF16 instruction, tests/ops/test_avx512_tier_isa.py): bitwise what tier
    avx512bf16 gives with vdpbf16ps, and what tier avx2 gives (each output is the same chain of fp32 FMAs over K on
    every vector layer, a bf16 pair's odd product first: scores do not depend on the CPU's vector width), batch-
    invariant and within the reference's tolerance."""
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512f"]:
        pytest.skip("needs pyscore._C on a CPU with AVX-512")
    monkeypatch.setenv("PYSCORE_BF16_DOT", "dpbf16")  # what tier avx512 must not take: it answers widen there
    k, n, gated = {**ALL_SHAPES, **FMA_K_BLOCKED_SHAPES}[shape]
    x, w, b, r = make_inputs(13, k, n, gated, dtype, bias=True, residual=True, seed=3)
    packed = pack_linear(w, b, gated=gated)
    outs = {}
    for tier in ("avx512", "avx512bf16", "avx2"):
        monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
        outs[tier] = linear(x, packed, residual=r, backend="kernel")
    assert torch.equal(outs["avx512"], outs["avx512bf16"]), f"K={k}"
    assert torch.equal(outs["avx512"], outs["avx2"]), f"K={k}"
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512")
    assert module.cpu_features()["bf16_dot"] == "widen" and module.cpu_features()["path"] == "avx512"
    check_linear(13, k, n, gated, dtype, bias=True, residual=True, seed=3)
    if shape in ALL_SHAPES:
        assert_batch_invariant(shape, dtype)


# K past the AVX-512 FMA kernel's K block (2048 steps: K 2048 in fp32, 4096 in bf16): fp32 sums carried between
# blocks. 4200 fp32 steps: three blocks of 1400; 8256 bf16 = 4128 pair steps: three blocks of 1376.
FMA_K_BLOCKED_SHAPES = {"fma-k-blocked": (4200, 80, False), "fma-k-blocked-gated": (4200, 2 * 40, True),
                        "fma-k-blocked-bf16": (8256, 72, False)}


@pytest.mark.parametrize("shape", list(FMA_K_BLOCKED_SHAPES))
def test_avx512_kernel_k_blocks(monkeypatch, shape):
    """The AVX-512 FMA kernel over several K blocks: within the reference's tolerance with every epilogue, rows
    bitwise alone, and the carry exact: zeros in x past K/2 leave every output bit as the first half alone gives
    (the sums carried into the later blocks only add exact zeros), and zeros before K/2 as the second half alone."""
    force_cpu_tier(monkeypatch, "avx512bf16")  # both dtypes on the FMA kernel (at amx bf16 is on tiles)
    k, n, gated = FMA_K_BLOCKED_SHAPES[shape]
    dtype = torch.bfloat16 if shape.endswith("bf16") else torch.float32
    for path in ("dpbf16", "widen") if dtype == torch.bfloat16 else ("widen",):
        monkeypatch.setenv("PYSCORE_BF16_DOT", path)
        for m in (1, 7, 13):
            check_linear(m, k, n, gated, dtype, bias=True, residual=m % 2 == 1, strided=m == 7, seed=m)
    x, w, b, _ = make_inputs(13, k, n, gated, dtype, bias=True, residual=False, seed=6)
    packed = pack_linear(w, b, gated=gated)
    full = linear(x, packed, backend="kernel")
    for m0, m1 in ((0, 1), (5, 13)):
        assert torch.equal(linear(x[m0:m1], packed, backend="kernel"), full[m0:m1]), f"rows {m0}:{m1}"
    half = k // 2
    head, tail = x.clone(), x.clone()
    head[:, half:] = 0
    tail[:, :half] = 0
    assert torch.equal(linear(head, packed, backend="kernel"),
                       linear(x[:, :half].contiguous(), pack_linear(w[:, :half], b, gated=gated), backend="kernel"))
    assert torch.equal(linear(tail, packed, backend="kernel"),
                       linear(x[:, half:].contiguous(), pack_linear(w[:, half:], b, gated=gated), backend="kernel"))


def test_bf16_widened_path_is_bitwise_the_dpbf16_path(monkeypatch):
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16")
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512bf16")  # not the AMX tiles, which an amx tier runs
    for shape in ("smollm-gate_up", "qwen3-down", "odd-k", "tiny-gated"):
        k, n, gated = ALL_SHAPES[shape]
        x, w, b, r = make_inputs(23, k, n, gated, torch.bfloat16, bias=True, residual=True, strided=True, seed=4)
        packed = pack_linear(w, b, gated=gated)
        outs = {}
        for path in ("dpbf16", "widen"):
            monkeypatch.setenv("PYSCORE_BF16_DOT", path)
            assert module.cpu_features()["bf16_dot"] == path
            outs[path] = linear(x, packed, residual=r, backend="kernel")
        assert torch.equal(outs["widen"], outs["dpbf16"]), shape


# Shapes for the AVX-512 widened panel (a rectangle of 64 rows or more widens each weight panel to fp32 once):
# decoder shapes, K off a 16-element vector (odd K: a padded pair), and K over the panel's K block (1024 pair steps:
# 1500 pairs in blocks of 750, 4128 in blocks of 1032).
PANEL_SHAPES = ["smollm-gate_up", "smollm-down", "odd-k", "gated-i-odd", "k-blocked-gated", "fma-k-blocked-bf16"]


@pytest.mark.parametrize("tier", ["avx512", "avx512bf16"])
def test_bf16_widened_panel_is_bitwise_pair_by_pair(monkeypatch, tier):
    """bf16 pairs widened (tier avx512; tier avx512bf16 with PYSCORE_BF16_DOT=widen): rows in a call of 64 or more
    (the panel path, on one or two threads) are bitwise those rows computed one by one (pair by pair), with bias and
    residual, and bitwise the vdpbf16ps path of tier avx512bf16 where the CPU has it."""
    if tier not in _ext.runnable_cpu_tiers():
        pytest.skip(f"needs a CPU that runs tier {tier}")
    module = _ext.cpu_module()
    threads = module.get_num_threads()
    shapes = {**ALL_SHAPES, **FMA_K_BLOCKED_SHAPES}
    try:
        for i, shape in enumerate(PANEL_SHAPES):
            monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
            monkeypatch.setenv("PYSCORE_BF16_DOT", "widen")
            module.set_num_threads(1 + i % 2)
            k, n, gated = shapes[shape]
            m = 131 if k < 4000 else 67  # two threads may split the rows: 65 or more each
            x, w, b, r = make_inputs(m, k, n, gated, torch.bfloat16, bias=True, residual=True, seed=i)
            packed = pack_linear(w, b, gated=gated)
            out = linear(x, packed, residual=r, backend="kernel")
            alone = torch.cat([linear(x[j : j + 1], packed, residual=r[j : j + 1], backend="kernel")
                               for j in range(m)])
            assert torch.equal(out, alone), shape
            if "avx512bf16" in _ext.runnable_cpu_tiers():
                monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512bf16")
                monkeypatch.setenv("PYSCORE_BF16_DOT", "dpbf16")
                assert torch.equal(linear(x, packed, residual=r, backend="kernel"), out), shape
    finally:
        module.set_num_threads(threads)
    monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
    monkeypatch.setenv("PYSCORE_BF16_DOT", "widen")
    check_linear(131, 1536, 576, False, torch.bfloat16, bias=True, residual=True, strided=True, seed=5)


# The AMX tile GEMM's blockings (K % 32 == 0): (K, N, gated). K over 2048 runs in K blocks with fp32 partials
# (2080 = 65 steps of 32: blocks of 33 and 32); N off the 64-column blocks leaves a 32-column unit or a partial one;
# gated I = 40 pads its last unit; N over 256 packed columns runs in several column chunks (I = 300: 640 packed), with
# one K block (2 x 2 tiles) and over K blocks (1 x 4 tiles).
AMX_SHAPES = {"k-blocked": (2080, 200, False), "k-blocked-gated": (2080, 2 * 40, True), "one-block": (96, 72, False),
              "gated-i-40": (544, 2 * 40, True), "column-chunks": (96, 600, False),
              "column-chunks-gated": (544, 2 * 300, True), "k-blocked-column-chunks": (2080, 600, False)}


@pytest.mark.parametrize("shape", list(AMX_SHAPES))
def test_amx_blockings(shape, monkeypatch):
    """At tier amx: M from 1 through 192 (the 1 x 4 tiles, one row tile or several in column chunks, their 32-column
    leftover, a zero-padded tail), then 201 and 301 (13 and 19 row tiles in one row block: 2 x 2 tiles in pairs, a
    1 x 2 last tile, a zero-padded tail), with bias and residual; and every row bitwise the row alone."""
    force_cpu_tier(monkeypatch, "amx")
    k, n, gated = AMX_SHAPES[shape]
    for m in (1, 8, 16, 17, 33, 47, 64, 192, 201, 301):
        check_linear(m, k, n, gated, torch.bfloat16, bias=True, residual=m % 2 == 1, strided=m == 17, seed=m)
    x, w, b, _ = make_inputs(301, k, n, gated, torch.bfloat16, bias=True, residual=False, seed=5)
    packed = pack_linear(w, b, gated=gated)
    alone = rows_alone(x, packed)
    for m in (2, 16, 17, 31, 32, 33, 47, 192, 193, 201, 301):
        assert torch.equal(linear(x[:m], packed, backend="kernel"), alone[:m]), f"M={m}"
    assert torch.equal(linear(x.flip(0), packed, backend="kernel"), alone.flip(0))


def test_amx_k_blocked_rows_past_one_row_block(monkeypatch):
    """At tier amx over several K blocks, rows come in blocks of up to 1024 (fp32 partials between the K blocks):
    M = 1100 runs two row blocks, and every row is bitwise the row alone."""
    force_cpu_tier(monkeypatch, "amx")
    check_linear(1100, 2080, 64, False, torch.bfloat16, bias=True, residual=True, seed=3)
    x, w, b, _ = make_inputs(1100, 2080, 64, False, torch.bfloat16, bias=True, residual=False, seed=4)
    packed = pack_linear(w, b)
    out = linear(x, packed, backend="kernel")
    for m0, m1 in ((0, 1), (1000, 1100), (1023, 1025)):
        assert torch.equal(linear(x[m0:m1], packed, backend="kernel"), out[m0:m1]), f"rows {m0}:{m1}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_portable_cpu_path(monkeypatch, dtype):
    """The scalar code that runs on CPUs without AVX-512, forced on this one (also batch-invariant)."""
    monkeypatch.setenv("PYSCORE_DISABLE_AVX512", "1")
    check_linear(7, 77, 2 * 37, True, dtype, bias=True, residual=True, strided=True)
    check_linear(5, 64, 40, False, dtype, bias=True)
    x, w, b, _ = make_inputs(9, 64, 40, False, dtype, bias=True, residual=False)
    packed = pack_linear(w, b)
    assert torch.equal(linear(x, packed, backend="kernel"), rows_alone(x, packed))


@pytest.mark.parametrize("isa", ["avx2", "avx512", "portable", "hardware"])
def test_bf16_weight_under_fp32_x_is_bitwise_the_fp32_weight(monkeypatch, isa):
    """A bf16 weight under fp32 x (what fp32 serving holds a bf16 checkpoint's projections in) gives bitwise the
    fp32 weight of the same values: up to 10 rows (the avx2 kernel reads the pairs as they are), 11 and more (it
    widens the panel once and runs 6-row tiles over it); at the AVX-512 tiers (avx512 forced, and the hardware's on an
    AVX-512 CPU: pairs widened in registers at every row count); odd K (x padded), K over several cache blocks of
    either kernel, bias, gated, residual in place; and the rows stay batch-invariant."""
    if isa == "avx512":
        force_cpu_tier(monkeypatch, "avx512")
    elif isa != "hardware":
        force_cpu_isa(monkeypatch, isa)
    shapes = [DECODER_SHAPES["smollm-gate_up"], DECODER_SHAPES["smollm-down"], AWKWARD_SHAPES["odd-k"],
              K_BLOCKED_SHAPES["k-blocked-gated"], AWKWARD_SHAPES["n-one"], FMA_K_BLOCKED_SHAPES["fma-k-blocked"]]
    for k, n, gated in shapes:
        for m in (1, 3, 8, 10, 11, 16, 17, 40, 131):
            x, w, b, r = make_inputs(m, k, n, gated, torch.float32, bias=True, residual=True, strided=m > 8, seed=m)
            w = w.bfloat16()
            wide, narrow = pack_linear(w.float(), b, gated=gated), pack_linear(w, b, gated=gated)
            assert narrow.dtype == torch.bfloat16
            want = linear(x, wide, residual=r, backend="kernel")
            out = r.clone()
            got = linear(x, narrow, residual=out, out=out, backend="kernel")
            assert torch.equal(got, want), f"K={k} N={n} gated={gated} M={m}"
        assert torch.equal(linear(x, narrow, backend="kernel"), rows_alone(x, narrow))


def test_reference_backend_and_empty_batch():
    x, w, b, r = make_inputs(4, 64, 2 * 24, True, torch.bfloat16, bias=True, residual=True)
    packed = pack_linear(w, b, gated=True)
    ref = linear(x, packed, residual=r, backend="reference")
    assert torch.equal(ref, linear_ref(x, w, b, gated=True, residual=r).to(torch.bfloat16))
    assert linear(x[:0], packed, backend="kernel").shape == (0, 24)


def test_arguments_are_checked_by_name():
    x, w, _, _ = make_inputs(3, 64, 32, False, torch.bfloat16, bias=False, residual=False)
    packed = pack_linear(w)
    with pytest.raises(ValueError, match="x must be"):
        linear(x[:, :63], packed)
    with pytest.raises(ValueError, match="x must match"):
        linear(x, pack_linear(w.float()))  # bf16 x, fp32 weight (only fp32 x reads a bf16 weight)
    with pytest.raises(ValueError, match="residual must be"):
        linear(x, packed, residual=torch.zeros(3, 31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gated weight"):
        pack_linear(w[:31], gated=True)
