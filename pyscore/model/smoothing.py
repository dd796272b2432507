"""SmoothQuant (Xiao et al., 2023) for quantize="int8", folded into the weights at load.

int8's activation rows are quantized with one scale each, set by the row's largest value; a few input channels of
each projection run far above the rest (in SmolLM2, 71% of the projections' input rows have a max |x| above 8x
their rms), and the rest of the row gets few of int8's levels. Smoothing divides input channel j of a projection by
s_j = amax_x[j]^ALPHA / amax_w[j]^(1 - ALPHA) and multiplies the weight's column j by it, which moves the channel's
range from the activations into the weight, whose per-output-channel scales hold it better.

Contract: `smooth(decoder, read_layer, tokenizer)` computes amax_x (max |x| of each projection's input, per channel)
over a calibration forward of CALIBRATION with the int8 weights loaded, then replaces each layer's int8 projections
with ones quantized from the checkpoint's weights read again (`read_layer`, pyscore.model.weights.layer_reader: one
layer in the dtype at a time, as at load) with s folded in, exactly in real arithmetic:
- qkv (attention layers) and Qwen3.5's in_proj (linear-attention layers): the input norm's weight / s;
- gate_up: the post-attention norm's weight / s;
- down: its input is silu(gate) * up, so the up rows (and bias) / s.
o_proj and Qwen3.5's out_proj are left as they are: one factor per channel cannot be folded into grouped-query
attention's shared v rows, nor into the gated norm's weight that every head shares. The calibration text is fixed,
so a model loads to the same weights every time; every bitwise promise of int8 (MIS = SIS, batch invariance) is a
property of the kernel and holds unchanged. Its effect on the scores is measured in docs/guarantees.md."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pyscore.model.packing import Group, pack
from pyscore.model.weights import LayerWeights, quantized
from pyscore.ops.linear import LinearWeight, PlainLinear
from pyscore.ops.linear_int8 import observing

log = logging.getLogger(__name__)

# The migration strength and the quantile below which s is raised (factors), chosen on two sets of 16 synthetic
# questions (seeds 0 and 2) on SmolLM2: median |dP(Yes)| 0.026 both, against 0.053 / 0.048 unsmoothed; alpha 0.6
# 0.027 / 0.032, a floor at the median 0.032 / 0.029, at 0.9 0.10 / 0.11, none 0.068 / 0.056
# (bench/results/int8/int8_smoothing_zen5.txt, python -m bench.probes.int8_smoothing).
ALPHA = 0.8
FLOOR = 0.75

# Prose, a list, code and a scoring prompt in the shape the service's users send: the calibration forward's input.
CALIBRATION = (
    "The committee reviewed the quarterly report and found that revenue had grown by twelve percent, while costs "
    "rose more slowly than expected. Several members asked whether the growth would last into the next year.",
    "Question: Is the following product review positive? Review: The battery lasts two days and the screen is "
    "bright, but the case cracked within a week. Answer with Yes or No.\nAnswer:",
    "Ingredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml of milk. Whisk the eggs and milk, add the "
    "flour slowly, and rest the batter for 30 minutes before cooking.",
    "def mean(values):\n    if not values:\n        raise ValueError('empty')\n    return sum(values) / len(values)\n",
    "Query: which city hosted the 1992 Summer Olympics? Candidate: Barcelona, Spain, hosted the Games of the XXV "
    "Olympiad from 25 July to 9 August 1992. Is the candidate relevant to the query? Yes or No.",
)


def calibrate(decoder: Any, token_lists: list[list[int]]) -> dict[int, torch.Tensor]:
    """id(projection) -> max |x| per input channel (fp32) over a forward of each token list."""
    amax: dict[int, torch.Tensor] = {}

    def observe(w: object, x: torch.Tensor) -> None:
        a = x.detach().abs().amax(0).float()
        seen = amax.get(id(w))
        amax[id(w)] = a if seen is None else torch.maximum(seen, a)

    with observing(observe):
        for tokens in token_lists:
            decoder.hidden_at(pack([Group(prefix=[], items=[tokens], readouts=[[len(tokens) - 1]])]))
    return amax


def factors(amax_x: torch.Tensor, weight: torch.Tensor, alpha: float | None = None) -> torch.Tensor:
    """s [K] for a projection's weight [N, K] whose input channels reach amax_x [K], at least its FLOOR quantile
    (alpha None: ALPHA; both read at the call, so a probe may set them).

    Only s's ratios matter (a common factor cancels in both operands' group scales). Unfloored, a channel that stayed
    quiet in the calibration text gets a small s, and where the served text drives it, x / s amplifies it past the
    others: the generic calibration text made the drift worse than none (0.068 against 0.053). Floored, smoothing only
    quiets the loud channels."""
    alpha = ALPHA if alpha is None else alpha
    amax_w = weight.float().abs().amax(0)
    s = amax_x.clamp_min(1e-5) ** alpha / amax_w.clamp_min(1e-5) ** (1 - alpha)
    return s.clamp_min(s.quantile(FLOOR))


def _scaled_columns(w: PlainLinear, s: torch.Tensor) -> PlainLinear:
    weight, bias = w.unpacked()
    return PlainLinear(weight.float() * s, bias, gated=w.gated)


def _divided(norm: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A norm's weight / s, held in fp32 (add_rms_norm scales the fp32 row by it before its one rounding)."""
    return norm.float() / s


def _mixer(layer: LayerWeights) -> LinearWeight | None:
    """The projection the input norm feeds: qkv, or a linear-attention layer's in_proj."""
    return layer.linear.in_proj if layer.linear is not None else layer.qkv


def fold(layer: LayerWeights, s: dict[str, torch.Tensor]) -> None:
    """Folds the factors of `s` (kind -> [K]: "input" for qkv / in_proj, "gate_up", "down") into the layer's float
    weights in place; the layer's function is unchanged in real arithmetic."""
    mixer = _mixer(layer)
    if "input" in s and mixer is not None:
        layer.input_norm = _divided(layer.input_norm, s["input"])
        mixed = _scaled_columns(mixer, s["input"])
        if layer.linear is not None:
            layer.linear.in_proj = mixed
        else:
            layer.qkv = mixed
    if "down" in s or "gate_up" in s:  # gate_up's one fp32 copy: its up rows / s of down, then its columns * s
        weight, bias = layer.gate_up.unpacked()
        weight = weight.to(torch.float32, copy=True)
        if "down" in s:  # down's input is silu(gate) * up: the up rows (gate_up's second half) / s
            half = weight.shape[0] // 2
            weight[half:] /= s["down"][:, None]
            if bias is not None:
                bias = bias.to(torch.float32, copy=True)
                bias[half:] /= s["down"]
            layer.down = _scaled_columns(layer.down, s["down"])
        if "gate_up" in s:
            layer.post_norm = _divided(layer.post_norm, s["gate_up"])
            weight *= s["gate_up"]
        layer.gate_up = PlainLinear(weight, bias, gated=True)


def smooth(decoder: Any, read_layer: Callable[[int], LayerWeights], tokenizer: Any) -> None:
    """The decoder's int8 layers replaced by smoothed ones (the module's contract)."""
    longest = decoder.cfg.max_position_embeddings  # a model with a short context reads each text's start
    token_lists = [t[:longest] for t in (list(tokenizer(text)["input_ids"]) for text in CALIBRATION) if t]
    amax = calibrate(decoder, token_lists)
    for i, held in enumerate(decoder.w.layers):
        source = read_layer(i)
        s = {"input": factors(amax[id(_mixer(held))], _mixer(source).unpacked()[0]),
             "gate_up": factors(amax[id(held.gate_up)], source.gate_up.unpacked()[0]),
             "down": factors(amax[id(held.down)], source.down.unpacked()[0])}
        fold(source, s)
        decoder.replace_layer(i, quantized(source))
    log.info("int8: SmoothQuant (alpha %.2f) folded into %d layers from a %d-token calibration forward", ALPHA,
             len(decoder.w.layers), sum(map(len, token_lists)))
