"""Kernel benchmark of the two hot ops on the study's shapes, side by side in one run:
- prefix_item_attention (ours) vs torch SDPA with a dense [T, T] bool mask, on the MIS stream of a question
  (query 300 + n items of 32 tokens, n = 2/5/9/16) with Qwen3-0.6B heads (16/8 x 128) and Qwen3-8B heads (32/8);
  plus the error of each against the fp32 reference, and the MIS-vs-SIS difference of the items' attention
  outputs (the same item tokens attended in the MIS layout and as their own query+item sequences);
- label_logprobs (ours) vs log_softmax((h @ W.T).float()).gather at R = 16, V = 151936, H = 1024 / 4096;
- Qwen3.5's linear-attention ops (causal_conv1d + gated_delta_rule, ours) vs transformers' torch fallbacks (the
  chunked rule: the query, then the items batched from its state) on the same MIS streams with Qwen3.5-4B's
  Gated DeltaNet shape (16 key / 32 value heads of 128, conv kernel 4), and the items' max difference.
CUDA events on the GPU (median over reps after warm-up), the host clock on the CPU (`--tiny`: small shapes, for
the plumbing tests). Writes JSON.

    python -m bench.gpu.kernel_bench --out kernels.json
    python -m bench.gpu.kernel_bench --tiny --out /tmp/kernels.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import fused_qkv, segment_rows
from bench.gpu.common import cli, device_ms, environment, record, summarize
from bench.kernels import linear_attention_pair
from bench.summary import write_json
from pyscore.engine import set_threads
from pyscore.ops import AttentionPlan, SegmentTable, _ext, label_logprobs, prefix_item_attention
from pyscore.ops.reference import label_logprobs_ref, prefix_item_attention_ref, segment_attention_mask

HEADS = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128), "tiny": (4, 2, 64)}
HIDDEN = {"qwen3-0.6b": 1024, "qwen3-8b": 4096, "tiny": 128}
LINEAR = {"qwen3.5-4b": (16, 32, 128, 4), "tiny": (2, 4, 32, 4)}  # Hk, Hv, head dim, conv kernel


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def attention_case(model: str, query: int, items: list[int], dtype: torch.dtype, device: str, reps: int,
                   ref_check: bool) -> dict[str, Any]:
    hq, hkv, d = HEADS[model]
    segments = segment_rows(query, items)  # the MIS stream
    t = int(segments[:, 1].sum())
    q, k, v = fused_qkv(t, hq, hkv, d, dtype, device, seed=t)
    mask = segment_attention_mask(segments, t).to(device)
    # SDPA at its best: heads first, contiguous, kv heads repeated for GQA (made outside the timed region)
    qh, kh, vh = (x.transpose(0, 1).repeat_interleave(r, 0).contiguous()[None]
                  for x, r in ((q, 1), (k, hq // hkv), (v, hq // hkv)))
    # Planned once, as a forward pass does; the timed call is one layer's run.
    plan = AttentionPlan(SegmentTable.of(segments, t, device), hq, hkv, d, dtype, device, backend="kernel")
    ours = summarize(device_ms(lambda: plan.run(q, k, v), device, reps))
    sdpa = summarize(device_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask), device, reps))
    out: dict[str, Any] = dict(model=model, query=query, items=len(items), tokens=t, dtype=str(dtype),
                               ours_ms=ours["p50"], sdpa_dense_mask_ms=sdpa["p50"],
                               sdpa_over_ours=sdpa["p50"] / ours["p50"])
    if ref_check:
        ref = prefix_item_attention_ref(q, k, v, segments.to(device))
        ours_out = plan.run(q, k, v)
        sdpa_out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)[0].transpose(0, 1)
        out.update(ours_rel_err=rel_err(ours_out, ref), sdpa_rel_err=rel_err(sdpa_out, ref),
                   ours_max_abs=float((ours_out.float() - ref).abs().max()))
    return out


def mis_vs_sis_attention(model: str, query: int, items: list[int], dtype: torch.dtype, device: str) -> dict[str, Any]:
    """The items' tokens attended in the MIS layout vs the same tokens (same q/k/v rows) in SIS layout."""
    hq, hkv, d = HEADS[model]
    t_mis = query + sum(items)
    q, k, v = fused_qkv(t_mis, hq, hkv, d, dtype, device, seed=1)
    # SIS stream: query rows then item i's rows, per item
    index, item_rows_sis, item_rows_mis, start_mis, start_sis = [], [], [], query, 0
    for n in items:
        index += list(range(query)) + list(range(start_mis, start_mis + n))
        item_rows_sis += range(start_sis + query, start_sis + query + n)
        item_rows_mis += range(start_mis, start_mis + n)
        start_mis += n
        start_sis += query + n
    idx = torch.tensor(index, device=device)
    seg_mis, seg_sis = segment_rows(query, items).to(device), segment_rows(0, [query + n for n in items]).to(device)
    mis = prefix_item_attention(q, k, v, seg_mis, backend="kernel")
    sis = prefix_item_attention(q[idx], k[idx], v[idx], seg_sis, backend="kernel")
    a = mis[torch.tensor(item_rows_mis, device=device)].float()
    b = sis[torch.tensor(item_rows_sis, device=device)].float()
    return dict(model=model, items=len(items), max_abs=float((a - b).abs().max()), max_value=float(b.abs().max()))


def label_case(hidden: int, vocab: int, rows: int, dtype: torch.dtype, device: str, reps: int) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(hidden)
    h = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (rows, 2), generator=g, device=device, dtype=torch.int32)
    labels_cpu, index = labels.cpu(), labels.long()
    ours = summarize(device_ms(lambda: label_logprobs(h, w, labels_cpu, backend="kernel"), device, reps))
    plain = summarize(device_ms(lambda: torch.log_softmax((h @ w.T).float(), -1).gather(1, index), device, reps))
    ref, _ = label_logprobs_ref(h, w, labels)
    got, _ = label_logprobs(h, w, labels_cpu, backend="kernel")
    torch_lp = torch.log_softmax((h @ w.T).float(), -1).gather(1, index)
    return dict(hidden=hidden, vocab=vocab, rows=rows, dtype=str(dtype), ours_ms=ours["p50"], torch_ms=plain["p50"],
                torch_over_ours=plain["p50"] / ours["p50"], ours_max_abs=float((got - ref).abs().max()),
                torch_max_abs=float((torch_lp - ref).abs().max()),
                weight_read_ms_at_4_3TBs=2 * vocab * hidden / 4.3e12 * 1e3)


def linear_case(model: str, query: int, items: list[int], dtype: torch.dtype, device: str, reps: int
                ) -> dict[str, Any]:
    """conv + rule over one MIS stream, ours vs transformers' fallbacks (items of equal length, so they batch)."""
    ours, theirs, _, diff, scale = linear_attention_pair(query, len(items), items[0], dtype, LINEAR[model], device)
    mine = summarize(device_ms(ours, device, reps))
    slow = summarize(device_ms(theirs, device, max(3, reps // 10)))
    return dict(model=model, query=query, items=len(items), tokens=query + sum(items), dtype=str(dtype),
                ours_ms=mine["p50"], transformers_ms=slow["p50"], transformers_over_ours=slow["p50"] / mine["p50"],
                items_max_abs=diff, items_max_value=scale)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    tiny = args.tiny
    module = _ext.cuda_module() if device != "cpu" else _ext.cpu_module()
    report: dict[str, Any] = dict(env=environment(device), attention=[], mis_vs_sis=[], label_logprobs=[],
                                  linear=[], errors=[])
    if module is None:
        report["errors"].append(f"no kernel module for {device}: {_ext.import_error(_ext.CUDA_MODULE)}")
        write_json(args.out, report)
        return report
    models = ["tiny"] if tiny else ["qwen3-0.6b", "qwen3-8b"]
    query, item_len = (24, 5) if tiny else (300, 32)
    counts = [2, 5] if tiny else [2, 5, 9, 16]
    dtype = torch.bfloat16
    for model in models:
        for n in counts:
            record(report, args.out, "attention", f"attention {model} n={n}", attention_case, model, query,
                   [item_len + (i % 3) for i in range(n)], dtype, device, args.reps, ref_check=n in (2, 16) or tiny)
        record(report, args.out, "mis_vs_sis", f"mis_vs_sis {model}", mis_vs_sis_attention, model, query,
               [item_len + (i % 3) for i in range(16)], dtype, device)
    for hidden in ([HIDDEN["tiny"]] if tiny else [HIDDEN["qwen3-0.6b"], HIDDEN["qwen3-8b"]]):
        record(report, args.out, "label_logprobs", f"label_logprobs H={hidden}", label_case, hidden,
               1000 if tiny else 151936, 16, dtype, device, args.reps)
    for n in counts:
        record(report, args.out, "linear", f"linear n={n}", linear_case, "tiny" if tiny else "qwen3.5-4b", query,
               [item_len] * n, dtype, device, args.reps)
    return report


def table(report: dict[str, Any]) -> str:
    lines = [f"# kernels on {report['env'].get('gpu', report['env']['device'])}: median ms",
             f"{'attention (MIS stream)':<28}{'T':>6}{'ours':>9}{'sdpa+mask':>11}{'ratio':>8}{'rel err':>10}"]
    for r in report["attention"]:
        lines.append(f"{r['model'] + ' n=' + str(r['items']):<28}{r['tokens']:>6}{r['ours_ms']:>9.3f}"
                     f"{r['sdpa_dense_mask_ms']:>11.3f}{r['sdpa_over_ours']:>7.1f}x"
                     f"{r.get('ours_rel_err', float('nan')):>10.1e}")
    for r in report["mis_vs_sis"]:
        lines.append(f"MIS vs SIS attention {r['model']} n={r['items']}: max abs {r['max_abs']:.2e} "
                     f"(values up to {r['max_value']:.2f})")
    for r in report["label_logprobs"]:
        lines.append(f"label_logprobs R={r['rows']} V={r['vocab']} H={r['hidden']}: ours {r['ours_ms']:.3f} ms, "
                     f"torch {r['torch_ms']:.3f} ms ({r['torch_over_ours']:.1f}x), max abs vs fp32 ours "
                     f"{r['ours_max_abs']:.1e} torch {r['torch_max_abs']:.1e}")
    for r in report.get("linear", []):
        lines.append(f"conv+gated_delta_rule {r['model']} {r['query']}+{r['items']}x: ours {r['ours_ms']:.3f} ms, "
                     f"transformers {r['transformers_ms']:.3f} ms ({r['transformers_over_ours']:.1f}x), items max abs "
                     f"{r['items_max_abs']:.1e} (values up to {r['items_max_value']:.2f})")
    lines += [f"error: {e}" for e in report["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU (plumbing tests)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cpu with --tiny, else cuda)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per case (default 50; 3 with --tiny)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.reps = args.reps or (3 if args.tiny else 50)
    torch.manual_seed(0)
    set_threads(args.threads)
    return cli(run(args), args.out, table)


if __name__ == "__main__":
    main()
