"""Offloaded experts built into each rank's file at ep = 2 (``train.model_build.build_model`` on two gloo ranks).

Reference: a plain ``Transformer`` built whole from the same seed in each rank. Tolerance: none
(bitwise): each rank's file holds its ep shard of every layer's experts (the shard ``apply_ep``
scatters from rank 0's build), zero moments beside them; its expert parameters are storage-less
DTensors of the whole shape; every other parameter (FSDP-sharded over the two batch ranks, gathered
to compare) is the whole build's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from moekit import runconfig
from moekit.model import Transformer
from moekit.parallel.runtime import init_distributed
from moekit.train.model_build import build_model
from moekit.train.offload import claim_offload_file

from .spawn import MOEKIT, run_ranks

pytestmark = pytest.mark.dist

SEED = 3


def _compare(rank: int, world: int, tmp: Path) -> None:
    cfg = runconfig.resolve(
        "tiny",
        {
            "data.path": str(tmp / "unused.txt"),
            "model.n_layers": "3",
            "parallel.ep": "2",
            "train.memory_budget": "400KB",
            "train.offload_dir": str(tmp / "offload"),
        },
    )
    cpu = torch.device("cpu")
    layout, mesh = init_distributed(cfg, cpu)
    torch.manual_seed(SEED)
    whole = Transformer(cfg.model, cfg.moe)
    torch.manual_seed(SEED)
    model, _, _, offload = build_model(cfg, claim_offload_file(cfg, tmp / "run"), cpu, layout, mesh, None)
    try:
        reference = dict(whole.named_parameters())
        places = enumerate(offload.params)
        experts = {id(p): (layer, role) for layer, ps in places for role, p in zip(offload.roles, ps, strict=True)}
        buf = offload.file.buffer()
        ep_rank = mesh["ep"].get_local_rank()
        for name, p in model.named_parameters():
            if id(p) not in experts:
                assert torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), reference[name]), name
                continue
            layer, role = experts[id(p)]
            n = p.shape[0] // 2
            assert isinstance(p, DTensor) and p.shape == reference[name].shape
            assert p.to_local().shape[0] == n and p.to_local().untyped_storage().nbytes() == 0
            for kind in ("weight", "exp_avg", "exp_avg_sq"):
                offload.file.read(layer, kind, buf)
                shard = reference[name].detach()[ep_rank * n : (ep_rank + 1) * n]
                expected = shard if kind == "weight" else torch.zeros_like(shard)
                assert torch.equal(offload.file.views(buf)[role], expected), (name, kind)
    finally:
        offload.close()


@pytest.mark.slow
def test_each_rank_builds_its_ep_shard_into_its_file(tmp_path: Path) -> None:
    run_ranks(_compare, 2, tmp_path, tmp_path=tmp_path, preload=MOEKIT)
