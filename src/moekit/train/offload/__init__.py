"""Training beyond memory: MoE experts' weights and AdamW state offloaded to disk (``train.memory_budget``),
the most-moved of them kept in a host tier in RAM (``train.host_budget``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

from moekit.errors import OptionError
from moekit.parallel.mesh import Layout, LayoutError, RunMesh
from moekit.parallel.runtime import global_rank
from moekit.runconfig import RunConfig
from moekit.storage.files import StorageFile
from moekit.train.offload.build import ExpertWriter, claim_file
from moekit.train.offload.checkpoint import StreamedExperts, restoring, saving, weights_finite
from moekit.train.offload.engine import ExpertOffload
from moekit.train.offload.reduce import LayerGradReduce
from moekit.train.offload.store import LayerFile, host_regions
from moekit.units import format_bytes, parse_bytes


class TrainingOffload(ExpertOffload):
    """``ExpertOffload`` at the model/optimizer seam the loop drives (``train.step.ExpertStorage``), its
    checkpoints streamed (``checkpoint.py``)."""

    def saving(self, model: nn.Module) -> AbstractContextManager[StreamedExperts]:
        return saving(self, model)

    def restoring(self, model: nn.Module) -> AbstractContextManager[StreamedExperts]:
        return restoring(self, model)

    def weights_finite(self) -> bool:
        return weights_finite(self)


__all__ = [
    "ExpertOffload",
    "ExpertWriter",
    "TrainingOffload",
    "check_offloadable",
    "claim_offload_file",
    "expert_writer",
    "offload_experts",
]


def claim_offload_file(cfg: RunConfig, run_dir: Path) -> StorageFile | None:
    """This rank's offload file under ``train.offload_dir`` (default ``RUN_DIR/offload``), claimed for this
    run alone before anything of the run is written (None: nothing is offloaded). Each rank offloads its
    own ep shard to its own file; a second run given the same directory is refused by name."""
    tc = cfg.train
    if not tc.offloaded:
        return None
    directory = Path(tc.offload_dir) if tc.offload_dir else Path(run_dir) / "offload"
    return claim_file(directory / f"experts-rank{global_rank()}.bin")


def expert_writer(
    cfg: RunConfig, storage: StorageFile, layout: Layout, mesh: RunMesh | None, device: torch.device
) -> ExpertWriter:
    """Where this rank's experts go as the model is built (``build.py``): its claimed ``storage``, once
    ``check_offloadable`` passes."""
    check_offloadable(cfg, layout, device)
    ep_rank = mesh["ep"].get_local_rank() if mesh is not None and layout.ep > 1 else 0
    return ExpertWriter(storage, len(cfg.model.moe_layers()), cfg.train.memory_budget, ep_rank, layout.ep)


def check_offloadable(cfg: RunConfig, layout: Layout, device: torch.device) -> None:
    """Refuse, naming the option, a run offloading does not support: the layouts tested against
    in-memory training are dp, ep and dp x ep with replicated experts."""
    tc, p = cfg.train, cfg.parallel
    budget = f"train.memory_budget={tc.memory_budget!r}"
    layouts = [
        (layout.tp > 1, f"parallel.tp={layout.tp}: offloaded experts are not tensor-parallel; use ep or dp"),
        (layout.pp > 1, f"parallel.pp={layout.pp}: offloaded experts run without a pipeline; use ep or dp"),
        (
            layout.dp > 1 and p.expert_sharding == "shard",
            f"parallel.dp={layout.dp} with parallel.expert_sharding='shard': offloaded experts are replicated "
            "over dp; set parallel.expert_sharding=replicate",
        ),
        (p.placement_every > 0, "parallel.placement_every > 0: offloaded experts stay where they start"),
        (layout.ep > 1 and p.dispatch_dedup, "parallel.dispatch_dedup=true: offloaded experts run per expert"),
        (layout.ep > 1 and p.overlap_chunks > 1, f"parallel.overlap_chunks={p.overlap_chunks}: must be 1"),
        (layout.ep > 1 and p.all_to_all != "flat", f"parallel.all_to_all={p.all_to_all!r}: must be flat"),
    ]
    for refused, why in layouts:
        if refused:
            raise LayoutError(f"{budget}: {why}")
    refusals = [
        (not cfg.is_moe, "the model has no MoE layers to offload"),
        (device.type != "cpu", "{device}: offloaded training runs on cpu"),
        (tc.dtype != "fp32", f"train.dtype={tc.dtype!r}: offloaded training runs in fp32"),
        (tc.compile, "train.compile=true: offloaded experts run eagerly"),
        (tc.async_checkpoint, "train.async_checkpoint=true: offloaded experts are checkpointed synchronously"),
        (
            len(set(cfg.model.experts_per_layer or ())) > 1,
            f"model.experts_per_layer={cfg.model.experts_per_layer}: offloaded layers hold the same experts",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise OptionError("train.memory_budget", why, tc.memory_budget, device=device)


def offload_experts(
    cfg: RunConfig, layout: Layout, mesh: RunMesh | None, model: nn.Module, optimizer, file: LayerFile
) -> TrainingOffload:
    """Train ``model``'s experts from ``file`` (``ExpertWriter.finish``) under ``cfg.train.memory_budget``.
    With ``cfg.train.host_budget``, each rank holds that many bytes of its regions in RAM instead of its
    file (``store.host_regions``)."""
    tc = cfg.train
    dp_group = mesh["dp"].get_group() if mesh is not None and layout.dp > 1 else None
    reduce = LayerGradReduce(dp_group, layout.batch_ranks)
    offload = TrainingOffload(model, optimizer, tc.memory_budget, file, reduce, layout.world, mesh is not None)
    if tc.host_budget:
        try:
            _host_tier(offload, tc.host_budget, tc.grad_accum)
        except BaseException:
            offload.close()
            raise
    return offload


def _host_tier(offload: ExpertOffload, host_budget: str, grad_accum: int) -> None:
    """Move the regions that ``host_budget`` holds (``store.host_regions``) from the file into RAM."""
    file = offload.file
    capacity = parse_bytes(host_budget, "train.host_budget") // file.unit
    if capacity < 1:
        raise OptionError(
            "train.host_budget",
            f"holds no region of expert state ({format_bytes(file.unit)} each); give at least that, or leave it out",
            host_budget,
        )
    file.move_to_host(host_regions(len(offload.params), offload.ws.cache.num_slots, grad_accum, capacity))
