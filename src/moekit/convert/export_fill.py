"""Tensors a Hugging Face family always has and a moekit model may lack, filled with values that
compute the same function, so that exporting never changes what the model computes.

Qwen3-MoE has one ``attention_bias`` for q/k/v and the output projection alike; gpt-oss always has
attention biases, sinks, expert biases and a router bias. Zero biases add nothing; a sink of -inf
adds ``exp(-inf) = 0`` to each softmax denominator.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from moekit.config import ModelConfig, MoEConfig


def fill_for_family(
    model_type: str, state: dict[str, Tensor], model: ModelConfig, moe: MoEConfig
) -> tuple[dict[str, Tensor], ModelConfig, MoEConfig]:
    """The state dict and configs with the family's always-present tensors added (``qwen3_moe``, ``gpt_oss``)."""
    oss = model_type == "gpt_oss"
    biased = oss or model.qkv_bias or model.attn_out_bias
    state = dict(state)
    qkv_rows = (model.n_heads + 2 * model.kv_heads) * model.head_size
    for i in range(model.n_layers):
        attn = f"blocks.{i}.attn."
        if biased:
            state.setdefault(attn + "qkv.bias", torch.zeros(qkv_rows))
            state.setdefault(attn + "out.bias", torch.zeros(model.d_model))
        if oss:
            state.setdefault(attn + "sinks", torch.full((model.n_heads,), float("-inf")))
            ffn = f"blocks.{i}.ffn."
            state.setdefault(ffn + "router.gate.bias", torch.zeros(moe.num_experts))
            w_in, w_out = state[ffn + "experts.w_in"], state[ffn + "experts.w_out"]
            state.setdefault(ffn + "experts.w_in_bias", w_in.new_zeros(w_in.shape[0], w_in.shape[2]))
            state.setdefault(ffn + "experts.w_out_bias", w_out.new_zeros(w_out.shape[0], w_out.shape[2]))
    model = replace(model, qkv_bias=biased, attn_out_bias=biased, attn_sinks=model.attn_sinks or oss)
    if oss:
        moe = replace(moe, expert_ffn_bias=True, router_bias=True)
    return state, model, moe
