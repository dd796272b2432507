"""Qwen3-8B's memory plan on the CPU in fp32 with its projections, embedding and LM head held in bf16 vs in fp32, and
in bf16, from the published config's tensor shapes (no checkpoint read): weight_bytes + plan_memory, as the loader
computes them, with the KV store at its default and at --kv-cache-mb 3328. It wrote section 4 of
bench/results/tiers/kernels/labels_avx2_bf16_head_ab.txt:

    python -m bench.probes.qwen3_8b_plan

(then run as an uncommitted plan8b.py, the same code).
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from pyscore.memory import Pools, plan_memory, weight_bytes
from pyscore.model.checkpoint import TensorSpec
from pyscore.model.config import ModelConfig


def main() -> None:
    hf = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                     max_position_embeddings=40960)
    cfg = ModelConfig.from_hf(hf)
    H, I, V, D = 4096, 12288, 151936, 128  # noqa: E741
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H),
                                          "model.norm.weight": (H,)}
    for i in range(36):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (32 * D, H), p + "self_attn.k_proj.weight": (8 * D, H),
                   p + "self_attn.v_proj.weight": (8 * D, H), p + "self_attn.o_proj.weight": (H, 32 * D),
                   p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I),
                   p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    specs = {n: TensorSpec(n, torch.bfloat16, s) for n, s in shapes.items()}
    for kv_mb in (None, 3328):
        pools = Pools(kv_cache_mb=kv_mb)
        for dtype, held in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
            plan = plan_memory(cfg, weight_bytes(cfg, specs, dtype, held), dtype, pools)
            matrices = "bf16" if held or dtype == torch.bfloat16 else "fp32"
            print(f"kv_cache_mb {kv_mb}: {dtype!s:15} matrices {matrices}: "
                  f"weights {plan.weight_bytes / 2**30:.2f} GiB, total {plan.expected_total_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
