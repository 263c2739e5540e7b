"""Weight decay by name under FSDP2 and expert parallelism: the sharded parameters (DTensors) keep the
model's own names, so each gets the decay its unsharded twin gets, and every optimizer group holds
one kind of tensor (plain, or DTensor on one mesh), as the fused AdamW kernel needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from moekit import runconfig
from moekit.model import Transformer
from moekit.parallel.runtime import ParallelModel, init_distributed
from moekit.train.optim import build_optimizer, decays

from .spawn import MOEKIT, run_ranks

pytestmark = pytest.mark.dist

BASE = {
    "model.n_layers": "2",
    "model.n_heads": "2",
    "model.d_model": "32",
    "model.d_ff": "32",
    "moe.d_ff": "8",
    "moe.num_experts": "4",
    "moe.top_k": "2",
    "moe.expert_ffn_bias": "true",  # stacked [E, F] biases: 2-D, and no decay
    "model.context_length": "16",
    "train.batch_size": "4",
    "train.weight_decay": "0.1",
    "data.tokenizer": "byte",
}


def _groups(rank: int, world: int, overrides: dict[str, str]) -> None:
    cfg = runconfig.resolve("tiny", BASE | overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    unsharded = {name for name, _ in model.named_parameters()}
    layout, mesh = init_distributed(cfg, torch.device("cpu"))
    pm = ParallelModel(model, cfg, torch.device("cpu"), layout, mesh)
    named = pm.named_parameters()
    assert {name for name, _ in named} == unsharded
    assert any(isinstance(p, DTensor) for _, p in named), "sharded"
    opt = build_optimizer(named, cfg.train)
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in named:
        assert decay_of[id(p)] == (0.1 if decays(name) else 0.0), name
    for group in opt.param_groups:
        meshes = {id(p.device_mesh) if isinstance(p, DTensor) else None for p in group["params"]}
        assert len(meshes) == 1, meshes
    for _, p in named:
        p.grad = torch.zeros_like(p)
    opt.step()  # the fused kernel accepts every group


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{"parallel.dp": "2"}, {"parallel.ep": "2", "parallel.dp": "1"}])
def test_sharded_parameters_keep_their_names_and_decay(overrides: dict[str, str], tmp_path: Path) -> None:
    run_ranks(_groups, 2, overrides, tmp_path=tmp_path, preload=MOEKIT)
