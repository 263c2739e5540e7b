"""Offloaded expert training (``train.memory_budget``) on several ranks against in-memory training of
the same layout, through ``train()``: ep=2, dp=2 and dp=2 x ep=2 (experts replicated over dp; this
one with a host tier, ``train.host_budget``, holding 4 of each rank's 12 regions in RAM).

Reference: the same run, same layout, every expert in memory. Tolerance: none (bitwise on CPU) for
every loss, the validation loss and every final weight: each rank offloads its own ep shard, and
each layer's expert gradients are summed over dp by one fused all-reduce and divided as in memory;
with dp = 2 the sum adds two values, so the bucket's extent cannot change its bits. dp = 4 is not
bitwise: a ring all-reduce's summation order depends on where a value sits in the bucket, which
differs between the per-layer buckets and in-memory training's; losses, gradient norms and weights
agree within DP4_TOL (fp32 reassociation of four addends, compounded over four steps).
An ep=2 run resumed from its step-2 checkpoint equals the uninterrupted one bitwise; resumed from
the same checkpoint in one process (the global batch kept), its losses are within 1e-5 (fp32
summation order: one process accumulates the four micro-batches' gradients itself).
The budget leaves two layers' expert weights in RAM, so each of the three layers is read from disk
in every pass. One offloaded dp=2 step is profiled: each layer's expert gradients travel in one
all-reduce of the layer's whole gradient region, its rows per expert at the end.
A dp=2 run whose router biases keep, after the first step, expert 2 from every token and expert 3 from
rank 1's only equals in-memory training bitwise on both ranks (losses, gradient norms, weights, AdamW
moments): expert 2's gradient is zero and skips its transfers; expert 3's is not, though rank 1
computed no row of it, so only rank 1's own transfers between its micro-batches are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import write_corpus
from helpers import assert_same_checkpoints, rewind, train_routed

from moekit import runconfig
from moekit.run.load import load_run
from moekit.train import loop
from moekit.train.loop import train
from moekit.train.metrics import METRICS_FILE
from moekit.train.offload import ExpertOffload
from moekit.train.step import train_step

from .spawn import MOEKIT, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, HALF = 4, 2
RESHARD_TOL = 1e-5
DP4_TOL = 1e-6
# Two expert-weight slots and six regions of gradients and moments, for a layer's experts held by one
# rank: 4 experts (98 KB per layer), 2 under ep=2, 1 under ep=4.
BUDGET = {1: "800KB", 2: "400KB", 4: "250KB"}
HOST = {"dp2xep2": "200KB"}  # 4 regions of 49 KB: the 3 layers' gradients and one layer's weights


def _cfg(
    tmp: Path, ep: int = 1, dp: int = 1, offload: bool = False, host: str = "", **overrides: str
) -> runconfig.RunConfig:
    values = {
        "data.path": str(tmp / "corpus.txt"),
        "data.cache_dir": str(tmp / "cache"),
        "model.n_layers": "3",
        "moe.bias_update_rate": "0.01",
        "train.steps": str(STEPS),
        "train.batch_size": "4",
        "train.grad_accum": "2",
        "train.eval_every": "2",
        "train.eval_iters": "1",
        "train.ckpt_every": str(HALF),
        "train.sample_tokens": "0",
        "parallel.ep": str(ep),
        "parallel.dp": str(dp),
        "parallel.expert_sharding": "replicate",
    }
    if offload:
        values |= {"train.memory_budget": BUDGET[ep], "train.offload_dir": str(tmp / "offload")}
    if host:
        values["train.host_budget"] = host
    return runconfig.resolve("tiny", values | overrides)


def _both(rank: int, tmp: Path, name: str, ep: int, dp: int) -> None:
    """Train ``name`` in memory and offloaded; rank 0 writes both runs' losses and gradient norms (clipped:
    the tiny model's norms exceed ``train.grad_clip=1``)."""
    runs = {}
    for offload in (False, True):
        cfg = _cfg(tmp, ep, dp, offload, HOST.get(name, "") if offload else "")
        result = train(cfg, tmp / f"{name}-{'disk' if offload else 'memory'}", progress=False)
        records = [json.loads(line) for line in (result.run_dir / METRICS_FILE).read_text().splitlines()]
        runs["disk" if offload else "memory"] = [*result.losses, result.val_loss, *(r["grad_norm"] for r in records)]
    if rank == 0:
        (tmp / f"{name}.json").write_text(json.dumps(runs))


def _two_ranks(rank: int, world: int, tmp: Path) -> None:
    _both(rank, tmp, "ep2", ep=2, dp=1)
    if rank == 0:
        rewind(tmp / "ep2-disk", tmp / "ep2-resumed", HALF)
    dist.barrier()
    resumed = train(_cfg(tmp, ep=2, offload=True), tmp / "ep2-resumed", resume=True, progress=False)
    if rank == 0:
        (tmp / "ep2-resumed.json").write_text(json.dumps(resumed.losses))
    _both(rank, tmp, "dp2", ep=1, dp=2)
    _count_expert_reductions(rank, tmp)
    _idle_on_one_rank(rank, tmp)


def _idle_on_one_rank(rank: int, tmp: Path) -> None:
    """dp=2, after the first step: expert 2 kept from every token, expert 3 from rank 1's tokens only.
    Each rank saves its records, its final state and its count of expert transfers skipped."""

    def bias_at(step: int, micro: int) -> torch.Tensor:
        bias = torch.zeros(4)
        if step > 0:
            bias[2] = -1e4
            bias[3] = -1e4 if rank == 1 else 0.0
        return bias

    for offload in (False, True):
        name = f"dp2-idle-{'disk' if offload else 'memory'}"
        cfg = _cfg(tmp, dp=2, offload=offload, **{"moe.bias_update_rate": "0"})
        run = train_routed(cfg, tmp / name, bias_at)
        records = [{k: r[k] for k in ("loss", "grad_norm")} for r in run.records]
        torch.save([records, run.state, run.experts_skipped], tmp / f"{name}-rank{rank}.pt")


def _count_expert_reductions(rank: int, tmp: Path) -> None:
    """Profile one offloaded dp=2 step: how many all-reduces carried a layer's whole expert-gradient
    region and its rows per expert (the fused bucket), how many the rows alone, and how many MoE layers
    there are."""
    cfg = _cfg(tmp, dp=2, offload=True)
    run = loop._setup(cfg, tmp / "dp2-profiled", False, torch.device("cpu"), False, None, False)
    assert isinstance(run.experts, ExpertOffload)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        train_step(run.pm, run.optimizer, run.corpus, cfg, run.dev, 0, None, run.experts)
    experts = run.experts.experts[0].num_experts
    bucket, rows = [[run.experts.file.tensors_end // 4 + experts]], [[experts]]
    reductions = [e.input_shapes for e in prof.events() if e.name == "gloo:all_reduce"]
    run.experts.close()
    if rank == 0:
        counts = [reductions.count(bucket), reductions.count(rows), len(run.experts.params)]
        (tmp / "dp2-reductions.json").write_text(json.dumps(counts))


def _four_ranks(rank: int, world: int, tmp: Path) -> None:
    _both(rank, tmp, "dp2xep2", ep=2, dp=2)
    _both(rank, tmp, "ep4", ep=4, dp=1)
    _both(rank, tmp, "dp4", ep=1, dp=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("offload")
    write_corpus(tmp / "corpus.txt")
    run_ranks(_two_ranks, 2, tmp, tmp_path=tmp, preload=MOEKIT)
    run_ranks(_four_ranks, 4, tmp, tmp_path=tmp, preload=MOEKIT)
    return tmp


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_run(run_dir).model.state_dict()


@pytest.mark.parametrize("name", ["ep2", "ep4", "dp2", "dp2xep2"])
def test_offloaded_equals_in_memory_bitwise(runs: Path, name: str) -> None:
    losses = json.loads((runs / f"{name}.json").read_text())
    assert len(losses["memory"]) == 2 * STEPS + 1 and losses["disk"] == losses["memory"]
    memory, disk = _weights(runs / f"{name}-memory"), _weights(runs / f"{name}-disk")
    assert memory.keys() == disk.keys() and any(".experts." in k for k in memory)
    for key in memory:
        assert torch.equal(memory[key], disk[key]), f"{name} {key}"
    # the directory goes with the last file where the rank that made it ends last
    left = list((runs / "offload").iterdir()) if (runs / "offload").exists() else []
    assert not left, "every rank removes its offloaded state when training ends"


@pytest.mark.parametrize("name", ["ep2", "dp2", "dp2xep2"])
def test_offloaded_checkpoints_equal_in_memory_ones(runs: Path, name: str) -> None:
    """Each rank streams its expert state into the checkpoint: the files are in-memory training's."""
    assert_same_checkpoints(runs / f"{name}-disk", runs / f"{name}-memory", [HALF, STEPS])


def test_offloaded_dp4_within_tolerance(runs: Path) -> None:
    losses = json.loads((runs / "dp4.json").read_text())
    torch.testing.assert_close(torch.tensor(losses["disk"]), torch.tensor(losses["memory"]), atol=DP4_TOL, rtol=0)
    memory, disk = _weights(runs / "dp4-memory"), _weights(runs / "dp4-disk")
    assert memory.keys() == disk.keys()
    for key in memory:
        torch.testing.assert_close(disk[key], memory[key], atol=DP4_TOL, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_offloaded_resume_equals_uninterrupted(runs: Path) -> None:
    whole = json.loads((runs / "ep2.json").read_text())["disk"]  # losses, then the validation loss and norms
    assert json.loads((runs / "ep2-resumed.json").read_text()) == whole[HALF:STEPS]
    a, b = _weights(runs / "ep2-disk"), _weights(runs / "ep2-resumed")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_offloaded_resume_in_one_process(runs: Path) -> None:
    """The ep=2 checkpoint resumed offloaded in one process, whose grad_accum becomes 2 x 2."""
    whole = json.loads((runs / "ep2.json").read_text())["disk"]
    cfg = _cfg(runs, offload=True)
    resumed = train(cfg, rewind(runs / "ep2-disk", runs / "ep1-resumed", HALF), resume=True, progress=False)
    want = torch.tensor(whole[HALF:STEPS])
    torch.testing.assert_close(torch.tensor(resumed.losses), want, atol=RESHARD_TOL, rtol=0)
    a, b = _weights(runs / "ep2-disk"), _weights(runs / "ep1-resumed")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=RESHARD_TOL, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_an_expert_idle_on_one_dp_rank_only_keeps_its_gradient(runs: Path) -> None:
    """Per step after the first (3), layer (3) and micro-batch pair (grad_accum 2): expert 2 skips 4
    transfers on each rank (its partial sum written and read back, the reduced gradient written and
    read by the AdamW step); expert 3 skips only rank 1's first 2. Skipping by a rank's own rows would
    skip 2 more on rank 1 and give its AdamW step a zero gradient for expert 3: not in-memory's."""
    skipped = {}
    for rank in (0, 1):
        memory, disk = (
            torch.load(runs / f"dp2-idle-{m}-rank{rank}.pt", weights_only=False) for m in ("memory", "disk")
        )
        assert disk[0] == memory[0], f"rank {rank}: losses and gradient norms"
        assert memory[1].keys() == disk[1].keys() and any(k.endswith(":exp_avg") for k in memory[1])
        for key in memory[1]:
            assert torch.equal(memory[1][key], disk[1][key]), f"rank {rank} {key}"
        skipped[rank] = disk[2]["grad"]
    per_step_and_layer = 3 * 3
    assert skipped == {0: 4 * per_step_and_layer, 1: (4 + 2) * per_step_and_layer}


def test_each_layer_is_reduced_in_one_fused_bucket(runs: Path) -> None:
    """One all-reduce per MoE layer and step (of two micro-batches), of the layer's whole gradient region
    with its rows per expert; none of the rows alone."""
    buckets, rows, layers = json.loads((runs / "dp2-reductions.json").read_text())
    assert layers == 3 and buckets == layers and rows == 0
