"""The deduplicated expert-parallel dispatch against the single-process layer and the per-expert dispatch.

Reference: one MoE layer (fp32, seed 0) run in one process over the global batch (every rank's
tokens), loss ``sum(y * g)`` for a fixed random g. On 4 gloo ranks (ep = 4, two experts per rank)
each rank runs its share of the tokens through the sharded layer, once per dispatch (per expert,
deduplicated). Tolerance: outputs, input gradients and every weight gradient (router summed over
ranks, experts gathered) within 1e-5 of the reference; in fp32 only the summation order differs.

The rows each dispatch hands ``torch.distributed.all_to_all_single`` are counted there: per expert,
one per assignment; deduplicated, one per distinct (token, destination rank), so with
``n_group = ep`` and ``topk_group = 1`` at most one per token (checked, not assumed).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moekit.config import MoEConfig, ParallelConfig
from moekit.layer import MoE
from moekit.parallel.ep import ep_groups, shard_moe
from moekit.parallel.mesh import Layout, build_mesh

from .spawn import MOEKIT, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

W, EXPERTS, TOKENS, D = 4, 8, 12, 16  # ranks, experts, tokens per rank, model dim
TOL = 1e-5
GROUPS_1 = {"n_group": 4, "topk_group": 1, "top_k": 2, "score_func": "sigmoid", "group_score": "top2_sum"}
CASES: dict[str, tuple[dict, str]] = {  # name -> (MoEConfig fields, parallel.all_to_all)
    "topk": ({"top_k": 3}, "flat"),
    "topk-two-level": ({"top_k": 3}, "two_level"),
    "groups-1": ({**GROUPS_1, "route_scale": 2.5}, "flat"),
    "groups-1-two-level": (GROUPS_1, "two_level"),
    "groups-2": ({"n_group": 4, "topk_group": 2, "top_k": 3}, "flat"),
    "idle-rank": ({"top_k": 2}, "flat"),  # no token picks rank 3's experts
}


def _layer(fields: dict, idle_rank: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=D, d_ff=32, num_experts=EXPERTS, **fields))
    if idle_rank:  # the selection bias steers every token away from the last rank's experts
        moe.router.expert_bias[-EXPERTS // W :] = -1e4
    return moe


@contextlib.contextmanager
def _counted(calls: list[tuple[torch.dtype, int, int]]):
    """Record (dtype, rows sent, rows received) of every all_to_all_single call inside the block."""
    real = dist.all_to_all_single

    def counted(output, input, *args, **kwargs):
        calls.append((input.dtype, input.shape[0], output.shape[0]))
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        yield
    finally:
        dist.all_to_all_single = real


def _rank_pairs(moe: MoE, x: torch.Tensor) -> tuple[int, int, int]:
    """From this rank's routing: distinct (token, rank) pairs, the most ranks one token reaches, and
    the tokens whose experts all live on this rank."""
    with torch.no_grad():
        routing = moe.router(x)
    per_rank = EXPERTS // W
    hit = torch.zeros(TOKENS, W, dtype=torch.bool)
    hit[routing.token_idx, routing.expert_idx // per_rank] = True
    home = hit[:, dist.get_rank()] & (hit.sum(1) == 1)
    return int(hit.sum()), int(hit.sum(1).max()), int(home.sum())


def _check_case(rank: int, name: str, meshes: dict) -> None:
    fields, all_to_all = CASES[name]
    idle = name == "idle-rank"
    where = f"[{name}] rank {rank}"
    g = torch.Generator().manual_seed(1)
    x_all, grad_all = torch.randn(W * TOKENS, D, generator=g), torch.randn(W * TOKENS, D, generator=g)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)

    ref = _layer(fields, idle)
    x_ref = x_all.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * grad_all).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    for dedup in (False, True):
        moe = _layer(fields, idle)
        mesh, layout = meshes[all_to_all]
        cfg = ParallelConfig(ep=W, all_to_all=all_to_all, dispatch_dedup=dedup)
        shard_moe(moe, mesh, ep_groups(mesh, layout, cfg), cfg)
        x = x_all[mine].clone().requires_grad_()
        calls: list[tuple[torch.dtype, int, int]] = []
        with _counted(calls):
            y = moe(x)
        (y * grad_all[mine]).sum().backward()
        label = f"{where} {'dedup' if dedup else 'per-expert'}"
        torch.testing.assert_close(y, y_ref[mine], atol=TOL, rtol=0, msg=lambda m: f"{label} output: {m}")
        torch.testing.assert_close(x.grad, x_ref.grad[mine], atol=TOL, rtol=0, msg=lambda m: f"{label} dx: {m}")
        for n, p in moe.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
            if not isinstance(p.grad, DTensor):  # replicated (the router): each rank holds its tokens' part
                dist.all_reduce(grad)
            torch.testing.assert_close(grad, ref_grads[n], atol=TOL, rtol=0, msg=lambda m: f"{label} {n}: {m}")
        if all_to_all == "flat":
            _check_rows(moe, x, calls, dedup, fields, idle, label)


def _check_rows(moe: MoE, x: torch.Tensor, calls: list, dedup: bool, fields: dict, idle: bool, label: str) -> None:
    """The forward's exchanges moved the rows the dispatch claims: dispatch out, the same count back."""
    pairs, widest, home = _rank_pairs(moe, x)
    sent, received = calls[0][1], calls[0][2]
    assert calls[-1][1:] == (received, sent), f"{label}: combine moved {calls[-1][1:]}, dispatch {(sent, received)}"
    if not dedup:
        assert sent == TOKENS * fields["top_k"], f"{label}: {sent} rows sent for {TOKENS} x {fields['top_k']} picks"
        return
    assert [c[0] for c in calls] == [torch.float32, torch.int32, torch.float32], f"{label}: exchanges {calls}"
    assert sent == pairs, f"{label}: {sent} rows sent for {pairs} distinct (token, rank) pairs"
    if fields.get("n_group") == W and fields.get("topk_group") == 1:
        assert widest == 1 and sent <= TOKENS, f"{label}: {sent} rows for {TOKENS} tokens, up to {widest} ranks each"
        homes = torch.tensor(home)
        dist.all_reduce(homes)
        assert homes > 0, f"{label}: no token had all its experts on its own rank"
    if idle and dist.get_rank() == W - 1:
        assert received == 0, f"{label}: the idle rank received {received} rows"


def _check_all(rank: int, world: int) -> None:
    dist.init_process_group("gloo")
    meshes = {}
    for all_to_all, node_size in (("flat", W), ("two_level", 2)):
        layout = Layout(dp=1, ep=W, tp=1, pp=1, node_size=node_size)
        meshes[all_to_all] = (build_mesh(layout, "cpu", timedelta(seconds=120)), layout)
    failures = []
    for name in CASES:
        try:
            _check_case(rank, name, meshes)
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


def test_dedup_dispatch_matches_single_process_and_per_expert(tmp_path) -> None:
    run_ranks(_check_all, W, tmp_path=tmp_path, preload=MOEKIT)
