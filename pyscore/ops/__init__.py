"""The two ops pyscore's runner calls, each a documented wrapper over a CPU kernel, a CUDA kernel and a
pure-PyTorch reference (`pyscore.ops.reference`)."""

from pyscore.ops.label_logprobs import label_logprobs
from pyscore.ops.prefix_item_attention import prefix_item_attention

__all__ = ["label_logprobs", "prefix_item_attention"]
