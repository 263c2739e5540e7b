"""Routers, their output, the balancing losses and the aux-loss-free bias update.

Legend: T tokens, D model dim, E experts, K picks per token, R assignments (token, expert) pairs.

Every router returns the same ``RouterOutput``: a flat list of assignments, so token-choice,
expert-choice and hash routing all feed one dispatcher. Token-choice assignments are laid out
k-major (all first choices, then all second choices, ...), which is GShard's priority order when
an expert overflows its capacity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.config import MoEConfig
from moekit.errors import OptionError


@dataclass(frozen=True)
class RouterOutput:
    """What a router decided for T tokens; handed to the dispatcher, never stored on a module."""

    token_idx: Tensor  # [R] long: token of each assignment
    expert_idx: Tensor  # [R] long: expert of each assignment
    weights: Tensor  # [R] combine weight of each assignment (differentiable)
    logits: Tensor | None  # [T, E] fp32 router logits (None for hash routing)
    probs: Tensor | None  # [T, E] fp32 normalised scores used by the aux loss
    num_tokens: int  # T
    num_picks: int  # T * k requested: what capacity is measured against, before random drops


# ---------------------------------------------------------------------------------------------
# What each router reads: its own few fields of ``MoEConfig`` (documented there), by the same names.


@dataclass(frozen=True)
class TopKRouterConfig:
    router: str  # topk | switch | gshard (random second dispatch) | noisy_topk (learned noise)
    d_model: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    softmax_before_topk: bool = True
    normalize_topk: bool = True
    route_scale: float = 1.0
    n_group: int = 1
    topk_group: int | None = None
    group_score: str = "max"
    bias_update_rate: float = 0.0
    dts_steps: int = 0
    dts_temperature: float = 2.0
    router_bias: bool = False


@dataclass(frozen=True)
class ExpertChoiceRouterConfig:
    d_model: int
    num_experts: int
    top_k: int  # with capacity_factor, sets each expert's capacity C
    capacity_factor: float | None = None
    route_scale: float = 1.0


@dataclass(frozen=True)
class HashRouterConfig:
    num_experts: int
    top_k: int
    route_scale: float = 1.0


_Config = TypeVar("_Config")


def router_config(cls: type[_Config], cfg: MoEConfig) -> _Config:
    """The fields ``cls`` declares, read from the layer's config."""
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


# ---------------------------------------------------------------------------------------------
# Balancing losses and the bias update: pure functions over tensors.


def switch_aux_loss(probs_TE: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """Switch Transformer load-balancing loss ``E * sum_i f_i * P_i``.

    ``f_i`` is the fraction of assignments routed to expert i (counted before any capacity drop)
    and ``P_i`` the mean router probability of expert i. It equals 1 under perfectly uniform routing.
    """
    fraction = tokens_per_expert.to(probs_TE.dtype) / tokens_per_expert.sum()
    return tokens_per_expert.numel() * torch.sum(fraction * probs_TE.mean(dim=0))


def router_z_loss(logits_TE: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2``; keeps logits small."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


@torch.no_grad()
def update_expert_bias(bias_E: Tensor, tokens_per_expert: Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): push each expert's selection bias toward uniform load.

    Over-loaded experts lose ``rate``, under-loaded ones gain it; the bias only affects which
    experts are selected, never the combine weights, so it adds no gradient and no loss term.
    """
    load = tokens_per_expert.to(bias_E.dtype)
    bias_E.add_(rate * torch.sign(load.mean() - load))


def dts_schedule(step: int, num_experts: int, top_k: int, steps: int, temperature: float) -> tuple[int, float]:
    """The dense-to-sparse gate (Nie et al. 2021) at ``step``: (experts per token, softmax temperature).

    It starts dense, every token on all E experts through a softmax at ``temperature``, and anneals
    linearly in the number of experts and geometrically in temperature to (top_k, 1) at ``steps``,
    where it becomes the plain top-k softmax router, so the hand-over is continuous.
    """
    if step >= steps:
        return top_k, 1.0
    done = step / steps
    return max(top_k, round(num_experts - (num_experts - top_k) * done)), temperature ** (1.0 - done)


def limit_to_groups(scores_TE: Tensor, n_group: int, topk_group: int, group_score: str) -> Tensor:
    """Group-limited routing (DeepSeek-V2/V3): keep each token's ``topk_group`` best expert groups.

    The E experts form ``n_group`` contiguous groups; a group ranks by its best score (``max``,
    DeepSeek-V2) or its best two summed (``top2_sum``, DeepSeek-V3). Scores outside a token's kept
    groups become -inf, so a later top-k picks only within them: with groups mapped to devices, a
    token's experts live on at most ``topk_group`` of them.
    """
    grouped_TGe = scores_TE.unflatten(-1, (n_group, -1))
    top = 1 if group_score == "max" else 2
    rank_TG = grouped_TGe.topk(top, dim=-1).values.sum(dim=-1)
    kept_TG = rank_TG.topk(topk_group, dim=-1).indices
    dropped_TG = torch.ones_like(rank_TG, dtype=torch.bool).scatter_(1, kept_TG, False)
    return grouped_TGe.masked_fill(dropped_TG.unsqueeze(-1), float("-inf")).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Routers.


def _fp32_logits(x_TD: Tensor, weight_ED: Tensor, bias_E: Tensor | None = None) -> Tensor:
    # NOTE: router logits and softmax stay in fp32 even under bf16 autocast (Switch Transformer):
    # small logit differences decide the routing, and bf16 rounds them away.
    args = (x_TD.float(), weight_ED.float(), bias_E.float() if bias_E is not None else None)
    if not torch.is_autocast_enabled(x_TD.device.type):  # at a decode step the context costs as much as the linear
        return F.linear(*args)
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        return F.linear(*args)


def _init_gate(weight_ED: Tensor) -> None:
    """N(0, 1/d_model); nothing on the meta device, where a model is built to be loaded (meta's
    ``normal_`` imports torch._dynamo, a second of the load)."""
    if not weight_ED.is_meta:
        nn.init.normal_(weight_ED, std=weight_ED.shape[1] ** -0.5)


def _k_major(values_TK: Tensor) -> Tensor:
    """Flatten [T, K] picks so all first choices come first (GShard's capacity priority)."""
    return values_TK.t().reshape(-1)


class TopKRouter(nn.Module):
    """Token-choice routing: each token picks k experts.

    Covers plain top-k (softmax or sigmoid scores), Switch top-1, GShard top-2 with random
    second-expert dispatch, noisy top-k (Shazeer et al. 2017) and DeepSeek's group-limited top-k.
    A per-expert bias (aux-loss-free balancing) shifts selection only. With ``dts_steps`` the training loop tells the
    router its step (``step``); left unset, as at inference, the DTS gate is taken as annealed.
    """

    def __init__(self, cfg: TopKRouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.d_model, cfg.num_experts, bias=cfg.router_bias)
        self.noise = nn.Linear(cfg.d_model, cfg.num_experts, bias=False) if cfg.router == "noisy_topk" else None
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.step: int | None = None  # optimizer step, for the DTS schedule; None: schedule finished
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_gate(self.gate.weight)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)
        if self.noise is not None:
            nn.init.zeros_(self.noise.weight)

    def forward(self, x_TD: Tensor, token_ids: Tensor | None = None) -> RouterOutput:
        logits, probs, weights_TK, experts_TK = self.pick(x_TD)
        num_tokens, top_k = experts_TK.shape
        tokens_TK = torch.arange(num_tokens, device=x_TD.device).unsqueeze(1).expand(-1, top_k)
        token_idx, expert_idx, weights = _k_major(tokens_TK), _k_major(experts_TK), _k_major(weights_TK)
        if self.cfg.router == "gshard" and self.training:
            token_idx, expert_idx, weights = self._random_second_dispatch(token_idx, expert_idx, weights, weights_TK)
        return RouterOutput(token_idx, expert_idx, weights, logits, probs, num_tokens, num_tokens * top_k)

    def pick(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Each token's picks: logits and probs ``[T, E]`` (fp32), combine weights and experts ``[T, k]``
        (k: ``top_k``, or the DTS schedule's at its step). ``forward`` lays them out as assignments;
        a decode step of one token reads them as they are."""
        cfg = self.cfg
        logits = _fp32_logits(x_TD, self.gate.weight, self.gate.bias)
        top_k, temperature = cfg.top_k, 1.0
        if cfg.dts_steps and self.step is not None:
            top_k, temperature = dts_schedule(self.step, cfg.num_experts, cfg.top_k, cfg.dts_steps, cfg.dts_temperature)
        if cfg.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            probs = scores = torch.softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)

        selection_logits = logits
        if self.noise is not None and self.training:
            noise_std = F.softplus(_fp32_logits(x_TD, self.noise.weight))
            selection_logits = logits + torch.randn_like(logits) * noise_std
        if self.noise is not None or not cfg.softmax_before_topk:
            # Pick on logits, then softmax over the k picked (Shazeer's softmax(KeepTopK(H))).
            picked_logits, experts_TK = self._select(selection_logits, top_k)
            weights_TK = (
                torch.softmax(picked_logits, dim=-1) if cfg.score_func == "softmax" else torch.sigmoid(picked_logits)
            )
        else:
            weights_TK, experts_TK = self._select(scores, top_k)
        if cfg.normalize_topk and top_k > 1:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        if cfg.route_scale != 1.0:
            weights_TK = weights_TK * cfg.route_scale
        return logits, probs, weights_TK, experts_TK

    def _select(self, scores_TE: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
        """Top-k over scores plus the balancing bias, within the kept groups; returns the picked
        *unbiased* scores (DeepSeek-V3: the bias steers selection only, never the weights).

        NOTE: the bias is added whether or not this run updates it: a checkpoint trained with one
        (or converted from DeepSeek-V3's ``e_score_correction_bias``) keeps selecting as it did.
        """
        cfg = self.cfg
        biased = scores_TE + self.expert_bias
        if cfg.n_group > 1:
            biased = limit_to_groups(biased, cfg.n_group, cfg.topk_group or cfg.n_group, cfg.group_score)
        experts_TK = biased.topk(top_k, dim=-1).indices
        return scores_TE.gather(1, experts_TK), experts_TK

    @staticmethod
    def _random_second_dispatch(token_idx: Tensor, expert_idx: Tensor, weights: Tensor, weights_TK: Tensor):
        """GShard: keep the second expert with probability ``2 * g2`` (g normalised over the pair)."""
        g2 = weights_TK[:, 1] / weights_TK.sum(dim=-1)
        keep_second = torch.rand_like(g2) < 2 * g2.detach()
        keep = torch.cat([torch.ones_like(keep_second), keep_second])
        return token_idx[keep], expert_idx[keep], weights[keep]

    def update_bias(self, tokens_per_expert: Tensor) -> None:
        update_expert_bias(self.expert_bias, tokens_per_expert, self.cfg.bias_update_rate)


class ExpertChoiceRouter(nn.Module):
    """Expert-choice routing (Zhou et al. 2022): each expert picks its top-C tokens.

    C = ceil(capacity_factor * T * k / E) (capacity_factor defaults to 1), so every expert
    processes exactly C tokens and load is balanced by construction; a token may get 0..E experts.
    """

    def __init__(self, cfg: ExpertChoiceRouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        _init_gate(self.gate.weight)

    def capacity(self, num_tokens: int) -> int:
        factor = self.cfg.capacity_factor or 1.0
        return min(num_tokens, math.ceil(factor * num_tokens * self.cfg.top_k / self.cfg.num_experts))

    def forward(self, x_TD: Tensor, token_ids: Tensor | None = None) -> RouterOutput:
        num_tokens = x_TD.shape[0]
        logits = _fp32_logits(x_TD, self.gate.weight)
        probs = torch.softmax(logits, dim=-1)
        capacity = self.capacity(num_tokens)
        weights_EC, tokens_EC = probs.t().topk(capacity, dim=-1)
        experts_EC = torch.arange(self.cfg.num_experts, device=x_TD.device).unsqueeze(1).expand(-1, capacity)
        weights = weights_EC.reshape(-1) * self.cfg.route_scale
        experts, tokens = experts_EC.reshape(-1), tokens_EC.reshape(-1)
        return RouterOutput(tokens, experts, weights, logits, probs, num_tokens, experts.numel())


class HashRouter(nn.Module):
    """Hash routing (Roller et al. 2021): a fixed token-id -> expert map, no learned parameters.

    Pick j of token id v is expert ``(h(v) + j) mod E`` with Knuth's multiplicative hash h, so the
    k picks are distinct; each has weight 1/k.
    """

    _KNUTH = 2654435761

    def __init__(self, cfg: HashRouterConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, x_TD: Tensor, token_ids: Tensor | None = None) -> RouterOutput:
        if token_ids is None:
            raise OptionError("router", "needs token_ids: call the layer as moe(x, token_ids=ids)", "hash")
        ids_T = token_ids.reshape(-1).long()
        if ids_T.numel() != x_TD.shape[0]:
            raise ValueError(f"token_ids has {ids_T.numel()} ids for {x_TD.shape[0]} tokens")
        cfg = self.cfg
        base_T = (ids_T * self._KNUTH) % (2**32) % cfg.num_experts
        picks_K = torch.arange(cfg.top_k, device=x_TD.device)
        experts_TK = (base_T.unsqueeze(1) + picks_K) % cfg.num_experts
        tokens_TK = torch.arange(x_TD.shape[0], device=x_TD.device).unsqueeze(1).expand(-1, cfg.top_k)
        weights = torch.full(
            (experts_TK.numel(),), cfg.route_scale / cfg.top_k, device=x_TD.device, dtype=torch.float32
        )
        return RouterOutput(
            _k_major(tokens_TK), _k_major(experts_TK), weights, None, None, x_TD.shape[0], weights.numel()
        )


def build_router(cfg: MoEConfig) -> nn.Module:
    """The router module named by ``cfg.router``, given only the fields it reads."""
    if cfg.router == "expert_choice":
        return ExpertChoiceRouter(router_config(ExpertChoiceRouterConfig, cfg))
    if cfg.router == "hash":
        return HashRouter(router_config(HashRouterConfig, cfg))
    return TopKRouter(router_config(TopKRouterConfig, cfg))
