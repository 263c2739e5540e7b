"""The model a run trains: built, started from another run's weights (``init``), placed on the mesh,
with its optimizer. Under ``train.memory_budget`` its experts are built into their offload file a MoE
layer at a time, never whole in RAM (``offload/build.py``), and handed to their ``ExpertOffload``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from moekit.errors import OptionError
from moekit.hostmem import large_blocks_returned
from moekit.model import Transformer
from moekit.parallel.mesh import Layout
from moekit.parallel.runtime import ParallelModel
from moekit.run.layout import latest_checkpoint
from moekit.run.load import load_model_weights
from moekit.run.manifest import read_manifest
from moekit.runconfig import RunConfig
from moekit.storage.files import StorageFile
from moekit.train.offload import ExpertWriter, expert_writer, offload_experts
from moekit.train.offload.init import load_streamed
from moekit.train.optim import build_optimizer
from moekit.train.step import RESIDENT, ExpertStorage


def build_model(
    cfg: RunConfig, storage: StorageFile | None, dev: torch.device, layout: Layout, mesh: Any, init: Path | None
) -> tuple[Transformer, ParallelModel, torch.optim.Optimizer, ExpertStorage]:
    """The whole model (its single-device structure), this rank's ``ParallelModel`` of it, the optimizer
    and where the experts' state lives: in the model (``RESIDENT``) or, under ``train.memory_budget``,
    offloaded into ``storage`` (``claim_offload_file``). A failure removes the offload file."""
    writer = None
    try:
        writer = expert_writer(cfg, storage, layout, mesh, dev) if storage is not None else None
        with large_blocks_returned() if writer is not None else contextlib.nullcontext():
            model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None, expert_sink=writer)
            if writer is None:
                model = model.to(dev)
            if init is not None:
                _load_init(Path(init), model, writer)
        pm = ParallelModel(model, cfg, dev, layout, mesh)
        file = writer.finish(model) if writer is not None else None
        optimizer = build_optimizer(pm.named_parameters(), cfg.train)
        experts = offload_experts(cfg, layout, mesh, model, optimizer, file) if file is not None else RESIDENT
    except BaseException:
        if storage is not None:
            storage.remove()
        raise
    return model, pm, optimizer, experts


def _load_init(init: Path, model: torch.nn.Module, writer: ExpertWriter | None) -> None:
    """Load the latest weights of run ``init`` (checksums verified) into ``model``; offloaded experts
    (``writer``) are streamed into their file a layer at a time (``offload/init.py``)."""
    path = latest_checkpoint(init)
    if path is None:
        raise OptionError("init", "has no checkpoint to start from", init)
    read_manifest(path)
    if writer is None:
        load_model_weights(path, model)
    else:
        load_streamed(path, model, writer)
