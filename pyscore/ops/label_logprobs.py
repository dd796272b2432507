"""label_logprobs: the label scores at read-out rows without a vocabulary-wide softmax (see
csrc/label_logprobs/label_logprobs.h). Returns fp32 (logprobs [R, K] under the full-vocabulary softmax, softmax over
each row's valid labels [R, K]); label ids < 0 are padding. The CPU or CUDA kernel runs where the registry in
pyscore/ops/_ext.py has one for the tensors' device and dtype, else the fp32 reference. `lm_head_logits` is the same
CPU vocabulary walk for Generate: every logit of a row, with the row's log-sum-exp.

On the CPU, fp32 hidden rows may read a bf16 LM head (what fp32 serving holds a bf16 checkpoint's head in:
pyscore.ops.linear.holds_bf16_weights): the kernel widens it exactly as it reads it, and every logit is bitwise the
one of the same values held in fp32; torch's paths widen a copy per call."""

from __future__ import annotations

import torch

from pyscore.ops import _ext
from pyscore.ops.linear import reads_bf16_weight
from pyscore.ops.reference import label_logprobs_ref


def _check(hidden: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor) -> int:
    if hidden.dim() != 2 or hidden.stride(1) != 1:
        raise ValueError(f"hidden must be [R, H] contiguous in its last dim, got {tuple(hidden.shape)}")
    if weight is not None:
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.stride(1) != 1:
            raise ValueError(f"weight must be [V, H={hidden.shape[1]}] contiguous in its last dim, "
                             f"got {tuple(weight.shape)}")
        readable = weight.dtype == hidden.dtype or reads_bf16_weight(hidden, weight.dtype)
        if weight.device != hidden.device or not readable:
            raise ValueError("weight must match hidden's dtype and device (or be bf16 under fp32 hidden on the CPU)")
    vocab = hidden.shape[1] if weight is None else weight.shape[0]
    if labels.dim() != 2 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels must be [R={hidden.shape[0]}, K], got {tuple(labels.shape)}")
    if labels.numel() and int(labels.max()) >= vocab:
        raise ValueError(f"labels must be < vocab size {vocab}")
    return vocab


def label_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [R, H] with LM head weight [V, H], or logits [R, V] with weight None; labels [R, K] int."""
    vocab = _check(hidden, weight, labels)
    module = _ext.kernel_for("label_logprobs", hidden.device, hidden.dtype, backend)
    if module is None or hidden.shape[0] == 0:
        return label_logprobs_ref(hidden, weight, labels.to(hidden.device))
    rows, num_labels = labels.shape
    labels = labels.to(device=hidden.device, dtype=torch.int32).contiguous()
    logprobs = torch.empty(rows, num_labels, dtype=torch.float32, device=hidden.device)
    label_softmax = torch.empty_like(logprobs)
    args = [
        hidden.data_ptr(), hidden.stride(0),
        0 if weight is None else weight.data_ptr(), 0 if weight is None else weight.stride(0),
        labels.data_ptr(), logprobs.data_ptr(), label_softmax.data_ptr(), 0,
        rows, hidden.shape[1], vocab, num_labels, _ext.torch_dtype_name(hidden.dtype),
        0, 0, weight is not None and weight.dtype != hidden.dtype,  # no logits out; a bf16 head under fp32 rows
    ]
    module.label_logprobs(*args, *((_ext.cuda_stream(hidden.device),) if hidden.is_cuda else ()))
    return logprobs, label_softmax


def lm_head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [R, H], LM head weight [V, H] -> (logits [R, V] fp32, logZ [R] fp32 or None). Where the registry has a
    CPU label_logprobs kernel for the tensors, its vocabulary walk writes every logit and each row's log-sum-exp
    (so log-softmax is logits - logZ: no second pass over the row), a row's values independent of the other rows.
    Elsewhere (CUDA, the reference backend): torch's product in the weight's dtype, widened, and logZ None."""
    _check(hidden, weight, torch.empty(hidden.shape[0], 0, dtype=torch.int32))
    module = _ext.kernel_for("label_logprobs", hidden.device, hidden.dtype, backend)
    if module is None or hidden.is_cuda or hidden.shape[0] == 0:
        return (hidden @ weight.to(hidden.dtype).T).float(), None  # a bf16 head under fp32: widened, exact
    rows, vocab = hidden.shape[0], weight.shape[0]
    logits = torch.empty(rows, vocab, dtype=torch.float32)
    logz = torch.empty(rows, dtype=torch.float32)
    module.label_logprobs(
        hidden.data_ptr(), hidden.stride(0), weight.data_ptr(), weight.stride(0), 0, 0, 0, logz.data_ptr(), rows,
        hidden.shape[1], vocab, 0, _ext.torch_dtype_name(hidden.dtype), logits.data_ptr(), vocab,
        weight.dtype != hidden.dtype,
    )
    return logits, logz
