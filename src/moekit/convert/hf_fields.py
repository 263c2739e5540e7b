"""The ``config.json`` fields every family moekit writes shares, and the export checks they all need:
one home for the MoE exporters (``hf_config`` and ``deepseek``), so a fix to one (the norm eps
default, the token ids, a bias no family holds) reaches all."""

from __future__ import annotations

from typing import Any

import torch

from moekit.config import ModelConfig, MoEConfig
from moekit.convert.errors import ConversionError
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
        "use_cache": True,
    }


def check_fit(
    written_as: str,
    model: ModelConfig,
    moe: MoEConfig,
    misfits: dict[str, tuple[Any, Any]],
    *,
    biased_experts: bool = False,
    stores_expert_bias: bool = False,
) -> None:
    """Raise naming the first field the family written as cannot hold: the family's own ``misfits``
    ({field: (value, the value it needs)}) and those every family shares. Router and expert biases fit
    only a family with them (``biased_experts``: gpt-oss); a balancing bias that moves during training
    only one that stores it (``stores_expert_bias``: DeepSeek-V3)."""
    shared = {
        "model.norm": (model.norm, "rmsnorm"),
        "model.mlp_activation": (model.mlp_activation, "swiglu"),
        "model.experts_per_layer": (model.experts_per_layer, None),
        "moe.router": (moe.router, "topk"),
        "moe.capacity_factor": (moe.capacity_factor, None),
        "moe.residual": (moe.residual, False),
        "moe.router_bias": (moe.router_bias, moe.router_bias and biased_experts),
        "moe.expert_ffn_bias": (moe.expert_ffn_bias, moe.expert_ffn_bias and biased_experts),
        "moe.bias_update_rate": (moe.bias_update_rate, moe.bias_update_rate if stores_expert_bias else 0.0),
    }
    for field, (value, needed) in (shared | misfits).items():
        if value != needed:
            raise ConversionError(f"{written_as}: {field}={value!r} does not fit (it needs {needed!r})")
