"""Every parallel layout docs/parallelism.md claims against the single-process model (fp32, same seed and weights).

Reference: the unsharded model run on rank 0 over the whole global batch (all data ranks'
micro-batches, each pipeline micro-batch separately) and broadcast to the other ranks, so the
comparison needs no files; once per batch split, shared by the layouts that split it alike.
Tolerances: after one step every gradient, the global gradient norm and the loss within 1e-5; the
losses of the next steps within 1e-4 (AdamW's first updates are close to sign(grad) * lr, so fp32
summation-order differences grow over the steps). Replicated experts end bitwise equal on every dp
rank.

The matrix: expert_sharding (shard | replicate) x ep x dp for every ep * dp <= 4, tp alone, with ep
and with replicated experts over dp, overlapped dispatch (with dp > 1 both ways), two-level
all-to-all with and without overlap, the deduplicated dispatch (two-level, and ep x dp with
group-limited routing), live placement and shadow experts with dp > 1, capacity, every
pipeline schedule and pp x ep, and ep x dp for latent attention with group-limited sigmoid routing.
Layouts that cannot run fail with a ``LayoutError`` before any collective (the last test).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moekit import runconfig
from moekit.experts.grouped import local_tensor
from moekit.model import Transformer
from moekit.parallel.fsdp import experts_sharded
from moekit.parallel.grads import clip_grad_norm
from moekit.parallel.mesh import LayoutError, microbatches
from moekit.parallel.runtime import ParallelModel, init_distributed
from moekit.stats import StepStats
from moekit.train.optim import build_optimizer

from .spawn import MOEKIT, run_ranks

pytestmark = pytest.mark.dist

BASE = {
    "model.n_layers": "2",
    "model.n_heads": "2",
    "model.d_model": "32",
    "model.d_ff": "64",
    "model.context_length": "16",
    "model.vocab_size": "64",
    "model.tie_embeddings": "false",
    "moe.num_experts": "4",
    "moe.top_k": "2",
    "train.batch_size": "4",
    "train.lr": "3e-3",
    "train.warmup_steps": "1",
}
# Every mechanism acting between steps runs at least twice and is checked by a later step's loss: AdamW
# with moments, and with placement re-placement after steps 1 and 3 (2 and 4 experts moved with their
# moments; the moments moved after step 3 first shape step 4's update, which step 5's loss checks) and
# the shadows set before step 0 dropped after step 1. Over 10 steps the losses stayed within 4e-7 of the
# reference, against LOSS_TOL.
STEPS = 6
# DeepSeek-V3's shape: latent attention with a query bottleneck, a dense first block, sigmoid routing
# limited to one of two expert groups (with ep=2: each token's experts on one rank), scaled weights.
MLA_GROUPS = {
    "model.attention": "mla",
    "model.q_lora_rank": "12",
    "model.kv_lora_rank": "16",
    "model.n_layers": "3",
    "model.first_dense_layers": "1",
    "moe.score_func": "sigmoid",
    "moe.n_group": "2",
    "moe.topk_group": "1",
    "moe.group_score": "top2_sum",
    "moe.route_scale": "2.5",
}
GRAD_TOL = 1e-5  # gradients, gradient norm and loss of the first step
LOSS_TOL = 1e-4  # losses of steps 2..STEPS


def _matrix() -> dict[str, tuple[int, dict[str, str]]]:
    """Layout name -> (world size, overrides)."""
    out: dict[str, tuple[int, dict[str, str]]] = {}
    for ep, dp in itertools.product((1, 2, 4), repeat=2):
        if not 1 < ep * dp <= 4:
            continue
        for sharding in ("shard", "replicate") if dp > 1 else ("shard",):
            name = f"ep{ep}xdp{dp}" + (f"-{sharding}" if dp > 1 else "")
            overrides = {"parallel.ep": str(ep), "parallel.dp": str(dp), "parallel.expert_sharding": sharding}
            out[name] = (ep * dp, overrides)
    ep2dp2 = {"parallel.ep": "2", "parallel.dp": "2"}
    two_level = {"parallel.ep": "4", "parallel.all_to_all": "two_level", "parallel.node_size": "2"}
    overlap = {"parallel.overlap_chunks": "2"}
    dedup = {"parallel.dispatch_dedup": "true"}
    out |= {
        "tp2": (2, {"parallel.tp": "2"}),
        "tp2xep2": (4, {"parallel.tp": "2", "parallel.ep": "2"}),
        "tp2xdp2-replicate": (4, {"parallel.tp": "2", "parallel.dp": "2", "parallel.expert_sharding": "replicate"}),
        "ep2-capacity": (2, {"parallel.ep": "2", "moe.capacity_factor": "1.0"}),
        "ep2-overlap": (2, {"parallel.ep": "2", **overlap}),
        "ep2xdp2-shard-overlap": (4, {**ep2dp2, **overlap}),
        "ep2xdp2-replicate-overlap": (4, {**ep2dp2, "parallel.expert_sharding": "replicate", **overlap}),
        "ep4-two-level": (4, two_level),
        "ep4-two-level-overlap": (4, {**two_level, **overlap}),
        "ep2xdp2-replicate-placement": (
            4,
            {
                **ep2dp2,
                "parallel.expert_sharding": "replicate",
                "parallel.placement_every": "2",
                "parallel.placement_min_gain": "0",
                "parallel.shadow_experts": "2",
            },
        ),
        "ep2xpp2": (4, {"parallel.ep": "2", "parallel.pp": "2"}),
        "ep2xdp2-mla-groups": (4, {**ep2dp2, **MLA_GROUPS}),
        "ep2xdp2-mla-groups-dedup": (4, {**ep2dp2, **MLA_GROUPS, **dedup}),
        "ep4-two-level-dedup": (4, {**two_level, **dedup}),
    }
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
        layers = "4" if schedule in ("interleaved_1f1b", "looped_bfs") else "2"  # two stages per rank
        out[f"pp2-{schedule}"] = (2, {"parallel.pp": "2", "parallel.pp_schedule": schedule, "model.n_layers": layers})
    return out


LAYOUTS = _matrix()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batches(cfg, n_ranks: int, steps: int):
    g = torch.Generator().manual_seed(7)
    shape = (steps, n_ranks, cfg.train.batch_size, cfg.model.context_length + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return tokens[..., :-1], tokens[..., 1:]


@dataclass(frozen=True)
class Reference:
    """The single process's run: logits of the first batch, then per step the loss; after the first
    step's backward its gradients and their norm."""

    logits: torch.Tensor  # [data ranks, B, T, V] of step 0's batches, before any update
    losses: list[float]
    grads: dict[str, torch.Tensor]
    norm: float


_REFERENCES: dict[str, Reference] = {}  # one per model, training config and global batch split, per process


def _model(cfg) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg.model, cfg.moe)


def _reference(cfg, n_ranks: int, micro: int) -> Reference:
    """The single process over the global batch (every data rank's batch, each split into the
    pipeline's micro-batches); computed once and shared by the layouts that split the same batch."""
    key = repr((cfg.model, cfg.moe, cfg.train, n_ranks, micro))
    if key in _REFERENCES:
        return _REFERENCES[key]
    ref = _model(cfg)
    opt = build_optimizer(ref.named_parameters(), cfg.train)
    xs, ys = _batches(cfg, n_ranks, STEPS)
    with torch.no_grad():
        logits = torch.stack([ref(x).logits for x in xs[0]])
    losses, grads, norm = [], {}, 0.0
    n = n_ranks * micro
    for step in range(STEPS):
        lm = 0.0
        for x, y in zip(xs[step], ys[step], strict=True):
            for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
                out = ref(xm, ym)
                (out.loss / n).backward()
                lm += out.lm_loss.item() / n
        losses.append(lm)
        if step == 0:  # before the clip scales them
            grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
        step_norm = clip_grad_norm(list(ref.parameters()), cfg.train.grad_clip).item()
        norm = norm if step else step_norm
        opt.step()
        opt.zero_grad(set_to_none=True)
    _REFERENCES[key] = Reference(logits, losses, grads, norm)
    return _REFERENCES[key]


def _place_away(pm: ParallelModel) -> None:
    """Before the first step: swap the first and last experts' slots and shadow two experts (one moved),
    so that the first step's gradients go through re-placed and shadowed experts."""
    assert pm.rebalancer is not None
    for moe in pm.moe_layers():
        slots = list(range(moe.cfg.num_experts))
        slots[0], slots[-1] = slots[-1], slots[0]
        pm.rebalancer.move(moe, tuple(slots), None)
        pm.rebalancer.set_shadows(moe, (0, 2))
    assert pm.rebalancer.refresh_shadows() > 0


def _grads_by_expert(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every full gradient by the reference's names; re-placed experts' rows (slots) back in expert order."""
    grads = {}
    for module in pm.modules:
        for name, p in module.named_parameters():
            assert p.grad is not None, f"{name} got no gradient"
            grads[name] = _full(p.grad)
    if pm.rebalancer is not None:
        for module in pm.modules:
            for name, moe in module.named_modules():
                if moe in pm.moe_layers():
                    slots = list(pm.rebalancer._layer(moe).slots)
                    for key in (f"{name}.experts.w_in", f"{name}.experts.w_out"):
                        grads[key] = grads[key][slots]
    return grads


def _check(rank: int, world: int, name: str) -> dict[str, float]:
    """One layout for ``STEPS`` steps beside the reference; returns the largest differences seen."""
    cfg = runconfig.resolve("tiny", {**BASE, **LAYOUTS[name][1]})
    torch.manual_seed(0)
    layout, mesh = init_distributed(cfg, torch.device("cpu"))
    pm = ParallelModel(_model(cfg), cfg, torch.device("cpu"), layout, mesh)
    micro = microbatches(cfg) if layout.pp > 1 else 1
    # NOTE: rank 0 alone computes it (the ranks share the machine's cores); the broadcast is bitwise.
    box = [_reference(cfg, layout.batch_ranks, micro) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref = box[0]
    xs, ys = _batches(cfg, layout.batch_ranks, STEPS)
    b = pm.ranks.batch_rank
    where = f"[{name}] rank {rank}"
    # NOTE: before any forward: FSDP swaps unsharded parameters in while a forward's are gathered.
    opt = build_optimizer(pm.named_parameters(), cfg.train)
    if cfg.parallel.placement_every:
        _place_away(pm)

    if pm.pipeline is None:  # the forward output itself
        with torch.no_grad():
            got = pm.modules[0](xs[0, b]).logits
        torch.testing.assert_close(got, ref.logits[b], atol=GRAD_TOL, rtol=0, msg=lambda m: f"{where} logits: {m}")

    seen = {"grad": 0.0, "norm": 0.0, "loss": 0.0}
    for step in range(STEPS):
        if step == 0 and cfg.parallel.overlap_chunks > 1 and experts_sharded(layout, cfg.parallel):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                _, lm, moe_stats = pm.forward_backward(xs[step, b], ys[step, b], 1.0)
            _check_expert_gathers(prof, pm, where)
        else:
            _, lm, moe_stats = pm.forward_backward(xs[step, b], ys[step, b], 1.0)
        got_loss = pm.mean_over_batch(pm.broadcast_from_last_stage(lm)).item()
        pm.finish_gradients()
        loss_diff = abs(got_loss - ref.losses[step])
        seen["loss"] = max(seen["loss"], loss_diff)
        if step == 0:
            assert loss_diff <= GRAD_TOL, f"{where} step-0 loss {got_loss} != {ref.losses[0]}"
            for key, grad in _grads_by_expert(pm).items():
                diff = (grad - ref.grads[key]).abs().max().item()
                assert diff <= GRAD_TOL, f"{where} {key}: gradient differs by {diff:.2e}"
                seen["grad"] = max(seen["grad"], diff)
        else:
            assert loss_diff <= LOSS_TOL, f"{where} step {step} loss {got_loss} != {ref.losses[step]}"
        norm = pm.clip_gradients(cfg.train.grad_clip).item()
        if step == 0:
            seen["norm"] = abs(norm - ref.norm)
            assert seen["norm"] <= GRAD_TOL * max(1.0, ref.norm), f"{where} gradient norm {norm} != {ref.norm}"
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pm.rebalancer is not None:  # the loop's order: loads summed over the data ranks, then placement
            stats = StepStats()
            stats.add(moe_stats)
            stats.layers = pm.reduce_layers(stats.layers)
            pm.rebalance(step, stats.loads, opt)
    if layout.dp > 1 and cfg.parallel.expert_sharding == "replicate":  # the copies have not drifted apart
        assert mesh is not None
        for moe in pm.moe_layers():
            for p in moe.experts.parameters():
                mine = local_tensor(p).detach()
                every = [torch.empty_like(mine) for _ in range(layout.dp)]
                dist.all_gather(every, mine, group=mesh["dp"].get_group())
                assert all(torch.equal(t, mine) for t in every), f"{where}: expert replicas differ over dp"
    return seen


def _check_expert_gathers(prof, pm: ParallelModel, where: str) -> None:
    """Overlapped dispatch computes the experts chunk by chunk, yet FSDP must gather each layer's
    sharded experts once for the forward and once for the backward, and reduce their gradients once."""
    events = [e.name for e in prof.events()]
    experts = sorted({m[1] for n in events if (m := re.fullmatch(r"FSDP::all_gather \((.*experts)\)", n))})
    assert len(experts) == len(pm.moe_layers()), f"{where}: expert FSDP units seen: {experts}"
    for fqn in experts:
        gathers = sum(n == f"FSDP::all_gather ({fqn})" for n in events)
        reduces = sum(n == f"FSDP::post_backward_reduce ({fqn})" for n in events)
        assert (gathers, reduces) == (2, 1), f"{where} {fqn}: {gathers} all-gathers, {reduces} reduce-scatters"


def _check_all(rank: int, world: int, names: list[str]) -> None:
    failures, lines = [], []
    for name in names:
        try:
            seen = _check(rank, world, name)
            lines.append(f"{name:<28} grad {seen['grad']:.1e}  norm {seen['norm']:.1e}  loss {seen['loss']:.1e}")
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    if rank == 0:
        print("\n" + "\n".join(lines), flush=True)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # the fast tier runs 2 ranks
def test_layouts_match_single_process(world: int, tmp_path) -> None:
    """One set of spawned ranks per world size runs every layout of that size (process start-up is
    most of the cost); a failure names each layout that differs. ``-s`` prints the differences."""
    names = [name for name, (w, _) in LAYOUTS.items() if w == world]
    run_ranks(_check_all, world, names, tmp_path=tmp_path, preload=MOEKIT)


@pytest.mark.parametrize(
    ("world", "overrides", "field"),
    [
        (4, {"parallel.ep": "2", "parallel.dp": "2", "parallel.placement_every": "2"}, "parallel.expert_sharding"),
        (4, {"parallel.ep": "2", "parallel.pp": "2", "parallel.placement_every": "2"}, "parallel.pp"),
        (3, {"parallel.ep": "3"}, "parallel.ep"),
        (2, {"parallel.tp": "2", "model.attention": "mla"}, "parallel.tp=2: tensor parallelism does not shard MLA"),
        (4, {"parallel.ep": "2", "parallel.dp": "1"}, "dp*ep*tp*pp"),
        (2, {"parallel.ep": "2", "parallel.all_to_all": "two_level", "parallel.node_size": "4"}, "parallel.node_size"),
        (2, {"parallel.ep": "2", "parallel.dispatch_dedup": "true", "parallel.overlap_chunks": "2"}, "overlap_chunks"),
        (
            2,
            {"parallel.ep": "2", "parallel.dispatch_dedup": "true", "parallel.placement_every": "2"},
            "placement_every",
        ),
        (2, {"parallel.ep": "2", "parallel.dispatch_dedup": "true", "moe.capacity_factor": "1.0"}, "capacity_factor"),
        (2, {"parallel.ep": "2", "parallel.dispatch_dedup": "true", "moe.router": "hash"}, "moe.router='hash'"),
    ],
)
def test_unsupported_layouts_fail_before_any_collective(world, overrides, field, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = runconfig.resolve("tiny", {**BASE, **overrides})
    with pytest.raises(LayoutError, match=field.replace("*", r"\*")):
        init_distributed(cfg, torch.device("cpu"))
    assert not dist.is_initialized()
