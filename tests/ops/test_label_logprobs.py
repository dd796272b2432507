"""label_logprobs against the fp32 reference on every device: LM-head weight or given logits, vocabularies of
49152 and 151936, odd hidden sizes, strided rows, padding labels (< 0), bf16 and fp32. Tolerances follow
flash-attention: fp32 ~1e-5, bf16 within 2x the error of torch's own bf16 log_softmax."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import _ext, label_logprobs, lm_head_logits
from pyscore.ops.reference import label_logprobs_ref
from tests.helpers import force_cpu_isa, force_cpu_tier

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# (rows R, hidden H, vocab V, labels K): 151936 kept small in R and H so the suite stays fast.
SHAPES = {
    "smollm-r16": (16, 576, 49152, 4),
    "qwen-vocab": (3, 64, 151936, 5),
    "one-row-odd-h": (1, 100, 5003, 2),
    "many-rows": (37, 72, 3001, 7),
    "amx-rows": (70, 96, 3001, 3),  # AMX tiles: 5 groups of 16 rows (two passes), a ragged last vocabulary block
}


def make_inputs(rows, hidden, vocab, num_labels, dtype, device, strided: bool, seed: int = 0):
    """hidden [R, H], weight [V, H] (row strides > H when strided) and labels [R, K] with padding."""
    gen = torch.Generator().manual_seed(seed)
    pad = 8 if strided else 0
    h = torch.randn(rows, hidden + pad, generator=gen)[:, :hidden]
    w = (torch.randn(vocab, hidden + pad, generator=gen) * hidden**-0.5 * 3)[:, :hidden]
    labels = torch.randint(0, vocab, (rows, num_labels), generator=gen, dtype=torch.int32)
    labels[0, -1] = vocab - 1  # the last vocabulary entry
    labels[-1, 1:] = -1  # padding
    if rows > 2:
        labels[1, :] = -1  # a row with no valid label
    return h.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype), labels.to(device)


def max_diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max and mean |out - ref|, counting equal infinities as equal (padding is -inf in both)."""
    same_inf = torch.isinf(out) & (out == ref)
    diff = torch.where(same_inf, torch.zeros_like(out), (out - ref).abs())
    return diff.max().item(), diff.mean().item()


def assert_within(out: torch.Tensor, ref: torch.Tensor, atol: float, what: str) -> None:
    worst, mean = max_diff(out, ref)
    assert worst <= atol, f"{what}: max diff {worst:.3g} (allowed {atol:.3g}), mean diff {mean:.3g}"


def torch_logprobs_in_dtype(h, w, labels) -> torch.Tensor:
    """log_softmax of the logits computed plainly by torch in h's dtype, gathered: the bf16 yardstick."""
    logits = h if w is None else h @ w.T
    logp = torch.log_softmax(logits, dim=-1).float()
    return logp.gather(1, labels.clamp_min(0).long()).masked_fill(labels < 0, float("-inf"))


def check_label_logprobs(device, shape: str, dtype: torch.dtype, given_logits: bool, strided: bool = False) -> None:
    rows, hidden, vocab, num_labels = SHAPES[shape]
    h, w, labels = make_inputs(rows, hidden, vocab, num_labels, dtype, device, strided)
    if given_logits:  # the kernel then reads [R, V] logits; make them in the test dtype
        h, w = (h.float() @ w.float().T).to(dtype), None
    logprobs, label_softmax = label_logprobs(h, w, labels, backend="kernel")
    ref_logprobs, ref_softmax = label_logprobs_ref(h, w, labels)
    assert logprobs.shape == label_softmax.shape == labels.shape
    assert bool(torch.isinf(logprobs[labels < 0]).all()) and bool((label_softmax[labels < 0] == 0).all())
    if dtype == torch.float32:
        atol = 2e-5
    else:
        atol = 2 * max_diff(torch_logprobs_in_dtype(h, w, labels), ref_logprobs)[0] + 1e-4
    assert_within(logprobs, ref_logprobs, atol, f"{shape} {dtype} logprobs")
    assert_within(label_softmax, ref_softmax, 1e-5, f"{shape} {dtype} label softmax")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_label_logprobs_lm_head(device, shape, dtype):
    check_label_logprobs(device, shape, dtype, given_logits=False, strided=shape == "many-rows")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["qwen-vocab", "one-row-odd-h"])
def test_label_logprobs_given_logits(device, shape, dtype):
    check_label_logprobs(device, shape, dtype, given_logits=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_label_logprobs_avx2_cpu_path(monkeypatch, shape, dtype):
    """The AVX2 + FMA kernels (tiers avx2 and avx512), forced on a bigger CPU."""
    force_cpu_isa(monkeypatch, "avx2")
    check_label_logprobs("cpu", shape, dtype, given_logits=False, strided=shape == "many-rows")
    check_label_logprobs("cpu", shape, dtype, given_logits=True)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_result_does_not_depend_on_the_other_rows(monkeypatch, isa, dtype):
    """Each row's outputs are bitwise the same alone and among 36 others (the register tiles group rows
    differently): a read-out's scores do not depend on its batch-mates."""
    force_cpu_isa(monkeypatch, isa)
    h, w, labels = make_inputs(*SHAPES["many-rows"], dtype, "cpu", strided=True, seed=7)
    together = label_logprobs(h, w, labels, backend="kernel")
    for r in (0, 5, 36):
        alone = label_logprobs(h[r : r + 1], w, labels[r : r + 1], backend="kernel")
        for got, want in zip(alone, together, strict=True):
            assert torch.equal(got[0], want[r]), f"row {r}: {max_diff(got[0], want[r])}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_label_logprobs_portable_cpu_path(monkeypatch, dtype):
    """The scalar code that runs on CPUs without AVX-512, forced on this one."""
    force_cpu_isa(monkeypatch, "portable")
    check_label_logprobs("cpu", "many-rows", dtype, given_logits=False, strided=True)
    check_label_logprobs("cpu", "one-row-odd-h", dtype, given_logits=True)


@pytest.mark.parametrize("shape", ["smollm-r16", "one-row-odd-h", "many-rows"])
def test_bf16_widened_path_is_bitwise_the_dpbf16_path(monkeypatch, shape):
    """PYSCORE_BF16_DOT=widen (FMA on widened pairs, Intel's default) gives vdpbf16ps's bits (AMD's default)."""
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16")
    h, w, labels = make_inputs(*SHAPES[shape], torch.bfloat16, "cpu", strided=shape == "many-rows", seed=5)
    outs = {}
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512bf16")  # the AVX-512 products, not the AMX tiles of tier amx
    for path in ("dpbf16", "widen"):
        monkeypatch.setenv("PYSCORE_BF16_DOT", path)
        assert module.cpu_features()["bf16_dot"] == path
        outs[path] = label_logprobs(h, w, labels, backend="kernel")
        check_label_logprobs("cpu", shape, torch.bfloat16, given_logits=False, strided=shape == "many-rows")
    for got, want in zip(outs["widen"], outs["dpbf16"], strict=True):
        assert torch.equal(got, want), f"max diff {max_diff(got, want)}"


@pytest.mark.parametrize("shape", ["smollm-r16", "qwen-vocab", "amx-rows"])
def test_amx_tiles_run_at_tier_amx(monkeypatch, shape):
    """At tier amx the bf16 LM head product runs on AMX tiles: it passes the reference check, its bits are not the
    AVX-512 path's (which shows the tiles ran), and each row's outputs are bitwise the same alone and among the
    others (rows 0, 16 and 69 sit in different tiles and passes)."""
    module = _ext.cpu_module()
    if module is None or module.cpu_features()["hardware_tier"] != "amx":
        pytest.skip("needs pyscore._C on a CPU with AMX-BF16 (tier amx)")
    monkeypatch.setenv("PYSCORE_CPU_TIER", "amx")
    check_label_logprobs("cpu", shape, torch.bfloat16, given_logits=False, strided=True)
    h, w, labels = make_inputs(*SHAPES[shape], torch.bfloat16, "cpu", strided=True, seed=9)
    tiles = label_logprobs(h, w, labels, backend="kernel")
    for r in sorted({0, min(16, h.shape[0] - 1), h.shape[0] - 1}):
        alone = label_logprobs(h[r : r + 1], w, labels[r : r + 1], backend="kernel")
        for got, want in zip(alone, tiles, strict=True):
            assert torch.equal(got[0], want[r]), f"row {r}: {max_diff(got[0], want[r])}"
    if shape == "qwen-vocab":
        return  # over H = 64 the two summation orders happen to round alike on this input
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512bf16")
    fma = label_logprobs(h, w, labels, backend="kernel")
    assert not torch.equal(tiles[0], fma[0]), "tier amx ran the AVX-512 product, not the AMX tiles"


@pytest.mark.parametrize("shape", ["smollm-r16", "many-rows"])  # enough outputs for the two kernels' bits to differ
def test_avx512_tier_reads_out_on_the_avx512_kernel(monkeypatch, shape):
    """Tier avx512 (AVX-512F without BF16): the read-out runs the AVX-512 kernel in both dtypes, bf16 on pairs widened
    to fp32 (bitwise what tier avx512bf16 gives with its bf16 products widened, not the AVX2 text's bits), within
    the reference's tolerance. That its code needs no BF16 instruction: test_avx512_tier_isa.py."""
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16")
    monkeypatch.setenv("PYSCORE_BF16_DOT", "widen")
    for dtype in (torch.float32, torch.bfloat16):
        h, w, labels = make_inputs(*SHAPES[shape], dtype, "cpu", strided=False, seed=3)
        outs = {}
        for tier in ("avx512", "avx512bf16", "avx2"):
            monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
            outs[tier] = label_logprobs(h, w, labels, backend="kernel")[0]
        assert torch.equal(outs["avx512"], outs["avx512bf16"]), dtype
        assert not torch.equal(outs["avx512"], outs["avx2"]), f"{dtype}: the kernels agree: the test cannot tell"
        monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512")
        check_label_logprobs("cpu", shape, dtype, given_logits=False)


@pytest.mark.parametrize("isa", ["hardware", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["amx-rows", "one-row-odd-h"])
def test_lm_head_logits_are_the_walks_logits(monkeypatch, isa, shape, dtype):
    """lm_head_logits (Generate's whole rows on CPU): every logit within the fp32 reference's tolerance, logZ their
    log-sum-exp, each row bitwise the same alone and among the others (greedy decoding stays batch-invariant), and
    the label outputs computed from those same logits: logits[label] - logZ is label_logprobs' logprob."""
    if isa != "hardware":
        force_cpu_isa(monkeypatch, isa)
    rows, hidden, vocab, num_labels = SHAPES[shape]
    h, w, labels = make_inputs(rows, hidden, vocab, num_labels, dtype, "cpu", strided=True, seed=11)
    logits, logz = lm_head_logits(h, w, backend="kernel")
    assert logits.shape == (rows, vocab) and logits.dtype == logz.dtype == torch.float32
    ref = h.float() @ w.float().T
    atol = 1e-4 if dtype == torch.float32 else 2 * (h @ w.T).float().sub(ref).abs().max().item() + 1e-3
    assert_within(logits, ref, atol, f"{shape} {dtype} logits")
    assert_within(logz, torch.logsumexp(logits.double(), -1).float(), 1e-5, "logZ")
    valid = labels.clamp_min(0).long()
    logprobs, _ = label_logprobs(h, w, labels, backend="kernel")
    want = (logits.gather(1, valid) - logz[:, None]).masked_fill(labels < 0, float("-inf"))
    assert torch.equal(logprobs, want)
    for r in sorted({0, min(16, rows - 1), rows - 1}):
        alone, alone_z = lm_head_logits(h[r : r + 1], w, backend="kernel")
        assert torch.equal(alone[0], logits[r]) and torch.equal(alone_z[0], logz[r]), f"row {r}"


def test_lm_head_logits_without_a_kernel_is_torchs_product():
    """The reference backend (and CUDA) keep torch's product in the weight's dtype, and no logZ."""
    h, w, _ = make_inputs(*SHAPES["one-row-odd-h"], torch.bfloat16, "cpu", strided=False)
    logits, logz = lm_head_logits(h, w, backend="reference")
    assert logz is None and torch.equal(logits, (h @ w.T).float())


@pytest.mark.parametrize("isa", ["avx2", "avx512", "portable", "hardware"])
def test_bf16_head_under_fp32_rows_is_bitwise_the_fp32_head(monkeypatch, isa):
    """A bf16 LM head under fp32 hidden rows (what fp32 serving holds a bf16 checkpoint's head in) gives bitwise the
    logits, logZ and label outputs of the same values held in fp32 on the same tier: 1, 2 and 3 rows (the AVX2 text
    widens in registers), 16 and 70 (it widens each column of weight rows once; the AVX-512 ops widen each weight
    vector as loaded, at every R), odd hidden sizes, strided rows, a 151936 vocabulary; at tier avx512 forced and at
    the hardware's (an AVX-512 one reads it with the AVX-512 ops, whose fp32 bits differ from the AVX2 text's)."""
    if isa == "avx512":
        force_cpu_tier(monkeypatch, "avx512")
    elif isa != "hardware":
        force_cpu_isa(monkeypatch, isa)
    for shape in ("one-row-odd-h", "qwen-vocab", "smollm-r16", "amx-rows"):
        rows, hidden, vocab, num_labels = SHAPES[shape]
        h, w, labels = make_inputs(rows, hidden, vocab, num_labels, torch.float32, "cpu", strided=True, seed=5)
        narrow = w.bfloat16()
        for r0, r1 in ((0, 1), (0, min(2, rows)), (0, rows)):
            want = label_logprobs(h[r0:r1], narrow.float(), labels[r0:r1], backend="kernel")
            want_logits = lm_head_logits(h[r0:r1], narrow.float(), backend="kernel")
            got = label_logprobs(h[r0:r1], narrow, labels[r0:r1], backend="kernel")
            got_logits = lm_head_logits(h[r0:r1], narrow, backend="kernel")
            what = f"{shape} rows {r0}:{r1}"
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), what
            assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits, strict=True)), what


def test_bf16_head_is_cpu_and_fp32_rows_only():
    h, w, labels = make_inputs(*SHAPES["one-row-odd-h"], torch.bfloat16, "cpu", strided=False)
    with pytest.raises(ValueError, match="weight must match"):
        label_logprobs(h, w.float(), labels)  # an fp32 head under bf16 rows is not a mode
    logits, logz = lm_head_logits(h.float(), w, backend="reference")  # torch's product widens the head
    assert logz is None and torch.equal(logits, h.float() @ w.float().T)
