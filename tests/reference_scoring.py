"""An independent scorer on stock transformers: every query+item is run alone as one sequence, and the
label scores are read from `log_softmax(logits)` at the read-out positions. This is what pyscore must equal."""

from __future__ import annotations

import torch


def sequence(query: list[int], item: list[int], item_first: bool) -> list[int]:
    return item + query if item_first else query + item


@torch.no_grad()
def reference_scores(model, query: list[int], items: list[list[int]], labels: list[int], *,
                     apply_softmax: bool = False, item_first: bool = False, marker: int | None = None,
                     classifier: bool = False) -> list[list[list[float]]]:
    out = []
    for item in items:
        ids = sequence(query, item, item_first)
        if classifier:
            logits = model(torch.tensor([ids])).logits[0].float()  # [C], pooled at the last token
            chosen = logits[labels]
            out.append([(chosen.softmax(-1) if apply_softmax else chosen).tolist()])
            continue
        logits = model(torch.tensor([ids])).logits[0].float()  # [L, V]
        positions = [len(ids) - 1] if marker is None else [i for i, t in enumerate(ids) if t == marker]
        rows = []
        for pos in positions:
            if apply_softmax:
                rows.append(logits[pos, labels].softmax(-1).tolist())
            else:
                rows.append(logits[pos].log_softmax(-1)[labels].exp().tolist())
        out.append(rows)
    return out


def max_abs_diff(a: list[list[list[float]]], b: list[list[list[float]]]) -> float:
    ta = torch.tensor([v for item in a for row in item for v in row])
    tb = torch.tensor([v for item in b for row in item for v in row])
    assert ta.shape == tb.shape, (ta.shape, tb.shape)
    return float((ta - tb).abs().max()) if ta.numel() else 0.0
