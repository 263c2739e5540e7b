"""The ``config.json`` fields every family moekit writes shares: one home for the MoE exporters
(``hf_config`` and ``deepseek``), so a fix to one (the norm eps default, the token ids) reaches all."""

from __future__ import annotations

from typing import Any

import torch

from moekit.config import ModelConfig, MoEConfig
from moekit.convert.hf_rope import rope_to_hf


def common_fields(model: ModelConfig, moe: MoEConfig) -> dict[str, Any]:
    """Sizes, activation, norm, RoPE and defaults that mean the same in every written family."""
    eps = model.norm_eps if model.norm_eps is not None else torch.finfo(torch.float32).eps  # nn.RMSNorm's default
    return {
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.d_ff,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_experts_per_tok": moe.top_k,
        "hidden_act": "silu",
        "max_position_embeddings": model.context_length,
        "rms_norm_eps": eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": rope_to_hf(model),
        "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }
