"""The ops pyscore's runner calls, each a documented wrapper over a CPU kernel, a CUDA kernel (attention, label
scores, Qwen3.5's linear attention) and a pure-PyTorch reference (`pyscore.ops.reference`)."""

from pyscore.ops.add_rms_norm import add_rms_norm
from pyscore.ops.decode_attention import DecodePlan, decode_attention, plan_decode
from pyscore.ops.gated_delta_rule import causal_conv1d, gated_delta_rule, plan_linear_attention
from pyscore.ops.label_logprobs import label_logprobs, lm_head_logits
from pyscore.ops.linear import LinearWeight, PackedLinear, PlainLinear, linear, pack_linear, prepare_linear
from pyscore.ops.prefix_item_attention import AttentionPlan, prefix_item_attention
from pyscore.ops.rotary import rotary_
from pyscore.ops.segments import CACHED_BEFORE_OWN, CACHED_BEFORE_PREFIX, CachedKeys, SegmentTable
from pyscore.ops.silu_mul import silu_mul

__all__ = [
    "CACHED_BEFORE_OWN", "CACHED_BEFORE_PREFIX", "AttentionPlan", "CachedKeys", "DecodePlan", "LinearWeight",
    "PackedLinear", "PlainLinear", "SegmentTable", "add_rms_norm", "causal_conv1d", "decode_attention",
    "gated_delta_rule", "label_logprobs", "linear", "lm_head_logits", "pack_linear", "plan_decode",
    "plan_linear_attention", "prefix_item_attention", "prepare_linear", "rotary_", "silu_mul",
]
