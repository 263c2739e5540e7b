"""DeepSeek routing against a per-token reference written out in plain Python: group-limited top-k
(V2: groups ranked by their best score; V3: by their best two summed), the sigmoid scores with a
selection-only bias, renormalisation over the picks and the routed scaling factor.

Reference: ``picks_one_token`` below, one token at a time over Python floats. Tolerance: weights
within a relative 1e-5 (fp32 against float64), expert sets exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.reference import moe_per_token


def picks_one_token(logits: list[float], bias: list[float], cfg: MoEConfig) -> dict[int, float]:
    """Expert -> combine weight for one token, step by step as DeepSeek-V2/V3 describe it."""
    if cfg.score_func == "sigmoid":
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    else:
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        scores = [e / sum(exps) for e in exps]
    choice = [s + b for s, b in zip(scores, bias, strict=True)]  # the bias steers selection only
    size = cfg.num_experts // cfg.n_group
    groups = [list(range(g * size, (g + 1) * size)) for g in range(cfg.n_group)]

    def group_rank(members: list[int]) -> float:
        best = sorted((choice[e] for e in members), reverse=True)
        return best[0] if cfg.group_score == "max" else best[0] + best[1]

    kept = sorted(range(cfg.n_group), key=lambda g: group_rank(groups[g]), reverse=True)
    allowed = [e for g in kept[: cfg.topk_group or cfg.n_group] for e in groups[g]]
    picked = sorted(allowed, key=lambda e: choice[e], reverse=True)[: cfg.top_k]
    weights = {e: scores[e] for e in picked}  # unbiased scores
    if cfg.normalize_topk:
        total = sum(weights.values())
        weights = {e: w / total for e, w in weights.items()}
    return {e: w * cfg.route_scale for e, w in weights.items()}


V3 = dict(score_func="sigmoid", group_score="top2_sum", normalize_topk=True, route_scale=2.5)
V2 = dict(score_func="softmax", group_score="max", normalize_topk=False, route_scale=16.0)


@pytest.mark.parametrize(
    "variant",
    [
        dict(V3, num_experts=12, n_group=4, topk_group=2, top_k=3),
        dict(V3, num_experts=6, n_group=3, topk_group=1, top_k=2),
        dict(V3, num_experts=10, n_group=1, top_k=4),  # no groups: plain sigmoid top-k with the bias
        dict(V2, num_experts=12, n_group=3, topk_group=2, top_k=5),
        dict(V2, num_experts=9, n_group=3, topk_group=1, top_k=3),
    ],
    ids=["v3-12e-4g", "v3-6e-3g-1kept", "v3-nogroups", "v2-12e-3g", "v2-9e-1kept"],
)
def test_router_matches_the_per_token_reference(variant: dict) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(d_model=16, d_ff=8, **variant)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.gate.weight.mul_(3)  # decisive scores, so near-ties do not hide in fp32 noise
        moe.router.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.3)
    x = torch.randn(40, 16)
    routing = moe.router(x)
    logits = (x.double() @ moe.router.gate.weight.double().t()).tolist()
    bias = moe.router.expert_bias.tolist()
    for t in range(x.shape[0]):
        mine = routing.token_idx == t
        got = dict(zip(routing.expert_idx[mine].tolist(), routing.weights[mine].tolist(), strict=True))
        expected = picks_one_token(logits[t], bias, cfg)
        assert got.keys() == expected.keys(), f"token {t}"
        for e, w in expected.items():
            assert got[e] == pytest.approx(w, rel=1e-5), f"token {t} expert {e}"
    if cfg.n_group > 1:  # every token's experts lie in at most topk_group groups
        groups_TK = routing.expert_idx.view(cfg.top_k, -1).t() // (cfg.num_experts // cfg.n_group)
        assert max(len(set(row)) for row in groups_TK.tolist()) <= cfg.topk_group
    y = moe(x)
    torch.testing.assert_close(y, moe_per_token(moe, x)[0], rtol=1e-5, atol=1e-5)


def test_bias_changes_selection_not_weights() -> None:
    """A large bias on expert 0 makes every token pick it, with its own unbiased sigmoid score."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=1, score_func="sigmoid", normalize_topk=False))
    x = torch.randn(16, 8)
    with torch.no_grad():
        moe.router.expert_bias[0] = 100.0
    routing = moe.router(x)
    assert (routing.expert_idx == 0).all()
    torch.testing.assert_close(routing.weights, torch.sigmoid(x @ moe.router.gate.weight[0]))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_experts=8, n_group=3), "n_group=3: must divide num_experts=8"),
        (dict(num_experts=8, n_group=4, topk_group=5), "topk_group=5: must be in"),
        (dict(num_experts=8, n_group=4, topk_group=1, top_k=3), "top_k=3: exceeds the 2 experts"),
        (dict(num_experts=4, n_group=4, group_score="top2_sum"), "group_score='top2_sum': needs >= 2"),
        (dict(num_experts=8, n_group=2, router="expert_choice"), "n_group=2: group-limited routing needs"),
        (dict(num_experts=8, n_group=2, group_score="mean"), "group_score='mean': must be one of"),
    ],
)
def test_group_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace("[", r"\[")):
        MoEConfig(d_model=8, d_ff=8, **kwargs)
