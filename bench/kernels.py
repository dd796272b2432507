"""CPU kernel micro-benchmark, measured side by side in one run: prefix_item_attention (ours, one layer's run of a
plan made once per batch, vs torch SDPA with a dense mask vs the fp32 reference) on the MIS shape of a SmolLM2
question (prefix 270 + 16 items x 30) and its SIS twin (16 x 300), and label_logprobs (ours vs
log_softmax(h @ W.T).gather) at R = 16 and 1, V = 49152, H = 576; bf16 and fp32; medians after warm-up. Writes
bench/results/kernels_cpu.txt.
`--only linear`: Qwen3.5's linear-attention ops (causal_conv1d + gated_delta_rule, one layer's run of a plan made
once per batch) on the same MIS and SIS shapes at the Qwen3.5-0.8B layer shape, ours vs transformers' own torch
fallbacks (the chunked rule; MIS as the prefix, then the items batched from its final state) vs our fp32 reference.
Writes bench/results/kernels_linear_cpu.txt.
Usage: python -m bench.kernels [--threads 2] [--reps 30] [--only linear]"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import machine, median_ms
from pyscore.ops import AttentionPlan, SegmentTable, _ext, label_logprobs
from pyscore.ops.gated_delta_rule import causal_conv1d, gated_delta_rule, plan_linear_attention
from pyscore.ops.reference import (
    causal_conv1d_ref,
    gated_delta_rule_ref,
    label_logprobs_ref,
    prefix_item_attention_ref,
    segment_attention_mask,
)

RESULTS = Path(__file__).resolve().parent / "results" / "kernels_cpu.txt"
LINEAR_RESULTS = Path(__file__).resolve().parent / "results" / "kernels_linear_cpu.txt"
LIN_SHAPE = (16, 16, 128, 4)  # Qwen3.5-0.8B Gated DeltaNet: Hk, Hv, head dim, conv kernel
HQ, HKV, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
VOCAB, HIDDEN = 49152, 576


def mis_segments() -> torch.Tensor:
    """One group: a 270-token prefix, then 16 items of 30 tokens that each see it."""
    rows, prefix = [[0, 270, 0, 0]], 270
    rows += [[prefix + 30 * i, 30, 0, prefix] for i in range(16)]
    return torch.tensor(rows, dtype=torch.int32)


def sis_segments() -> torch.Tensor:
    """The same question scored SIS: 16 independent causal sequences of 300 tokens."""
    return torch.tensor([[300 * i, 300, 0, 0] for i in range(16)], dtype=torch.int32)


def fused_qkv(num_tokens: int, dtype: torch.dtype):
    """q/k/v as views into one [T, (Hq + 2 Hkv) D] projection output, as the decoder produces them."""
    qkv = torch.randn(num_tokens, (HQ + 2 * HKV) * HEAD_DIM).to(dtype)
    q = qkv[:, : HQ * HEAD_DIM].view(num_tokens, HQ, HEAD_DIM)
    k = qkv[:, HQ * HEAD_DIM : (HQ + HKV) * HEAD_DIM].view(num_tokens, HKV, HEAD_DIM)
    v = qkv[:, (HQ + HKV) * HEAD_DIM :].view(num_tokens, HKV, HEAD_DIM)
    return q, k, v


def heads_first(q, k, v):
    """[Hq, T, D] contiguous copies with the kv heads repeated for GQA: torch SDPA's fastest input layout (made
    outside the timed region, so the baseline is not charged for it)."""
    group = q.shape[1] // k.shape[1]
    return tuple(x.transpose(0, 1).repeat_interleave(n, 0).contiguous() for x, n in ((q, 1), (k, group), (v, group)))


def planned(segments: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """One layer's attention as the decoder runs it: the plan is made once per batch (not timed), each call runs
    it."""
    plan = AttentionPlan(SegmentTable.of(segments, q.shape[0]), HQ, HKV, HEAD_DIM, q.dtype, "cpu", backend="kernel")
    return lambda: plan.run(q, k, v)


def attention_rows(name: str, segments: torch.Tensor, dtype: torch.dtype, reps: int) -> list[str]:
    num_tokens = int(segments[:, 1].sum())
    q, k, v = fused_qkv(num_tokens, dtype)
    mask = segment_attention_mask(segments, num_tokens)
    qh, kh, vh = (x[None] for x in heads_first(q, k, v))  # [1, H, T, D]: 4-d takes torch's fused CPU kernel
    ours = median_ms(planned(segments, q, k, v), reps)
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask), max(3, reps // 10), warmup=1)
    ref = median_ms(lambda: prefix_item_attention_ref(q, k, v, segments), 3, warmup=1)
    dt = str(dtype).removeprefix("torch.")
    return [f"{'attention ' + name:<26}{dt:<10}{ours:>9.3f}{sdpa:>11.3f}{ref:>11.3f}{sdpa / ours:>11.1f}x"
            f"{ref / ours:>10.1f}x"]


def sis_batched_rows(dtype: torch.dtype, reps: int) -> list[str]:
    """SIS against torch at its best: the 16 sequences as a padded-free batch [16, Hq, 300, D], is_causal."""
    segments = sis_segments()
    q, k, v = fused_qkv(int(segments[:, 1].sum()), dtype)
    # [Hq, 16 * 300, D] -> [16, Hq, 300, D]
    qb, kb, vb = (x.view(HQ, 16, 300, HEAD_DIM).transpose(0, 1).contiguous() for x in heads_first(q, k, v))
    ours = median_ms(planned(segments, q, k, v), reps)
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True), reps)
    dt = str(dtype).removeprefix("torch.")
    return [f"{'  (torch batched causal)':<26}{dt:<10}{ours:>9.3f}{sdpa:>11.3f}{'':>11}{sdpa / ours:>11.1f}x"]


def label_rows(rows: int, dtype: torch.dtype, reps: int) -> list[str]:
    h = torch.randn(rows, HIDDEN).to(dtype)
    w = (torch.randn(VOCAB, HIDDEN) * HIDDEN**-0.5).to(dtype)
    labels = torch.randint(0, VOCAB, (rows, 2), dtype=torch.int32)
    index = labels.long()
    ours = median_ms(lambda: label_logprobs(h, w, labels, backend="kernel"), reps)
    plain = median_ms(lambda: torch.log_softmax((h @ w.T).float(), -1).gather(1, index), reps)
    ref = median_ms(lambda: label_logprobs_ref(h, w, labels), 3, warmup=1)
    dt = str(dtype).removeprefix("torch.")
    return [f"{f'label_logprobs R={rows}':<26}{dt:<10}{ours:>9.3f}{plain:>11.3f}{ref:>11.3f}{plain / ours:>11.1f}x"
            f"{ref / ours:>10.1f}x"]


def linear_inputs(num_tokens: int, dtype: torch.dtype, heads: tuple[int, int, int, int] = LIN_SHAPE,
                  device: str = "cpu"):
    """(x [T, C] conv input, conv weight [C, K], the rule's inputs as views into one projection output) for a
    Gated DeltaNet layer of (Hk, Hv, D, K)."""
    hk, hv, d, taps = heads
    channels = 2 * hk * d + hv * d
    g = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, channels, generator=g, device=device).to(dtype)
    weight = (torch.randn(channels, taps, generator=g, device=device) * 0.5).to(dtype)
    y = torch.randn(num_tokens, channels + 2 * hv, generator=g, device=device).to(dtype)
    q = y[:, : hk * d].view(num_tokens, hk, d)
    k = y[:, hk * d : 2 * hk * d].view(num_tokens, hk, d)
    v = y[:, 2 * hk * d : channels].view(num_tokens, hv, d)
    a, b = y[:, channels : channels + hv], y[:, channels + hv :]
    a_log, dt_bias = torch.randn(2, hv, generator=g, device=device).unbind(0)
    return x, weight, (q, k, v, a, b, a_log * 0.5, dt_bias)


def transformers_linear(x, weight, rule_args, prefix: int, items: int, item_len: int):
    """What transformers' Qwen3.5 torch fallbacks need for the same work: MIS as the prefix (final state and conv
    tail kept), then the items batched [n, L] continuing from it; SIS (prefix 0) as a batch of n sequences. Returns
    the items' rule outputs [n L, Hv, Dv]."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule

    q, k, v, a, b, a_log, dt_bias = rule_args
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    beta = b.sigmoid()

    def rule(sl, batch, length, state=None):
        parts = [t[sl].reshape(batch, length, *t.shape[1:]) for t in (q, k, v, g, beta)]
        return torch_chunk_gated_delta_rule(*parts, initial_state=state, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)

    def conv(sl, batch, length, tail=None):
        xs = x[sl].reshape(batch, length, -1).transpose(1, 2)
        if tail is not None:
            xs = torch.cat([tail.expand(batch, -1, -1), xs], dim=-1)
        return causal_conv1d_fn(xs, weight, None, activation="silu")[..., -length:]

    if not prefix:
        conv(slice(None), items, item_len)
        return rule(slice(None), items, item_len)[0].flatten(0, 1)
    conv(slice(0, prefix), 1, prefix)
    _, state = rule(slice(0, prefix), 1, prefix)
    conv(slice(prefix, None), items, item_len, x[prefix - weight.shape[1] + 1 : prefix].T[None])
    return rule(slice(prefix, None), items, item_len, state.expand(items, -1, -1, -1).contiguous())[0].flatten(0, 1)


def linear_rows(name: str, prefix: int, items: int, item_len: int, dtype: torch.dtype, reps: int) -> list[str]:
    segments = mis_segments() if prefix else sis_segments()
    num_tokens = int(segments[:, 1].sum())
    x, weight, rule_args = linear_inputs(num_tokens, dtype)
    table = SegmentTable.of(segments, num_tokens)
    plan = plan_linear_attention(table)

    def ours():
        causal_conv1d(x, weight, table, plan, backend="kernel")
        gated_delta_rule(*rule_args, table, plan, backend="kernel")

    def reference():
        causal_conv1d_ref(x, weight, segments)
        gated_delta_rule_ref(*rule_args, segments)

    mine = median_ms(ours, reps)
    theirs = median_ms(lambda: transformers_linear(x, weight, rule_args, prefix, items, item_len), max(3, reps // 5),
                       warmup=1)
    ref = median_ms(reference, 1, warmup=0)
    # The items' rule outputs, ours vs transformers' on the same (dtype) inputs computed in fp32.
    got = gated_delta_rule(*rule_args, table, plan, backend="kernel")[prefix:].float()
    want = transformers_linear(x.float(), weight.float(), [t.float() for t in rule_args], prefix, items, item_len)
    dt = str(dtype).removeprefix("torch.")
    return [f"{'conv+rule ' + name:<26}{dt:<10}{mine:>9.3f}{theirs:>13.3f}{ref:>11.1f}{theirs / mine:>11.1f}x"
            f"{ref / mine:>10.0f}x{(got - want).abs().max().item():>11.1e}"]


def linear_main(args) -> None:
    lines = [
        f"machine: {machine()}",
        f"torch {torch.__version__}, threads {args.threads}, cpu features {_ext.cpu_module().cpu_features()}",
        "Qwen3.5-0.8B linear-attention layer: Hk {}, Hv {}, Dk = Dv = {}, conv kernel {}; ".format(*LIN_SHAPE) +
        "ours = causal_conv1d + gated_delta_rule (segment table)",
        "'transformers' = causal_conv1d_fn + torch_chunk_gated_delta_rule (their torch fallbacks; MIS: the prefix, "
        "then the items batched from its final state and conv tail); times: median ms; max diff: the items' rule "
        "outputs, ours vs transformers' in fp32 on the same inputs",
        "",
        f"{'op / shape':<26}{'dtype':<10}{'ours':>9}{'transformers':>13}{'reference':>11}{'tf/ours':>12}"
        f"{'ref/ours':>11}{'max diff':>11}",
    ]
    print("\n".join(lines), flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        rows = linear_rows("MIS 270+16x30", 270, 16, 30, dtype, args.reps)
        rows += linear_rows("SIS 16x300", 0, 16, 300, dtype, args.reps)
        print("\n".join(rows), flush=True)
        lines += rows
    LINEAR_RESULTS.write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {LINEAR_RESULTS}")


def interleave_rows(reps: int) -> list[str]:
    """Our OpenMP kernel between torch matmuls, as in the decoder (qkv projection -> attention -> o projection):
    if the two thread pools fought (spin-waiting on 2 cores), the interleaved step would cost more than the sum
    of its parts measured alone."""
    segments = mis_segments()
    num_tokens = int(segments[:, 1].sum())
    x = torch.randn(num_tokens, 576).bfloat16()
    w_qkv = torch.randn((HQ + 2 * HKV) * HEAD_DIM, 576).bfloat16()
    w_o = torch.randn(576, HQ * HEAD_DIM).bfloat16()
    q, k, v = fused_qkv(num_tokens, torch.bfloat16)

    def matmuls():
        return (x @ w_qkv.T)[:, : HQ * HEAD_DIM] @ w_o.T

    kernel = planned(segments, q, k, v)

    def step():
        qkv = x @ w_qkv.T
        out = kernel()
        return out.view(num_tokens, -1) @ w_o.T + qkv[:, :576]

    alone = median_ms(matmuls, reps) + median_ms(kernel, reps)
    both = median_ms(step, reps)
    return [f"{'matmul+attention step':<26}{'bfloat16':<10}{'sum of parts alone':>20}{alone:>9.3f}"
            f"{'interleaved':>13}{both:>9.3f}{both / alone:>9.2f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--only", choices=["linear"], help="only Qwen3.5's linear-attention ops")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    module = _ext.cpu_module()
    if module is None:
        raise SystemExit("pyscore._C is not built: python setup.py build_ext --inplace")
    module.set_num_threads(args.threads)
    if args.only == "linear":
        linear_main(args)
        return
    lines = [
        f"machine: {machine()}",
        f"torch {torch.__version__}, threads {args.threads}, cpu features {module.cpu_features()}",
        "times: median ms; 'torch' = SDPA with a dense [T, T] bool mask (attention) or "
        "log_softmax((h @ W.T).float()).gather (labels)",
        "",
        f"{'op / shape':<26}{'dtype':<10}{'ours':>9}{'torch':>11}{'reference':>11}{'torch/ours':>12}{'ref/ours':>11}",
    ]
    print("\n".join(lines), flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        rows = attention_rows("MIS 270+16x30", mis_segments(), dtype, args.reps)
        rows += attention_rows("SIS 16x300", sis_segments(), dtype, args.reps) + sis_batched_rows(dtype, args.reps)
        rows += label_rows(16, dtype, args.reps) + label_rows(1, dtype, args.reps)
        print("\n".join(rows), flush=True)
        lines += rows
    rows = ["", "thread pools: torch matmuls and our kernel alternating (one decoder layer's pattern, MIS shape)"]
    rows += interleave_rows(args.reps)
    print("\n".join(rows), flush=True)
    lines += rows
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    main()
