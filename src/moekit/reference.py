"""Plain per-token reference of the MoE layer: slow, obvious, and the yardstick for the fast path.

Tests compare ``MoE.forward`` (outputs and gradients) against ``moe_per_token``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moekit.experts.grouped import ExpertCompute
from moekit.layer import MoE


def expert_ffn_one_token(moe: MoE, expert: int, x_D: Tensor) -> Tensor:
    """One routed expert applied to one token."""
    experts = moe.experts
    compute = ExpertCompute(experts.activation, experts.w_in_bias, experts.w_out_bias)
    return compute(x_D, lambda x: x @ experts.w_in[expert], lambda h: h @ experts.w_out[expert], expert)


def moe_per_token(moe: MoE, x: Tensor, token_ids: Tensor | None = None) -> tuple[Tensor, int]:
    """The layer's output computed one (token, expert) assignment at a time, and the drop count.

    Capacity drops follow GShard order independently of the dispatcher: assignments are visited
    in the router's k-major order and an expert refuses rows once it holds its capacity.
    """
    cfg = moe.cfg
    x_TD = x.reshape(-1, cfg.d_model)
    routing = moe.router(x_TD, token_ids)
    capacity = None
    if cfg.capacity_factor is not None and cfg.router != "expert_choice":
        capacity = math.ceil(cfg.capacity_factor * routing.num_tokens * cfg.top_k / cfg.num_experts)
    held = [0] * cfg.num_experts
    dropped = 0
    rows: list[Tensor] = [torch.zeros_like(x_TD[0]) for _ in range(x_TD.shape[0])]
    for t, e, w in zip(routing.token_idx.tolist(), routing.expert_idx.tolist(), routing.weights, strict=True):
        if capacity is not None and held[e] >= capacity:
            dropped += 1
            continue
        held[e] += 1
        rows[t] = rows[t] + w * expert_ffn_one_token(moe, e, x_TD[t])
    y_TD = torch.stack(rows)
    if moe.residual_mlp is not None:
        mix = torch.softmax(moe.residual_gate(x_TD), dim=-1)
        y_TD = moe.residual_mlp(x_TD) * mix[:, :1] + y_TD * mix[:, 1:]
    if moe.shared is not None:
        shared_TD = moe.shared(x_TD)
        if moe.shared_gate is not None:  # Qwen2-MoE: token t's shared output times sigmoid(w . x_t)
            shared_TD = shared_TD * torch.sigmoid(x_TD @ moe.shared_gate.weight[0]).unsqueeze(1)
        y_TD = y_TD + shared_TD
    return y_TD.reshape(x.shape), dropped
