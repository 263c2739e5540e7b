"""Sharded checkpoints across layouts: saved at dp=2 x ep=2 (in the background), resumed at ep=4, in one
process, at pp=2 and at tp=2 with the losses of the uninterrupted run (fp32, 1e-5; the global batch is kept, so
every layout reads the same samples at each step); damaged checkpoints give
one clear error and ``fallback`` resumes from the previous one; export consolidates the shards.

One 4-rank spawn trains the reference and resumes at ep=4; the other layouts read copies of its
run directory.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import rewind
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moekit import runconfig
from moekit.infer.generate import generate_text
from moekit.infer.offload import OffloadOptions
from moekit.model import Transformer
from moekit.parallel.mesh import Layout, LayoutError
from moekit.run.export import export_run
from moekit.errors import OptionError
from moekit.run.layout import CheckpointError, latest_checkpoint
from moekit.run.load import load_run
from moekit.train.loop import _rebatch, train
from moekit.train.step import train_step

from .spawn import MOEKIT, run_ranks

pytestmark = pytest.mark.dist

STEPS, HALF = 4, 2
TOL = 1e-5


def _cfg(corpus: Path, cache: Path, extra: dict[str, str] | None = None, **parallel: str) -> runconfig.RunConfig:
    values = {
        "data.path": str(corpus),
        "data.cache_dir": str(cache),
        "model.tie_embeddings": "false",
        "model.context_length": "32",
        "train.batch_size": "4",
        "train.steps": str(STEPS),
        "train.ckpt_every": str(HALF),
        "train.eval_every": "100",
        "train.eval_iters": "1",
        # NOTE: the balancing and z losses are batch statistics, so pipeline micro-batches (1 sequence
        # each here) optimise a slightly different objective than whole micro-batches; aux-loss-free
        # balancing is the same at every layout, and exercises the router bias kept in checkpoints.
        "moe.aux_loss_coef": "0",
        "moe.z_loss_coef": "0",
        "moe.bias_update_rate": "0.01",
    }
    return runconfig.resolve("tiny", values | (extra or {}) | {f"parallel.{k}": v for k, v in parallel.items()})


def _reference_then_ep4(rank: int, world: int, corpus: Path, tmp: Path) -> None:
    cfg = _cfg(corpus, tmp / "cache", dp="2", ep="2")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, async_checkpoint=True))
    ref = train(cfg, tmp / "ref", progress=False)
    if rank == 0:
        (tmp / "ref-losses.json").write_text(json.dumps(ref.losses))
        rewind(tmp / "ref", tmp / "ep4", HALF)
    dist.barrier()
    resumed = train(_cfg(corpus, tmp / "cache", ep="4"), tmp / "ep4", resume=True, progress=False)
    assert resumed.steps == STEPS
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(ref.losses[HALF:]), atol=TOL, rtol=0)


def _resume_pp2_and_tp2(rank: int, world: int, corpus: Path, tmp: Path) -> None:
    want = json.loads((tmp / "ref-losses.json").read_text())[HALF:]
    for layout in ("pp", "tp"):
        resumed = train(_cfg(corpus, tmp / "cache", **{layout: "2"}), tmp / f"{layout}2", resume=True, progress=False)
        torch.testing.assert_close(
            torch.tensor(resumed.losses), torch.tensor(want), atol=TOL, rtol=0, msg=lambda m: f"{layout}=2: {m}"
        )


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A 4-rank (dp=2 x ep=2) run with checkpoints at steps 2 and 4, resumed at ep=4 on the way."""
    from conftest import write_corpus  # the tests directory is on sys.path (rootdir conftest)

    tmp = tmp_path_factory.mktemp("reshard")
    corpus = write_corpus(tmp / "corpus.txt")
    run_ranks(_reference_then_ep4, 4, corpus, tmp, tmp_path=tmp, preload=MOEKIT)
    return tmp


@pytest.mark.slow
def test_resume_at_other_layouts_gives_the_same_losses(sharded_run: Path) -> None:
    tmp = sharded_run
    ref = tmp / "ref"
    manifest = json.loads((latest_checkpoint(ref) / "manifest.json").read_text())
    assert manifest["world"] == 4 and manifest["global_microbatches"] == 4
    assert any(name.startswith("sharded/__3_") for name in manifest["files"])  # every rank wrote its shards
    want = json.loads((tmp / "ref-losses.json").read_text())[HALF:]
    # One process: the global batch of 4 micro-batches becomes grad_accum = 4.
    one = train(_cfg(tmp / "corpus.txt", tmp / "cache"), rewind(ref, tmp / "ep1", HALF), resume=True, progress=False)
    torch.testing.assert_close(torch.tensor(one.losses), torch.tensor(want), atol=TOL, rtol=0)
    assert json.loads((tmp / "ep1" / "config.json").read_text())["train"]["grad_accum"] == 4
    rewind(ref, tmp / "pp2", HALF)
    rewind(ref, tmp / "tp2", HALF)
    run_ranks(_resume_pp2_and_tp2, 2, tmp / "corpus.txt", tmp, tmp_path=tmp, preload=MOEKIT)


def _damaged(tmp: Path, name: str, damage) -> Path:
    run = tmp / name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(tmp / "ref", run)
    damage(latest_checkpoint(run))
    return run


def _truncate(ckpt: Path) -> None:
    shard = ckpt / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])


def _flip(ckpt: Path) -> None:
    meta = ckpt / "sharded" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("truncated", _truncate, r"sharded/__1_0.distcp: corrupt \(size mismatch: \d+ bytes, the manifest says"),
        ("flipped", _flip, r"sharded/.metadata: corrupt \(checksum mismatch"),
        ("missing-shard", lambda c: (c / "sharded" / "__2_0.distcp").unlink(), r"__2_0.distcp: missing from"),
        ("no-latest-target", shutil.rmtree, r"latest names step_000004, which is missing or incomplete"),
    ],
)
def test_damaged_checkpoint_is_named_and_fallback_resumes(sharded_run: Path, name: str, damage, message: str) -> None:
    tmp = sharded_run
    run = _damaged(tmp, name, damage)
    cfg = _cfg(tmp / "corpus.txt", tmp / "cache")
    with pytest.raises(OptionError, match=r"^resume=True: .*" + message + r".*pass fallback=True"):
        train(cfg, run, resume=True, progress=False)
    if name != "no-latest-target":
        with pytest.raises(CheckpointError, match=message):
            load_run(run)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=HALF + 1))
    resumed = train(cfg, run, resume=True, fallback=True, progress=False)
    want = json.loads((tmp / "ref-losses.json").read_text())[HALF]
    assert abs(resumed.losses[0] - want) < TOL  # the previous complete checkpoint, at step 2


@pytest.mark.slow
def test_checkpoint_of_another_shape_names_keys_and_shapes(sharded_run: Path) -> None:
    tmp = sharded_run
    run = _damaged(tmp, "shape", lambda c: None)
    cfg = _cfg(tmp / "corpus.txt", tmp / "cache", {"moe.d_ff": "96"})
    with pytest.raises(CheckpointError, match=r"does not fit this model \(shapes .*blocks.0.ffn.experts.w_in"):
        train(cfg, run, resume=True, progress=False)


def test_a_global_batch_the_layout_cannot_split_is_refused(tmp_path: Path, corpus_file: Path) -> None:
    cfg = _cfg(corpus_file, tmp_path)
    with pytest.raises(LayoutError, match="global batch of 4 micro-batches per step cannot be split over 3 data"):
        _rebatch(cfg, {"global_microbatches": 4}, Layout(dp=3, ep=1, tp=1, pp=1, node_size=1), tmp_path)


@pytest.mark.slow
def test_export_consolidates_shards_for_inference(sharded_run: Path) -> None:
    tmp = sharded_run
    ckpt = latest_checkpoint(tmp / "ref")
    out = tmp / "exported"
    export_run(tmp / "ref", out)
    exported = load_file(latest_checkpoint(out) / "model.safetensors")
    # torch's own consolidation of the same shards is the reference.
    dcp_to_torch_save(ckpt / "sharded", tmp / "torch-consolidated.pt")
    whole = torch.load(tmp / "torch-consolidated.pt", weights_only=False)["model"]
    assert exported.keys() == whole.keys()
    assert all(torch.equal(exported[k], whole[k]) for k in whole)

    cfg = runconfig.from_json(out / "config.json")
    reference = Transformer(cfg.model, cfg.moe)
    reference.load_state_dict(whole)
    want = generate_text(dataclasses.replace(load_run(out), model=reference.eval()), "the ", 24, temperature=0)
    assert generate_text(load_run(out), "the ", 24, temperature=0) == want
    assert generate_text(load_run(tmp / "ref"), "the ", 24, temperature=0) == want  # consolidated in memory
    offloaded = load_run(out, offload=OffloadOptions(memory_budget=1 << 30))  # byte-range reads of the file
    assert generate_text(offloaded, "the ", 24, temperature=0) == want
    with pytest.raises(OptionError, match="^offload: .* is sharded .* moekit export"):
        load_run(tmp / "ref", offload=OffloadOptions(memory_budget=1 << 30))


# --- a checkpoint of re-placed experts ------------------------------------------------------------------

PLACED_SAVE = 4  # of test_placement's 8 steps, re-placing every 2


def _placed_cfg(corpus: Path, cache: Path, ep: str) -> runconfig.RunConfig:
    from .test_placement import BASE

    extra = {"parallel.placement_every": "2", "parallel.placement_min_gain": "0", "parallel.ep": ep}
    return runconfig.resolve("tiny", {**BASE, "data.path": str(corpus), "data.cache_dir": str(cache), **extra})


def _live(pm, optimizer) -> tuple[dict, list[torch.Tensor]]:
    """The live placement and a copy of every expert row this rank holds (weights and AdamW moments)."""
    rows = []
    for moe in pm.moe_layers():
        for p in moe.experts.parameters():
            rows.append(p.to_local().clone())
            rows += [optimizer.state[p][k].to_local().clone() for k in ("exp_avg", "exp_avg_sq")]
    return pm.expert_slots(), rows


def _save_with_placement(rank: int, world: int, corpus_path: Path, tmp: Path) -> None:
    from moekit.parallel.runtime import ParallelModel, init_distributed
    from moekit.run.saver import Checkpointer
    from moekit.train import loop
    from moekit.train.optim import build_optimizer

    from .test_placement import SKEW

    cfg = _placed_cfg(corpus_path, tmp / "cache", ep="4")
    cpu = torch.device("cpu")
    layout, mesh = init_distributed(cfg, cpu)
    corpus = loop._prepare_corpus_once(cfg, rank == 0, True, None)
    runs = {}
    for save_at in (0, PLACED_SAVE):
        torch.manual_seed(0)
        model = Transformer(cfg.model, cfg.moe)
        for moe in model.moe_layers():
            moe.router.expert_bias.copy_(SKEW)
        pm = ParallelModel(model, cfg, cpu, layout, mesh)
        optimizer = build_optimizer(pm.named_parameters(), cfg.train)
        saver = Checkpointer(tmp / "placed", keep=2, background=True)  # rows staged, then written meanwhile
        losses = []
        for step in range(cfg.train.steps):
            record = train_step(pm, optimizer, corpus, cfg, cpu, step, None)
            losses.append(record["loss"])
            if step + 1 == save_at:
                slots, rows = _live(pm, optimizer)
                assert slots, "nothing was re-placed before the save"
                info = loop._checkpoint_info(step + 1, cfg, layout, record, 0)
                saver.save(step + 1, pm.modules[0], optimizer, info, pm.expert_slots())
                after_slots, after_rows = _live(pm, optimizer)
                assert after_slots == slots, "the save moved the experts"
                assert all(torch.equal(a, b) for a, b in zip(rows, after_rows, strict=True))
        saver.wait()
        runs[save_at] = losses
    # NOTE: the saving run computes exactly what the other does; 1e-5 is the parity tolerance.
    torch.testing.assert_close(torch.tensor(runs[PLACED_SAVE]), torch.tensor(runs[0]), atol=TOL, rtol=0)
    if rank == 0:
        (tmp / "placed-losses.json").write_text(json.dumps(runs[0]))


@pytest.mark.slow
def test_a_checkpoint_leaves_live_placement_and_resumes_at_another_layout(tmp_path: Path) -> None:
    """ep=4 with experts re-placed every 2 steps, saved at step 4 in the background: the live placement, expert rows and
    losses are those of a run that never saved; the checkpoint holds canonical rows, so one process
    (ep=1, the same global batch) resumes it with the losses of the run that never saved (1e-5)."""
    from conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    run_ranks(_save_with_placement, 4, corpus, tmp_path, tmp_path=tmp_path, preload=MOEKIT)
    want = json.loads((tmp_path / "placed-losses.json").read_text())[PLACED_SAVE:]
    cfg = _placed_cfg(corpus, tmp_path / "cache", ep="1")
    resumed = train(cfg, tmp_path / "placed", resume=True, progress=False)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(want), atol=TOL, rtol=0)
