"""ModelConfig: the few numbers the decoder needs, read from a transformers config of the Llama, Qwen2 or
Qwen3 family (causal LM or sequence-classification head). Anything else is refused at load time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architecture: str
    is_classifier: bool
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama attention_bias also biases o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        model_type = hf.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        architectures = list(getattr(hf, "architectures", None) or [])
        architecture = architectures[0] if architectures else f"{model_type.capitalize()}ForCausalLM"
        is_classifier = architecture.endswith("ForSequenceClassification")
        if not (is_classifier or architecture.endswith("ForCausalLM")):
            raise ValueError(f"unsupported architecture {architecture!r}: "
                             "need *ForCausalLM or *ForSequenceClassification")
        heads = hf.num_attention_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            model_type=model_type,
            architecture=architecture,
            is_classifier=is_classifier,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_q_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            num_labels=int(getattr(hf, "num_labels", 0)) if is_classifier else 0,
            id2label={int(k): str(v) for k, v in (getattr(hf, "id2label", None) or {}).items()},
            pad_token_id=getattr(hf, "pad_token_id", None),
        )
