"""Parallel layouts through the real ``train()`` against ``train()`` in one process.

Each layout trains ``STEPS`` steps from the same seed on gloo ranks, through everything a run does
(the data loader, per-rank gradient accumulation, the LR schedule, the aux-loss-free bias update,
tied embeddings, the final checkpoint); its reference is one process with the same config and
``grad_accum`` times the data ranks (dp x ep), so it reads the same samples in the same order.
Compared: each step's loss and gradient norm (metrics.jsonl) and the final checkpoint's weights.
Tolerance: 1e-5 on losses and gradient norms, 1e-4 on weights (AdamW's first updates are close to
sign(grad) * lr, so fp32 summation-order differences in tiny gradients grow over the steps).

Pipelines take the balancing loss, capacity and expert-choice routing over each pipeline micro-batch
(the parity test's split reference); here, against one process, they run with the balancing loss off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moekit import runconfig
from moekit.run.load import load_run
from moekit.train.loop import train

from .spawn import MOEKIT, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
BASE = {
    "model.n_layers": "2",
    "model.context_length": "16",
    "train.batch_size": "4",
    "train.steps": str(STEPS),
    "train.warmup_steps": "1",
    "train.ckpt_every": "0",
    "train.eval_every": "100",
    "train.eval_iters": "1",
    "parallel.timeout_s": "120",
}
UNTIED = {"model.tie_embeddings": "false"}
NO_AUX = {"moe.aux_loss_coef": "0"}  # pipelines: see the module docstring
EP2, DP2 = {"parallel.ep": "2"}, {"parallel.dp": "2"}
# name -> (world size, overrides)
LAYOUTS: dict[str, tuple[int, dict[str, str]]] = {
    "ep2-expert_choice": (2, {**EP2, "moe.router": "expert_choice"}),
    "ep2-hash": (2, {**EP2, "moe.router": "hash"}),
    "ep2-switch": (2, {**EP2, "moe.router": "switch", "moe.top_k": "1"}),
    "ep2-gshard": (2, {**EP2, "moe.router": "gshard"}),
    "ep2-noisy_topk": (2, {**EP2, "moe.router": "noisy_topk"}),
    "ep2-shared-gated": (2, {**EP2, "moe.num_shared_experts": "1", "moe.shared_expert_gate": "true"}),
    "ep2-grad_accum2": (2, {**EP2, "train.grad_accum": "2"}),
    "tp2-tied": (2, {"parallel.tp": "2"}),
    "pp2xdp2": (4, {"parallel.pp": "2", **DP2, **UNTIED, **NO_AUX}),
    "pp2xtp2": (4, {"parallel.pp": "2", "parallel.tp": "2", **UNTIED, **NO_AUX}),
    "ep2xpp2-interleaved": (
        4,
        {**EP2, "parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b", "model.n_layers": "4"}
        | UNTIED
        | NO_AUX,
    ),
    "ep2xdp2-two_level": (4, {**EP2, **DP2, "parallel.all_to_all": "two_level", "parallel.node_size": "1"}),
    "ep2xdp2-tied": (4, {**EP2, **DP2}),
    "ep2xdp2-aux_free": (4, {**EP2, **DP2, "moe.bias_update_rate": "0.01", **NO_AUX}),
}
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


def _cfg(name: str, corpus: Path, cache: Path, one_process: bool = False) -> runconfig.RunConfig:
    world, overrides = LAYOUTS[name]
    values = {**BASE, **overrides, "data.path": str(corpus), "data.cache_dir": str(cache)}
    if one_process:
        layout = {k: v for k, v in values.items() if k.startswith("parallel.") and k != "parallel.timeout_s"}
        batch_ranks = world // (int(layout.get("parallel.pp", 1)) * int(layout.get("parallel.tp", 1)))
        values = {k: v for k, v in values.items() if k not in layout}
        values["train.grad_accum"] = str(int(values.get("train.grad_accum", 1)) * batch_ranks)
    return runconfig.resolve("tiny", values)


def _train_layouts(rank: int, world: int, names: list[str], corpus: Path, tmp: Path) -> None:
    for name in names:
        train(_cfg(name, corpus, tmp / "cache"), tmp / name, progress=False)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _differences(name: str, corpus: Path, tmp: Path) -> list[str]:
    got, ref = tmp / name, tmp / f"{name}-one-process"
    train(_cfg(name, corpus, tmp / "cache", one_process=True), ref, progress=False)
    failures = []
    for key in ("loss", "grad_norm", "lr"):
        a = torch.tensor([r[key] for r in _records(got)])
        b = torch.tensor([r[key] for r in _records(ref)])
        if a.shape != b.shape or (a - b).abs().max() > LOSS_TOL:
            failures.append(f"{name} {key}: {a.tolist()} != {b.tolist()}")
    mine, want = load_run(got).model.state_dict(), load_run(ref).model.state_dict()
    if "moe.bias_update_rate" in LAYOUTS[name][1]:  # the bias moved, so comparing it means something
        assert any(t.abs().sum() > 0 for k, t in want.items() if k.endswith("expert_bias")), name
    for key, tensor in want.items():
        diff = (mine[key] - tensor).abs().max().item()
        if diff > WEIGHT_TOL:
            failures.append(f"{name} {key}: final weights differ by {diff:.2e}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_through_train_match_one_process(world: int, corpus_file: Path, tmp_path: Path) -> None:
    """One spawn per world size trains every layout of that size; a failure names each that differs."""
    names = [name for name, (w, _) in LAYOUTS.items() if w == world]
    run_ranks(_train_layouts, world, names, corpus_file, tmp_path, tmp_path=tmp_path, preload=MOEKIT)
    failures = [line for name in names for line in _differences(name, corpus_file, tmp_path)]
    assert not failures, "\n".join(failures)
