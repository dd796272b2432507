"""label_logprobs: the label scores at read-out rows without a vocabulary-wide softmax (see
csrc/label_logprobs/params.h). Returns fp32 (logprobs [R, K] under the full-vocabulary softmax, softmax over
each row's valid labels [R, K]); label ids < 0 are padding. The CPU or CUDA kernel runs where the registry in
pyscore/ops/_ext.py has one for the tensors' device and dtype, else the fp32 reference."""

from __future__ import annotations

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import label_logprobs_ref


def _check(hidden: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor) -> int:
    if hidden.dim() != 2 or hidden.stride(1) != 1:
        raise ValueError(f"hidden must be [R, H] contiguous in its last dim, got {tuple(hidden.shape)}")
    if weight is not None:
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.stride(1) != 1:
            raise ValueError(f"weight must be [V, H={hidden.shape[1]}] contiguous in its last dim, "
                             f"got {tuple(weight.shape)}")
        if weight.dtype != hidden.dtype or weight.device != hidden.device:
            raise ValueError("weight must match hidden's dtype and device")
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
    ]
    if hidden.is_cuda:
        args.append(_ext.cuda_stream(hidden.device))
    module.label_logprobs(*args)
    return logprobs, label_softmax
