"""Routers (the DTS gate too), capacity drops, balancing losses and config validation against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.dispatch import LocalDispatcher
from moekit.routing import (
    RouterOutput,
    build_router,
    dts_schedule,
    router_z_loss,
    switch_aux_loss,
    update_expert_bias,
)


def test_switch_aux_loss_formula() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [3.0, 1.0, 0.0], [0.0, 0.0, 0.5]])
    probs = torch.softmax(logits, dim=-1)
    picks = logits.argmax(-1)  # top-1: experts 0, 1, 0, 2
    f = torch.tensor([2 / 4, 1 / 4, 1 / 4])
    p = probs.mean(0)
    expected = 3 * (f[0] * p[0] + f[1] * p[1] + f[2] * p[2])
    torch.testing.assert_close(switch_aux_loss(probs, torch.bincount(picks, minlength=3)), expected)
    uniform = torch.full((6, 3), 1 / 3)
    assert switch_aux_loss(uniform, torch.tensor([2, 2, 2])).item() == pytest.approx(1.0)


def test_router_z_loss_formula() -> None:
    logits = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    lse = [math.log(math.e + math.e**2), math.log(1 + math.e**-1)]
    expected = (lse[0] ** 2 + lse[1] ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)


def test_layer_stats_use_the_formulas() -> None:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01))
    x = torch.randn(10, 8)
    _, stats = moe(x, return_stats=True)
    logits = x @ moe.router.gate.weight.t()
    probs = torch.softmax(logits, -1)
    picks = probs.topk(2, dim=-1).indices.flatten()
    torch.testing.assert_close(stats.aux_loss, switch_aux_loss(probs, torch.bincount(picks, minlength=4)))
    torch.testing.assert_close(stats.z_loss, router_z_loss(logits))
    torch.testing.assert_close(stats.loss, 0.1 * stats.aux_loss + 0.01 * stats.z_loss)
    assert torch.equal(stats.tokens_per_expert, torch.bincount(picks, minlength=4))


def test_capacity_drops_in_gshard_order() -> None:
    # 4 tokens, top-2 over 2 experts, capacity ceil(0.5 * 8 / 2) = 2 rows per expert.
    # k-major order: first choices of tokens 0..3, then second choices of tokens 0..3.
    first = [0, 0, 1, 0]
    second = [1, 1, 0, 1]
    routing = RouterOutput(
        token_idx=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]),
        expert_idx=torch.tensor(first + second),
        weights=torch.ones(8),
        logits=None,
        probs=None,
        num_tokens=4,
        num_picks=8,
    )
    dispatcher = LocalDispatcher(num_experts=2, capacity_factor=0.5)
    x = torch.arange(4.0).unsqueeze(1)
    x_sorted, meta = dispatcher.dispatch(x, routing)
    # Expert 0 keeps the first choices of tokens 0 and 1 (token 3's first choice and token 2's
    # second come later); expert 1 keeps token 2's first choice and token 0's second choice.
    assert meta.token_idx.tolist() == [0, 1, 2, 0]
    assert meta.tokens_per_expert.tolist() == [2, 2]
    assert (meta.routed_per_expert - meta.tokens_per_expert).tolist() == [2, 2]
    assert x_sorted.squeeze(1).tolist() == [0.0, 1.0, 2.0, 0.0]


def test_gshard_capacity_counts_the_requested_picks() -> None:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, router="gshard", capacity_factor=1.0))
    moe.train()
    x = torch.randn(400, 8)
    routing = moe.router(x)
    assert routing.num_picks == 800 and routing.expert_idx.numel() < 800  # random second-expert drops
    _, meta = moe.dispatcher.dispatch(x, routing)
    assert int(meta.tokens_per_expert.max()) <= 200  # ceil(1.0 * 400 * 2 / 4), not from the survivors


def test_expert_choice_gives_each_expert_its_capacity() -> None:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, router="expert_choice", capacity_factor=1.5))
    x = torch.randn(3, 10, 8)
    routing = moe.router(x.reshape(-1, 8))
    capacity = math.ceil(1.5 * 30 * 2 / 4)
    assert moe.router.capacity(30) == capacity == 23
    counts = torch.bincount(routing.expert_idx, minlength=4)
    assert counts.tolist() == [capacity] * 4
    for e in range(4):  # each expert holds its top-C tokens by score
        mine = routing.token_idx[routing.expert_idx == e]
        assert set(mine.tolist()) == set(routing.probs[:, e].topk(capacity).indices.tolist())
    _, stats = moe(x, return_stats=True)
    assert stats.num_dropped == 0 and stats.tokens_per_expert.tolist() == [capacity] * 4


def test_switch_and_gshard_weights() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 8)
    switch = MoE(MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=1, router="switch"))
    r = switch.router(x)
    probs = torch.softmax(x @ switch.router.gate.weight.t(), -1)
    torch.testing.assert_close(r.weights, probs.max(-1).values)  # Switch: gate value, not renormalised
    gshard = MoE(MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, router="gshard"))
    gshard.train()
    kept = torch.stack([torch.tensor(gshard.router(x).expert_idx.numel() - 50) for _ in range(200)]).float()
    g = torch.softmax(x @ gshard.router.gate.weight.t(), -1).topk(2).values
    expected_second = (2 * g[:, 1] / g.sum(-1)).clamp(max=1).sum()
    assert abs(kept.mean() - expected_second) < 0.05 * 50  # second expert kept with p = 2 * g2
    gshard.eval()
    assert gshard.router(x).expert_idx.numel() == 100  # deterministic top-2 at inference


def test_hash_router_is_a_fixed_map() -> None:
    moe = MoE(MoEConfig(d_model=8, d_ff=8, num_experts=5, top_k=2, router="hash"))
    ids = torch.tensor([3, 9, 3, 4])
    r = moe.router(torch.randn(4, 8), ids)
    experts = r.expert_idx.view(2, 4).t()
    assert experts[0].tolist() == experts[2].tolist()  # same id, same experts
    assert all(a != b for a, b in experts.tolist())
    with pytest.raises(ValueError, match="token_ids"):
        moe(torch.randn(4, 8))


def test_aux_free_bias_balances_a_skewed_stream() -> None:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=16, d_ff=8, num_experts=8, top_k=2, bias_update_rate=0.01, score_func="sigmoid"))
    skew = torch.randn(16) * 2.0  # every token shares a direction that favours a few experts

    def imbalance() -> float:
        _, stats = moe(torch.randn(512, 16) + skew, return_stats=True)
        moe.update_bias(stats.tokens_per_expert)
        load = stats.tokens_per_expert.float()
        return (load.max() / load.mean()).item()

    w_before = moe.router.gate.weight.clone()
    before = imbalance()
    for _ in range(300):
        after = imbalance()
    assert before > 2.0
    assert after < 1.3
    assert torch.equal(moe.router.gate.weight, w_before)  # the bias never touches learned weights


def test_update_expert_bias_direction() -> None:
    bias = torch.zeros(3)
    update_expert_bias(bias, torch.tensor([10, 5, 0]), rate=0.5)
    assert bias.tolist() == [-0.5, 0.0, 0.5]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(top_k=9), "top_k"),
        (dict(d_model=0), "d_model"),
        (dict(d_ff=-4), "d_ff"),
        (dict(num_experts=0), "num_experts"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(capacity_factor=-1.0), "capacity_factor"),
        (dict(router="magic"), "router"),
        (dict(router="switch", top_k=2), "top_k"),
        (dict(router="gshard", top_k=1), "top_k"),
        (dict(activation="relu6"), "activation"),
        (dict(score_func="tanh"), "score_func"),
        (dict(gemm="cutlass"), "gemm"),
        (dict(router="expert_choice", bias_update_rate=0.1), "bias_update_rate"),
        (dict(router="noisy_topk", top_k=1), "top_k"),
        (dict(softmax_before_topk=False, top_k=1), "top_k"),
    ],
)
def test_bad_config_names_field_and_value(overrides: dict, field: str) -> None:
    cfg = dict(d_model=8, d_ff=8, num_experts=8, top_k=2) | overrides
    with pytest.raises(ValueError, match=rf"^{field}=") as err:
        MoEConfig(**cfg)
    assert repr(overrides[field] if field in overrides else cfg[field]) in str(err.value)


def test_dts_schedule_anneals_from_dense_to_top_k() -> None:
    schedule = [dts_schedule(step, 8, 2, 100, 2.0) for step in range(0, 121, 10)]
    assert schedule[0] == (8, 2.0)
    assert schedule[-1] == (2, 1.0) and dts_schedule(100, 8, 2, 100, 2.0) == (2, 1.0)
    ks = [k for k, _ in schedule]
    temperatures = [t for _, t in schedule]
    assert ks == sorted(ks, reverse=True) and temperatures == sorted(temperatures, reverse=True)
    assert 2 < dts_schedule(50, 8, 2, 100, 2.0)[0] < 8


def test_dts_router_starts_dense_and_ends_as_plain_top_k() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(d_model=16, d_ff=8, num_experts=6, top_k=2, dts_steps=20, dts_temperature=3.0)
    router = build_router(cfg)
    plain = build_router(MoEConfig(d_model=16, d_ff=8, num_experts=6, top_k=2))
    plain.load_state_dict(router.state_dict())
    x = torch.randn(10, 16)
    router.step = 0
    start = router(x)
    assert start.expert_idx.numel() == 10 * 6 and start.num_picks == 60
    # Every expert, softmax at temperature 3 (renormalised over all experts: unchanged).
    probs = torch.softmax(x @ router.gate.weight.t() / 3.0, dim=-1)
    weights = torch.zeros(10, 6).index_put_((start.token_idx, start.expert_idx), start.weights)
    torch.testing.assert_close(weights, probs)
    for step in (20, None):  # annealed, and at inference (no step set)
        router.step = step
        got, expected = router(x), plain(x)
        assert torch.equal(got.expert_idx, expected.expert_idx) and torch.equal(got.weights, expected.weights)


def test_dts_needs_a_softmax_top_k_router() -> None:
    with pytest.raises(ValueError, match="dts_steps=5: the DTS gate needs router = topk"):
        MoEConfig(d_model=8, d_ff=8, router="expert_choice", dts_steps=5)
