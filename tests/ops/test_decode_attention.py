"""decode_attention against the fp32 reference on every device: ragged lengths (1 token, chunk edges, several
chunks), GQA ratios, head dims, dtypes, q and new k/v as views into a fused qkv buffer, the new token written into
its page; keys read through block tables whose pages lie in scrambled order in one pool, a prefix's pages shared by
two sequences read as if each had its own copy; a sequence's result does not depend on its batch-mates; the portable
CPU path. Tolerances follow the
other attention tests: fp32 ~1e-5, bf16 within 2x torch's own bf16 error."""

from __future__ import annotations

import pytest
import torch

from pyscore.model.kv_store import page_tokens
from pyscore.ops import _ext, decode_attention, plan_decode, segments
from pyscore.ops.reference import decode_attention_ref
from tests.helpers import force_cpu_isa, outputs_at_tiers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
HEADS = {"smollm-gqa3-d64": (9, 3, 64), "qwen3-gqa2-d128": (16, 8, 128), "mha-d64": (4, 4, 64),
         "gqa12-d128": (12, 1, 128), "gqa2-d96": (4, 2, 96)}
LENGTHS = {"ragged": [1, 17, 256, 257, 600, 33], "one": [5], "long": [1100, 3]}
LAYERS = 3


class Paged:
    """One pool [pages, 2, L, B, Hkv, D] (pages of B tokens: the KV store's on the device, 16 on the CPU, 64 on
    CUDA) and per-sequence block tables; k[b] / v[b] give sequence b's [L, pages * B, Hkv, D] keys / values as a
    copy gathered through its table (for references and checks)."""

    def __init__(self, pool: torch.Tensor, tables: list[list[int]]):
        self.pool, self.tables = pool, tables

    def plan(self, lengths, rows=None):
        rows = range(len(self.tables)) if rows is None else rows
        return plan_decode(self.pool[:, 0], self.pool[:, 1], [self.tables[b] for b in rows], lengths)

    def gathered(self, kv: int, b: int) -> torch.Tensor:
        pages = self.pool[torch.tensor(self.tables[b]), kv]  # [n pages, L, B, Hkv, D]
        return pages.transpose(0, 1).reshape(LAYERS, -1, *pages.shape[3:])

    @property
    def k(self) -> list[torch.Tensor]:
        return [self.gathered(0, b) for b in range(len(self.tables))]

    @property
    def v(self) -> list[torch.Tensor]:
        return [self.gathered(1, b) for b in range(len(self.tables))]


def make_step(lengths, hq, hkv, d, dtype, device, seed=0, shared_pages=0, block=None):
    """A pool holding every sequence's pages of `block` tokens (default: the KV store's page on the device; room
    for 3 more tokens) in scrambled order, the first `shared_pages` pages of every table being the same ones (a
    shared prefix), and q, k_new, v_new as views into one fused [B, (Hq + 2 Hkv) D] projection output, as the
    decoder produces them."""
    gen = torch.Generator().manual_seed(seed)
    block = page_tokens(device) if block is None else block
    counts = [-(-(n + 3) // block) for n in lengths]
    own = [c - shared_pages for c in counts]
    total = shared_pages + sum(own)
    order = torch.randperm(total, generator=gen).tolist()
    shared, rest = order[:shared_pages], order[shared_pages:]
    tables = []
    for c in own:
        tables.append(shared + rest[:c])
        rest = rest[c:]
    pool = torch.randn(total, 2, LAYERS, block, hkv, d, generator=gen).to(device=device, dtype=dtype)
    qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d, generator=gen).to(device=device, dtype=dtype)
    q = qkv[:, : hq * d].view(-1, hq, d)
    k_new = qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d)
    v_new = qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
    return Paged(pool, tables), q, k_new, v_new


def reference(q, paged, lengths, layer) -> torch.Tensor:
    k, v = paged.k, paged.v
    return decode_attention_ref(q, [c[layer, :n] for c, n in zip(k, lengths, strict=True)],
                                [c[layer, :n] for c, n in zip(v, lengths, strict=True)])


def in_dtype(q, paged, lengths, layer) -> torch.Tensor:
    """The same attention computed plainly by torch in q's dtype: the bf16 yardstick."""
    k, v = paged.k, paged.v
    outs = []
    for b, n in enumerate(lengths):
        group = q.shape[1] // k[b].shape[2]
        kb = k[b][layer, :n].repeat_interleave(group, 1).transpose(0, 1)  # [Hq, n, D]
        vb = v[b][layer, :n].repeat_interleave(group, 1).transpose(0, 1)
        scores = (kb @ q[b][:, :, None])[..., 0] * q.shape[-1] ** -0.5
        outs.append((scores.softmax(-1)[:, None, :] @ vb)[:, 0])
    return torch.stack(outs)


def assert_within(out, ref, atol, what) -> None:
    diff = (out.float() - ref.float()).abs()
    assert diff.max().item() <= atol, (
        f"{what}: max diff {diff.max().item():.3g} (allowed {atol:.3g}), mean diff {diff.mean().item():.3g}")


def check_decode(device, lengths, heads, dtype, with_new=True, layer=1, shared_pages=0, block=None):
    hq, hkv, d = HEADS[heads]
    paged, q, k_new, v_new = make_step(lengths, hq, hkv, d, dtype, device, shared_pages=shared_pages, block=block)
    out = decode_attention(q, paged.plan(lengths), layer, k_new if with_new else None, v_new if with_new else None,
                           backend="kernel")
    if device == "cuda":
        torch.cuda.synchronize()
    if with_new:
        k, v = paged.k, paged.v
        for b, n in enumerate(lengths):
            assert torch.equal(k[b][layer, n - 1], k_new[b]) and torch.equal(v[b][layer, n - 1], v_new[b])
    ref = reference(q, paged, lengths, layer)
    assert out.shape == q.shape and out.dtype == dtype
    what = f"{heads} lengths={lengths} {dtype}"
    if dtype == torch.float32:
        assert_within(out, ref, 2e-5, what)
    else:
        torch_err = (in_dtype(q, paged, lengths, layer).float() - ref).abs().max().item()
        assert_within(out, ref, 2 * torch_err + 1e-4, what)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_decode_attention(device, lengths, heads, dtype):
    check_decode(device, LENGTHS[lengths], heads, dtype)


def test_cpu_key_tile_is_the_kernels():
    """pyscore.ops.segments states the CPU kernels' key tile for processes without them (a KV page holds whole
    tiles): it must be the one the C++ kernels were built with."""
    module = _ext.cpu_module()
    if module is None:
        pytest.skip("needs pyscore._C")
    assert module.CPU_KEY_TILE == segments.CPU_KEY_TILE == segments.key_tile("cpu")


@pytest.mark.parametrize("isa", ["hardware", "avx2", "portable"])
@pytest.mark.parametrize("block", [32, 64])
def test_decode_attention_cpu_larger_pages(monkeypatch, isa, block):
    """Pages of any multiple of the CPU key tile (16): 32 and 64 tokens read as the store's 16."""
    if isa != "hardware":
        force_cpu_isa(monkeypatch, isa)
    for dtype in (torch.float32, torch.bfloat16):
        check_decode("cpu", LENGTHS["ragged"], "smollm-gqa3-d64", dtype, block=block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_decode_attention_avx2_cpu_path(monkeypatch, lengths, heads, dtype):
    """The AVX2 + FMA kernels (tiers avx2 and avx512), forced on a bigger CPU."""
    force_cpu_isa(monkeypatch, "avx2")
    check_decode("cpu", LENGTHS[lengths], heads, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_without_new_token_reads_the_cache_as_is(device):
    check_decode(device, LENGTHS["ragged"], "smollm-gqa3-d64", torch.float32, with_new=False, layer=0)


@pytest.mark.parametrize("device", [*DEVICES, "cpu-avx2"])
def test_sequence_result_does_not_depend_on_batch_mates(monkeypatch, device):
    """A sequence's output is bitwise the same alone and in a batch (chunking depends on its own length only)."""
    if device == "cpu-avx2":
        force_cpu_isa(monkeypatch, "avx2")
        device = "cpu"
    hq, hkv, d = HEADS["smollm-gqa3-d64"]
    lengths = [600, 40, 1]
    paged, q, _, _ = make_step(lengths, hq, hkv, d, torch.bfloat16, device)
    together = decode_attention(q, paged.plan(lengths), 2, backend="kernel")
    for b, n in enumerate(lengths):
        alone = decode_attention(q[b : b + 1], paged.plan([n], rows=[b]), 2, backend="kernel")
        assert torch.equal(alone[0], together[b]), f"sequence {b} (length {n})"


@pytest.mark.parametrize("device", [*DEVICES, "cpu-avx2", "cpu-portable"])
def test_a_shared_prefix_reads_as_a_copy(monkeypatch, device):
    """Sequences whose tables start with the same pages (a cached prefix, referenced not copied) get bitwise what
    they get with the same keys in pages of their own."""
    if device.startswith("cpu-"):
        force_cpu_isa(monkeypatch, device.removeprefix("cpu-"))
        device = "cpu"
    hq, hkv, d = HEADS["smollm-gqa3-d64"]
    lengths = [700, 650, 300]
    paged, q, k_new, v_new = make_step(lengths, hq, hkv, d, torch.bfloat16, device, shared_pages=4)
    shared = decode_attention(q, paged.plan(lengths), 1, k_new, v_new, backend="kernel")
    # The same keys, every sequence's pages its own: pages laid out one sequence after another.
    copies = [paged.pool[torch.tensor(t, device=paged.pool.device)] for t in paged.tables]
    own = Paged(torch.cat(copies), [])
    start = 0
    for t in paged.tables:
        own.tables.append(list(range(start, start + len(t))))
        start += len(t)
    assert torch.equal(decode_attention(q, own.plan(lengths), 1, backend="kernel"), shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_portable_cpu_path(monkeypatch, dtype):
    """The scalar code that runs on CPUs without AVX-512, forced on this one."""
    force_cpu_isa(monkeypatch, "portable")
    check_decode("cpu", LENGTHS["ragged"], "qwen3-gqa2-d128", dtype)


def test_cpu_thread_count_does_not_change_bits():
    hq, hkv, d = HEADS["qwen3-gqa2-d128"]
    lengths = LENGTHS["long"]
    paged, q, _, _ = make_step(lengths, hq, hkv, d, torch.bfloat16, "cpu")
    plan = paged.plan(lengths)
    module = _ext.cpu_module()
    threads = module.get_num_threads()
    try:
        module.set_num_threads(1)
        one = decode_attention(q, plan, 0, backend="kernel")
        module.set_num_threads(2)
        assert torch.equal(decode_attention(q, plan, 0, backend="kernel"), one)
    finally:
        module.set_num_threads(threads)


def test_reference_backend_writes_the_new_token_too():
    paged, q, k_new, v_new = make_step([4, 9], 4, 2, 64, torch.float32, "cpu")
    out = decode_attention(q, paged.plan([4, 9]), 1, k_new, v_new, backend="reference")
    assert torch.equal(paged.k[1][1, 8], k_new[1]) and torch.equal(paged.v[0][1, 3], v_new[0])
    assert_within(out, reference(q, paged, [4, 9], 1), 1e-6, "reference backend")


def test_arguments_are_checked_by_name():
    paged, q, k_new, _ = make_step([4, 9], 4, 2, 64, torch.float32, "cpu")
    k_pool, v_pool = paged.pool[:, 0], paged.pool[:, 1]
    with pytest.raises(ValueError, match="lengths\\[1\\]"):
        plan_decode(k_pool, v_pool, paged.tables, [4, 65])
    with pytest.raises(ValueError, match="one entry per sequence"):
        plan_decode(k_pool, v_pool, paged.tables[:1], [4, 9])
    with pytest.raises(ValueError, match="tables\\[0\\] must hold page indices"):
        plan_decode(k_pool, v_pool, [[99], paged.tables[1]], [4, 9])
    with pytest.raises(ValueError, match="multiple of 16 \\(the kernels' key tile on cpu\\)"):
        plan_decode(k_pool[:, :, :8], v_pool[:, :, :8], paged.tables, [4, 9])
    plan = paged.plan([4, 9])
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q[:, :3], plan, 0)
    with pytest.raises(ValueError, match="layer must be"):
        decode_attention(q, plan, LAYERS)
    with pytest.raises(ValueError, match="together"):
        decode_attention(q, plan, 0, k_new=k_new)


def test_new_keys_and_values_with_different_strides():
    """Qwen3.5's gated attention hands a normed (contiguous) k and a v still inside its projection output."""
    paged, q, k_new, v_new = make_step([7, 30], 4, 2, 64, torch.bfloat16, "cpu")
    k_new = k_new.contiguous()
    assert k_new.stride() != v_new.stride()
    out = decode_attention(q, paged.plan([7, 30]), 2, k_new, v_new, backend="kernel")
    assert torch.equal(paged.k[1][2, 29], k_new[1]) and torch.equal(paged.v[1][2, 29], v_new[1])
    ref = reference(q, paged, [7, 30], 2)
    bound = 2 * (in_dtype(q, paged, [7, 30], 2).float() - ref).abs().max().item() + 1e-4
    assert_within(out, ref, bound, "strides")


@pytest.mark.parametrize("heads", ["smollm-gqa3-d64", "qwen3-gqa2-d128"])
def test_bf16_widened_path_is_bitwise_the_dpbf16_path(monkeypatch, heads):
    """PYSCORE_BF16_DOT=widen (FMA on widened pairs: Intel's default, and tier avx512's only bf16 product) gives
    vdpbf16ps's bits (AMD's default); tier avx512 takes the widened one even where dpbf16 is asked for."""
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16")
    hq, hkv, d = HEADS[heads]
    lengths = LENGTHS["ragged"]
    paged, q, _, _ = make_step(lengths, hq, hkv, d, torch.bfloat16, "cpu", seed=6)
    plan = paged.plan(lengths)
    outs = {}
    for tier, path in (("avx512bf16", "dpbf16"), ("avx512bf16", "widen"), ("avx512", "dpbf16")):
        monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
        monkeypatch.setenv("PYSCORE_BF16_DOT", path)
        assert module.cpu_features()["bf16_dot"] == ("widen" if tier == "avx512" else path)
        outs[tier, path] = decode_attention(q, plan, 1, backend="kernel")
    assert torch.equal(outs["avx512bf16", "widen"], outs["avx512bf16", "dpbf16"])
    assert torch.equal(outs["avx512", "dpbf16"], outs["avx512bf16", "widen"])


@pytest.mark.parametrize("heads", list(HEADS))
def test_tier_avx512_runs_the_avx512_kernel(monkeypatch, heads):
    """Tier avx512 (AVX-512F without BF16) runs the AVX-512 ops in both dtypes: fp32, and bf16 on pairs widened to
    fp32 (no BF16 instruction in either: tests/ops/test_avx512_tier_isa.py), bitwise tier avx512bf16's with its bf16
    products widened, not the AVX2 ops' bits. A head size the AVX-512 ops lack (96) stays on the AVX2 ops."""
    hq, hkv, d = HEADS[heads]
    lengths = LENGTHS["ragged"]
    covered = d in (64, 128)
    monkeypatch.setenv("PYSCORE_BF16_DOT", "widen")
    for dtype in (torch.float32, torch.bfloat16):
        same_as = "avx512bf16" if covered else "avx2"
        paged, q, _, _ = make_step(lengths, hq, hkv, d, dtype, "cpu", seed=4)
        plan = paged.plan(lengths)
        out = outputs_at_tiers(monkeypatch, lambda q=q, plan=plan: decode_attention(q, plan, 1, backend="kernel"))
        # Their sums differ in order, so their bits differ; in bf16 the output's rounding hides that at most head
        # shapes (a few of 12288 outputs differ at this one).
        if covered and (dtype == torch.float32 or heads == "qwen3-gqa2-d128"):
            assert not torch.equal(out["avx512bf16"], out["avx2"]), "the kernels agree bitwise: the test cannot tell"
        assert torch.equal(out["avx512"], out[same_as]), f"{dtype} at tier avx512 is not tier {same_as}'s kernel"
