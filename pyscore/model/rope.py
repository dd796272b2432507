"""Rotary position embeddings with the config's scaling. Inverse frequencies come from transformers' own
RoPE parameter functions (so linear / llama3 / yarn scaling match the checkpoint's intent); the rotation is
ours and is computed per token from explicit positions, which is what lets MIS items continue at
`len(query) + i` while sitting anywhere in the packed stream."""

from __future__ import annotations

from typing import Any

import torch

# Types whose frequencies do not depend on the sequence length (dynamic NTK only changes past the trained
# context, which the engine refuses anyway).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32, attention scaling applied to cos/sin)."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (float(params["rope_theta"]) ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class Rotary:
    """fp32 cos/sin tables [max_positions, D] for positions [0, max_positions), built once; the rotation itself is
    the `pyscore.ops.rotary_` op."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, device: torch.device) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)
