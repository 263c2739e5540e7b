"""The MoE layer: router -> dispatcher -> grouped experts -> combine (+ shared / residual MLP).

Legend: T tokens, D model dim, E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moekit.config import MoEConfig
from moekit.dispatch import LocalDispatcher
from moekit.dispatch.base import Dispatcher
from moekit.experts import DenseFFN, GroupedExperts
from moekit.experts.grouped import Activation
from moekit.routing import RouterOutput, build_router, router_z_loss, switch_aux_loss
from moekit.stats import MoEStats


class MoE(nn.Module):
    """A mixture-of-experts FFN. ``forward(x)`` maps ``[..., d_model]`` to the same shape.

    ``forward(x, return_stats=True)`` also returns the call's ``MoEStats``; the layer keeps none of
    it. With ``losses=False`` those carry the routing counts only (no balancing losses: decoding
    through a KV cache reads the counts, and at a few tokens the losses cost more than the routing).
    Hash routing needs ``token_ids`` (same leading shape as x).
    """

    def __init__(self, cfg: MoEConfig, index: int = 0, experts_device: torch.device | str | None = None) -> None:
        """``experts_device="meta"``: the routed experts built without storage (``GroupedExperts``)."""
        super().__init__()
        self.cfg = cfg
        self.index = index  # position among the model's MoE layers: the order of stats and loads
        self.router = build_router(cfg)
        self.dispatcher: Dispatcher = LocalDispatcher(
            cfg.num_experts, cfg.capacity_factor if cfg.router != "expert_choice" else None
        )
        activation = Activation(cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        self.experts = GroupedExperts(
            cfg.num_experts,
            cfg.d_model,
            cfg.d_ff,
            activation,
            cfg.gemm,
            bias=cfg.expert_ffn_bias,
            device=experts_device,
        )
        self.shared = DenseFFN(cfg.d_model, cfg.shared_hidden, cfg.activation) if cfg.num_shared_experts else None
        # Qwen2-MoE: the shared experts' output is scaled per token by sigmoid(x @ w_gate).
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_expert_gate else None
        self.residual_mlp = DenseFFN(cfg.d_model, cfg.d_ff, cfg.activation) if cfg.residual else None
        self.residual_gate = nn.Linear(cfg.d_model, 2) if cfg.residual else None

    def forward(self, x: Tensor, token_ids: Tensor | None = None, return_stats: bool = False, losses: bool = True):
        x_TD = x.reshape(-1, self.cfg.d_model)
        routing = self.router(x_TD, token_ids)
        y_TD, meta = self.dispatcher.apply(x_TD, routing, self.experts)
        y = self.add_dense(x_TD, y_TD).to(x.dtype).reshape(x.shape)
        if not return_stats:
            return y
        return y, self._stats(routing, meta.tokens_per_expert, meta.routed_per_expert, losses)

    def add_dense(self, x_TD: Tensor, y_TD: Tensor) -> Tensor:
        """The routed experts' output ``y`` with what the dense experts add: the residual MLP's mix and the
        shared experts (both none in most models)."""
        if self.residual_mlp is not None:
            # DeepSpeed PR-MoE: a per-token learned mix of the dense MLP and the experts.
            mix = torch.softmax(self.residual_gate(x_TD), dim=-1)
            y_TD = self.residual_mlp(x_TD) * mix[:, :1] + y_TD * mix[:, 1:]
        if self.shared is not None:
            shared_TD = self.shared(x_TD)
            if self.shared_gate is not None:
                shared_TD = shared_TD * torch.sigmoid(self.shared_gate(x_TD))
            y_TD = y_TD + shared_TD
        return y_TD

    def _stats(self, routing: RouterOutput, kept: Tensor, routed: Tensor, losses: bool) -> MoEStats:
        if not losses:
            return MoEStats(None, None, None, routed, routed - kept, routing.num_tokens)
        zero = torch.zeros((), device=routed.device)
        has_scores = routing.probs is not None and routing.num_tokens > 0  # no tokens: no loss, not 0/0
        aux = switch_aux_loss(routing.probs, routed) if has_scores else zero
        z = router_z_loss(routing.logits) if has_scores else zero
        loss = self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z
        return MoEStats(aux, z, loss, routed, routed - kept, routing.num_tokens)

    def set_step(self, step: int) -> None:
        """Tell a scheduled router (the DTS gate) the optimizer step about to run."""
        if self.cfg.dts_steps:
            self.router.step = step

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: Tensor) -> None:
        """Aux-loss-free balancing: nudge the router's selection bias from the observed load."""
        if self.cfg.bias_update_rate > 0:
            self.router.update_bias(tokens_per_expert)
