"""Checkpoints of offloaded training (``train.memory_budget``), streamed between the offload file and
DCP's files a region at a time (``moekit.train.offload.checkpoint``).

Reference: the checkpoints of in-memory training of the same steps. Tolerance: none: every tensor of
the sharded checkpoint (weights, AdamW moments and steps, RNG table), read back through DCP at full
size in one process, is equal, and so are the bytes of every data file and of the consolidated
``model.safetensors``. Memory: measured by the OS (``VmHWM``, reset to ``VmRSS`` through
``/proc/self/clear_refs`` before each phase) in a child process whose expert state is several times
its budget: saving and resuming each raise the peak by at most a few regions (``RISE_REGIONS``), where
filling the whole expert state into RAM would raise it by every region of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import test_train_offload as offload_tests
import torch
from helpers import assert_same_checkpoints

from moekit.run.layout import MODEL_FILE, checkpoint_dir, step_dirs
from moekit.train import loop
from moekit.train.loop import TrainingError, train
from moekit.train.offload import ExpertOffload
from moekit.train.step import train_step

BUDGET, HOST, tiny = offload_tests.BUDGET, offload_tests.HOST, offload_tests.tiny
corpus = offload_tests.corpus  # the fixture

# The measured model: 12 MoE layers of 8 SwiGLU experts, d_model 128, d_ff 256 (one region: 3 MiB of
# fp32 weights, or of one moment); a budget of 8 regions (24 MiB), so the checkpointed expert state
# (weights and two moments, 36 regions, 108 MiB) is 4.5 times the budget.
MEASURED = {
    "model.n_layers": "12",
    "model.d_model": "128",
    "model.d_ff": "256",
    "model.n_heads": "4",
    "model.context_length": "32",
    "moe.num_experts": "8",
    "moe.top_k": "2",
    "train.batch_size": "2",
    "train.grad_accum": "1",
    "train.sample_tokens": "0",
}
REGIONS = 8
UNIT = 8 * (128 * 512 + 256 * 128) * 4  # bytes of one region: w_in [8, 128, 512] and w_out [8, 256, 128]
# Allowed rise of the peak over the resident set before a save or a resume, in regions: a save holds
# the region that DCP's writer is given expert tensors from and DCP's serialization of one, and the
# consolidation of the checkpoint into model.safetensors one block's weights as DCP reads them (the
# tensors, the bytes read and the bytes written: about three regions); a resume, the rest of the
# optimizer's state that torch makes before a load and what DCP reads of one saved chunk. Measured
# over 8 runs (the larger of two saves): 12 to 16 MiB to save, 16 to 18 MiB to resume; filling the expert
# state into RAM raised them by 120 and 154 MiB. (A fresh copy of each tensor instead of the reused
# region let the heap grow by 70 MiB in about half the saves.) Plus SLACK_MB for the allocator's and
# DCP's small allocations: 23 MiB in all, within the budget (24 MiB).
RISE_REGIONS = 5
SLACK_MB = 8


STEPS = {"train.steps": "2", "train.ckpt_every": "1", "train.eval_every": "2"}


@pytest.fixture(scope="module")
def in_memory(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tiny(corpus, **STEPS), tmp_path_factory.mktemp("memory") / "run", progress=False).run_dir


@pytest.mark.parametrize(
    "host", [pytest.param({}, marks=pytest.mark.slow), {"train.host_budget": HOST}], ids=["disk", "host_tier"]
)
def test_offloaded_checkpoints_equal_in_memory_ones(
    corpus: Path, in_memory: Path, tmp_path: Path, host: dict[str, str]
) -> None:
    """Checkpoints at steps 1 and 2, each taken with the step's AdamW updates still pending."""
    train(tiny(corpus, **STEPS, **{"train.memory_budget": BUDGET} | host), tmp_path / "disk", progress=False)
    assert_same_checkpoints(tmp_path / "disk", in_memory, [1, 2])
    assert (in_memory / "checkpoints" / "step_000002" / MODEL_FILE).exists(), "one process consolidates the weights"


def test_a_non_finite_offloaded_weight_stops_the_save(corpus: Path, tmp_path: Path) -> None:
    """The finite-weights check before a save reads the offloaded experts from their file."""
    cfg = tiny(corpus, **{"train.memory_budget": BUDGET})
    run = loop._setup(cfg, tmp_path / "run", False, torch.device("cpu"), False, None, False)
    assert isinstance(run.experts, ExpertOffload)
    try:
        record = train_step(run.pm, run.optimizer, run.corpus, cfg, run.dev, 0, None, run.experts)
        run.experts.settle()
        run.experts.ws.flush()
        run.experts.ws.forget()  # the file is changed below every resident layer
        region = run.experts.file.buffer()
        run.experts.file.read(2, "weight", region)
        run.experts.file.views(region)["w_out"][1, 2, 3] = float("inf")
        run.experts.file.write(2, "weight", region)
        with pytest.raises(TrainingError, match="weights are not finite after step 1"):
            loop._save(run, 1, record, 0, None)
        assert not checkpoint_dir(tmp_path / "run").exists() or not step_dirs(checkpoint_dir(tmp_path / "run"))
    finally:
        run.experts.close()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rise(phase) -> int:
    """How far ``phase()`` raises this process's peak resident set above its resident set before it."""
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    phase()
    return _status_bytes("VmHWM") - before


def _save(run: loop._Run, step: int, record: dict, saved: list[Path | None]) -> None:
    saved.append(loop._save(run, step, record, 0, None))


def measure(work: str, data: str) -> None:
    """In a child process: one offloaded step, a checkpoint of it, and a resume from that checkpoint
    into a new run; prints the rises of the peak RSS and the sizes as JSON."""
    from moekit import runconfig

    torch.set_num_threads(1)
    work_dir = Path(work)

    def setup(name: str) -> loop._Run:
        overrides = MEASURED | {"data.path": data, "data.cache_dir": str(work_dir / "cache")}
        overrides |= {"train.memory_budget": str(REGIONS * UNIT), "train.offload_dir": str(work_dir / name / "offload")}
        return loop._setup(
            runconfig.resolve("tiny", overrides), work_dir / name, False, torch.device("cpu"), False, None, False
        )

    run = setup("saved")
    assert isinstance(run.experts, ExpertOffload) and run.experts.file.unit == UNIT
    saved: list[Path | None] = []
    rises = []
    for step in range(2):  # each of two saves counts: the heap of the first is what the second finds
        record = train_step(run.pm, run.optimizer, run.corpus, run.cfg, run.dev, step, None, run.experts)
        rises.append(_rise(partial(_save, run, step + 1, record, saved)))
    save = max(rises)
    layers = len(run.experts.params)
    run.experts.close()
    fresh = setup("resumed")
    assert isinstance(fresh.experts, ExpertOffload) and saved[-1] is not None
    resume = _rise(
        lambda: loop._restore(fresh.saver, saved[-1], fresh.local, fresh.optimizer, fresh.pm.full_model, fresh.experts)
    )
    fresh.experts.close()
    print(json.dumps({"save": save, "saves": rises, "resume": resume, "layers": layers}))


@pytest.mark.slow
def test_saving_and_resuming_keep_to_the_budget(corpus: Path, tmp_path: Path) -> None:
    """The peak RSS of a save and of a resume, from the OS, in a child process of its own."""
    here = Path(__file__).parent
    child = f"import sys; sys.path[:0] = {[str(here), str(here.parent)]!r}; import {Path(__file__).stem} as t; "
    child += f"t.measure({str(tmp_path)!r}, {str(corpus)!r})"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=240, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    whole = 3 * got["layers"] * UNIT  # what filling the expert state into RAM would add
    limit = RISE_REGIONS * UNIT + SLACK_MB * 2**20
    assert limit <= REGIONS * UNIT < whole / 4, "the limit is within the budget, the expert state 4x beyond it"
    for phase in ("save", "resume"):
        assert got[phase] <= limit, (
            f"{phase} raised the peak RSS by {got[phase] / 2**20:.1f} MiB (limit {limit / 2**20:.0f} MiB): {got}"
        )


if __name__ == "__main__":
    measure(*sys.argv[1:])
