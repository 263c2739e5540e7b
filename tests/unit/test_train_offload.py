"""Training beyond memory (``train.memory_budget``) against in-memory training, through ``train()``.

Reference: the same run with every expert in memory. Tolerance: none (bitwise on CPU): the offload
is an execution detail. The budget is set so only two layers' expert weights fit in RAM, so every
layer is read from disk in forward and again in backward. The experts' AdamW step of a step runs in
the next forward (or before an evaluation or a checkpoint), with the step's own learning rate: the
tiny runs warm the learning rate up over more steps than they take, so it changes at every step.
With a host tier (``train.host_budget``) holding some of the regions in RAM, the same holds, and the
disk moves exactly the bytes of the regions left on it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_same_checkpoints
from nan_watch import Watch

from moekit import runconfig
from moekit.cli import build_parser
from moekit.cli.common import flag_words
from moekit.config import TrainConfig
from moekit.errors import OptionError
from moekit.parallel.mesh import Layout, LayoutError
from moekit.run.load import load_run
from moekit.run.planners import MODEL_PREFIX
from moekit.run.saver import Checkpointer
from moekit.runconfig import RunConfig
from moekit.train import loop
from moekit.train.loop import train
from moekit.train.metrics import METRICS_FILE
from moekit.train.offload import check_offloadable
from moekit.train.step import RESIDENT, train_step

BUDGET = "800KB"  # the tiny model below: 98 KB of expert weights per layer, 2 slots + 6 scratch regions
UNIT = 98304  # bytes of one (layer, kind) region of the tiny model's experts
HOST = "800KB"  # a host tier of 8 of the 12 regions: 3 gradients, 3 weights, 2 of the 6 moments


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    g = torch.Generator().manual_seed(0)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "birds",
        "sing",
        "on",
        "the",
        "mat",
    ]
    path.write_text(" ".join(words[i] for i in torch.randint(len(words), (20000,), generator=g).tolist()))
    return path


def tiny(corpus: Path, **overrides: str) -> RunConfig:
    values = {
        "data.path": str(corpus),
        "data.cache_dir": str(corpus.parent / "cache"),
        "model.n_layers": "3",
        "moe.bias_update_rate": "0.01",
        "train.steps": "4",
        "train.batch_size": "4",
        "train.grad_accum": "2",
        "train.eval_every": "2",
        "train.eval_iters": "1",
        "train.ckpt_every": "2",
        "train.sample_tokens": "0",
    }
    return runconfig.resolve("tiny", values | overrides)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_run(run_dir).model.state_dict()


@pytest.mark.parametrize(
    "moe",
    [
        {},
        {"moe.router": "expert_choice", "moe.bias_update_rate": "0"},
        {"moe.router": "hash", "moe.bias_update_rate": "0"},
        # dropping tokens; biases widen a layer's region
        {"moe.capacity_factor": "1.0", "moe.expert_ffn_bias": "true", "train.memory_budget": "850KB"},
        {"train.host_budget": HOST},
    ],
    ids=["topk", "expert_choice", "hash", "capacity_bias", "host_tier"],
)
def test_offloaded_training_equals_in_memory_bitwise(corpus: Path, tmp_path: Path, moe: dict[str, str]) -> None:
    offload_dir = tmp_path / "state"
    offloaded = {"train.memory_budget": BUDGET, "train.offload_dir": str(offload_dir)} | moe
    memory = train(
        tiny(corpus, **{k: v for k, v in moe.items() if k.startswith("moe.")}), tmp_path / "memory", progress=False
    )
    disk = train(
        tiny(corpus, **offloaded),
        tmp_path / "disk",
        progress=False,
    )
    assert disk.losses == memory.losses and disk.val_loss == memory.val_loss
    a, b = weights(tmp_path / "memory"), weights(tmp_path / "disk")
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not offload_dir.exists(), "the offloaded state and the directory made for it are removed at the end"


@pytest.mark.slow
@pytest.mark.parametrize("host", [{}, {"train.host_budget": HOST}], ids=["disk", "host_tier"])
def test_deferred_updates_follow_the_schedule_evaluations_and_checkpoints(
    corpus: Path, tmp_path: Path, host: dict[str, str]
) -> None:
    """The learning rate changes at every step (warmup, then decay); evaluations run between some steps
    (2, 4); a checkpoint is taken at step 3 with no evaluation before it, then resumed."""
    schedule = {"train.steps": "5", "train.warmup_steps": "3", "train.eval_every": "2", "train.ckpt_every": "3"}
    offloaded = schedule | {"train.memory_budget": BUDGET} | host
    memory = train(tiny(corpus, **schedule), tmp_path / "memory", progress=False)
    disk = train(tiny(corpus, **offloaded), tmp_path / "disk", progress=False)
    records = [json.loads(line) for line in (tmp_path / "disk" / METRICS_FILE).read_text().splitlines()]
    assert len({r["lr"] for r in records}) == len(records) == 5
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 5]
    assert disk.losses == memory.losses and disk.val_loss == memory.val_loss

    def stop_at_3(record: dict) -> None:
        if record["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny(corpus, **offloaded), tmp_path / "cut", progress=False, on_step=stop_at_3)
    resumed = train(tiny(corpus, **offloaded), tmp_path / "cut", resume=True, progress=False)
    assert resumed.losses == memory.losses[3:] and resumed.val_loss == memory.val_loss
    a = weights(tmp_path / "memory")
    for run in ("disk", "cut"):
        b = weights(tmp_path / run)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{run} {key}"


def model_state(run: loop._Run) -> dict[str, torch.Tensor]:
    """The run's weights as a checkpoint saves them (offloaded experts read from their file)."""
    with run.experts.saving(run.local) as streamed:
        if streamed is None:  # in memory
            return {k: v.clone() for k, v in run.local.state_dict().items()}
        return {
            k: streamed.read(MODEL_PREFIX + k).clone() if MODEL_PREFIX + k in streamed.keys else v.clone()
            for k, v in run.local.state_dict().items()
        }


def _fail_once(module: torch.nn.Module) -> None:
    """The next forward of ``module`` raises (before it runs); later ones run."""

    def hook(*_) -> None:
        handle.remove()
        raise RuntimeError("a forward cut short")

    handle = module.register_forward_pre_hook(hook)


@pytest.mark.slow
def test_a_forward_cut_short_leaves_the_rest_of_the_updates_pending(corpus: Path, tmp_path: Path) -> None:
    """A step's forward that fails at the second MoE layer, after updating the first, then tried again:
    each layer is updated once, as in memory (the same failure cut in both runs)."""
    runs = {}
    for name, budget in (("memory", {}), ("disk", {"train.memory_budget": BUDGET})):
        run = loop._setup(tiny(corpus, **budget), tmp_path / name, False, torch.device("cpu"), False, None, False)
        losses = []
        for step in range(3):
            if step == 1:
                _fail_once(run.pm.moe_layers()[1])
                with pytest.raises(RuntimeError, match="cut short"):
                    train_step(run.pm, run.optimizer, run.corpus, run.cfg, run.dev, step, None, run.experts)
                assert run.experts is RESIDENT or run.experts.updates.pending, "the later layers' updates wait"
                run.optimizer.zero_grad(set_to_none=True)
            record = train_step(run.pm, run.optimizer, run.corpus, run.cfg, run.dev, step, None, run.experts)
            losses.append(record["loss"])
        state = model_state(run)
        assert run.experts is RESIDENT or not run.experts.updates.pending
        run.experts.close()
        runs[name] = losses, state
    (memory_losses, a), (disk_losses, b) = runs["memory"], runs["disk"]
    assert disk_losses == memory_losses
    assert any(".experts." in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _step_allocations(run: loop._Run, step: int, trace: Path) -> tuple[int, int]:
    """Bytes of host tensors that one training step allocates on its own thread: in all, and at most
    live at once above what the step starts with (torch's profiler records each allocation and free of
    the thread it profiles; the offload's reader and writer threads only move bytes between the file
    and its held buffers)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(run.pm, run.optimizer, run.corpus, run.cfg, run.dev, step, None, run.experts)
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    changes = sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]")
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return sum(nbytes for _, nbytes in changes if nbytes > 0), peak


@pytest.mark.parametrize("grad_accum", ["1", "2"])
def test_an_offloaded_step_allocates_no_more_than_in_memory_training(
    corpus: Path, tmp_path: Path, grad_accum: str
) -> None:
    """Reference: the same step in memory, which allocates the activations and the expert gradients.
    The offload's memory is its budget's buffers, held from the start: an offloaded step that allocated
    more (an AdamW temporary on a region, a gradient copy, a buffer made anew every step) would hold it
    beside the activations, over what ``train.memory_budget`` promises. Tolerance: the row counts, norms
    and step counts the offload keeps per layer, a few hundred bytes each (measured: 336 bytes in all at
    grad_accum 1, 552 at 2, of 6 and 12 MB; a gradient copied through a temporary adds 295 KB)."""
    figures = {}
    for name, budget in (("memory", {}), ("disk", {"train.memory_budget": BUDGET})):
        cfg = tiny(corpus, **budget, **{"train.grad_accum": grad_accum})
        run = loop._setup(cfg, tmp_path / name, False, torch.device("cpu"), False, None, False)
        for step in range(2):  # the first step makes the optimizer's state
            train_step(run.pm, run.optimizer, run.corpus, cfg, run.dev, step, None, run.experts)
        figures[name] = _step_allocations(run, 2, tmp_path / f"{name}.json")
        run.experts.close()
    (allocated, peak), (allocated_offloaded, peak_offloaded) = figures["memory"], figures["disk"]
    bookkeeping = 3 * 512  # 3 layers
    assert allocated > 0 and peak > 0
    assert allocated_offloaded <= allocated + bookkeeping, (allocated_offloaded, allocated)
    assert peak_offloaded <= peak + bookkeeping, (peak_offloaded, peak)


def test_host_tier_takes_disk_traffic_by_the_rule(corpus: Path, tmp_path: Path) -> None:
    """A host tier of three regions takes the gradients (``store.host_regions``: with grad_accum A = 2,
    each layer's gradient region is written A times and read A times per step; no region of this run
    moves more: a layer's weights move 2 to 4 times, each moment twice). Written out: each of the 3
    layers' gradients moves 2 reads and 2 writes per step off the disk into RAM, and every other
    region moves as before."""
    moved = {}
    for name, host in (("disk", {}), ("host", {"train.host_budget": str(3 * UNIT)})):
        cfg = tiny(corpus, **{"train.memory_budget": BUDGET} | host)
        run = loop._setup(cfg, tmp_path / name, False, torch.device("cpu"), False, None, False)
        file = run.experts.file
        assert file.unit == UNIT
        counters = ("bytes_read", "bytes_written", "host_bytes_read", "host_bytes_written")
        for step in range(2):  # the second step: the first reads every layer into an empty working set
            before = [getattr(file, c) for c in counters]
            train_step(run.pm, run.optimizer, run.corpus, cfg, run.dev, step, None, run.experts)
            run.experts.ws.flush()
        moved[name] = [getattr(file, c) - b for c, b in zip(counters, before, strict=True)]
        if host:
            assert sorted(file.host) == [(0, "grad"), (1, "grad"), (2, "grad")]
        run.experts.close()
    layers, accum = 3, 2
    off_disk = layers * accum * UNIT  # per step, read and written alike
    read, written, _, _ = moved["disk"]
    assert moved["disk"][2:] == [0, 0]
    assert moved["host"] == [read - off_disk, written - off_disk, off_disk, off_disk]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"memory_budget": "lots"}, "train.memory_budget='lots'"),
        ({"memory_budget": "0"}, "train.memory_budget='0'"),
        ({"host_budget": "8GB"}, "train.host_budget='8GB': needs train.memory_budget"),
        ({"memory_budget": "1MB", "host_budget": "lots"}, "train.host_budget='lots'"),
        ({"memory_budget": "1MB", "host_budget": "0"}, "train.host_budget='0': must be > 0"),
        ({"offload_dir": "/tmp/x"}, "train.offload_dir='/tmp/x'"),
    ],
)
def test_bad_offload_fields_name_the_field(fields: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TrainConfig(**fields)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"train.memory_budget": "100KB"}, "train.memory_budget='100KB': offloaded training needs at least"),
        ({"train.memory_budget": BUDGET, "train.host_budget": "90KB"}, "train.host_budget='90KB': holds no region"),
        ({"train.memory_budget": BUDGET, "train.dtype": "bf16"}, "train.dtype='bf16'"),
        ({"train.memory_budget": BUDGET, "train.async_checkpoint": "true"}, "train.async_checkpoint"),
        ({"train.memory_budget": BUDGET, "model.experts_per_layer": "4,2,4"}, r"model.experts_per_layer=\[4, 2, 4\]"),
        ({"train.memory_budget": BUDGET, "train.compile": "true"}, "train.compile=true"),
        ({"train.memory_budget": BUDGET, "model.first_dense_layers": "3"}, "the model has no MoE layers"),
    ],
)
def test_unsupported_offloaded_runs_are_refused(corpus: Path, tmp_path: Path, overrides: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        train(tiny(corpus, **overrides), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "offload").exists(), "the offload file and its directory are removed"


def test_offloaded_runs_off_cpu_are_refused(corpus: Path) -> None:
    """Checked before the device is used: a ``meta`` device stands in for a GPU here. The device is a
    mentioned option: ``moekit train`` names it by its flag."""
    cfg = tiny(corpus, **{"train.memory_budget": BUDGET})
    with pytest.raises(OptionError, match="device=meta: offloaded training runs on cpu") as refused:
        check_offloadable(cfg, Layout(1, 1, 1, 1, 1), torch.device("meta"))
    train_flags = flag_words(build_parser().parse_args(["train"]).command_parser)
    assert (
        refused.value.words(train_flags)
        == f"train.memory_budget={BUDGET!r}: --device=meta: offloaded training runs on cpu"
    )


EP2 = Layout(1, 2, 1, 1, 2)


@pytest.mark.parametrize(
    ("layout", "overrides", "named"),
    [
        (Layout(1, 1, 2, 1, 1), {"parallel.tp": "2"}, "parallel.tp=2"),
        (Layout(1, 1, 1, 2, 1), {"parallel.pp": "2"}, "parallel.pp=2"),
        (Layout(2, 1, 1, 1, 1), {"parallel.dp": "2"}, "parallel.expert_sharding='shard'"),
        (EP2, {"parallel.placement_every": "2"}, "parallel.placement_every"),
        (EP2, {"parallel.dispatch_dedup": "true"}, "parallel.dispatch_dedup"),
        (EP2, {"parallel.overlap_chunks": "2"}, "parallel.overlap_chunks=2"),
        (EP2, {"parallel.all_to_all": "two_level"}, "parallel.all_to_all='two_level'"),
    ],
)
def test_untested_layouts_are_refused_by_name(corpus: Path, layout: Layout, overrides: dict, named: str) -> None:
    """What a multi-rank run meets (checked on the layout, before any collective); the layouts offloading
    runs (dp, ep, dp x ep with replicated experts) are tests/dist/test_offload.py's."""
    cfg = tiny(corpus, **{"train.memory_budget": BUDGET, **overrides})
    with pytest.raises(LayoutError, match=re.escape(named)):
        check_offloadable(cfg, layout, torch.device("cpu"))


def test_interrupted_resume_leaves_no_offloaded_state(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while a resume loads its checkpoint: the offloaded state made for it is removed."""
    offload_dir = tmp_path / "state"
    cfg = tiny(corpus, **{"train.memory_budget": BUDGET, "train.offload_dir": str(offload_dir), "train.steps": "2"})
    train(cfg, tmp_path / "run", progress=False)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Checkpointer, "restore", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", resume=True, progress=False)
    assert not offload_dir.exists()


def test_a_checkpoint_before_any_update_is_in_memory_trainings(corpus: Path, tmp_path: Path) -> None:
    """The first step's gradients NaN (skipped, no update yet), a checkpoint after every step: torch
    initialises the optimizer's state for the first save (an AdamW step at learning rate 0); the
    offloaded run saves the same files and trains on with the same step counts, bit for bit."""
    schedule = {"train.steps": "3", "train.grad_accum": "1", "train.eval_every": "3", "train.ckpt_every": "1"}
    schedule["train.keep_checkpoints"] = "3"
    runs = {}
    for name, budget in (("memory", {}), ("disk", {"train.memory_budget": BUDGET})):
        with Watch({1}):
            runs[name] = train(tiny(corpus, **schedule, **budget), tmp_path / name, progress=False)
    assert runs["memory"].skipped_steps == runs["disk"].skipped_steps == 1
    assert runs["disk"].losses == runs["memory"].losses
    assert_same_checkpoints(tmp_path / "disk", tmp_path / "memory", [1, 2, 3])


@pytest.mark.parametrize(
    "host", [pytest.param({}, marks=pytest.mark.slow), {"train.host_budget": HOST}], ids=["disk", "host_tier"]
)
def test_skipped_nan_steps_record_no_update(corpus: Path, tmp_path: Path, host: dict[str, str]) -> None:
    """grad_accum = 1, NaN gradients at steps 2 and 5 (skipped, no AdamW update), an evaluation and a
    checkpoint between them: losses, skipped steps and weights bitwise those of in-memory training."""
    schedule = {"train.steps": "6", "train.grad_accum": "1", "train.eval_every": "4", "train.ckpt_every": "3"}
    runs = {}
    for name, budget in (("memory", {}), ("disk", {"train.memory_budget": BUDGET} | host)):
        with Watch({2, 5}):
            runs[name] = train(tiny(corpus, **schedule, **budget), tmp_path / name, progress=False)
    memory, disk = runs["memory"], runs["disk"]
    assert memory.skipped_steps == disk.skipped_steps == 2
    assert disk.losses == memory.losses and disk.val_loss == memory.val_loss
    a, b = weights(tmp_path / "memory"), weights(tmp_path / "disk")
    for key in a:
        assert torch.equal(a[key], b[key]), key
