"""Checkpoints of offloaded training, streamed: expert state moves between the offload file and DCP's
files one (layer, kind) region at a time, so saving and resuming keep to the memory budget.

The expert parameters stay storage-less in the model, and so do their AdamW moments in the optimizer
while a save runs: DCP plans from their type, shape and placement alone, and the checkpoint's keys,
shapes and files are those of in-memory training (``sharded.Streamed``).

- ``saving``: the pending AdamW updates run first, layer by layer as a forward would run them; then
  DCP's writer reads each expert tensor from the file as it reaches it (through the scratch
  regions, one per kind), into one tensor per role that every read reuses.
- ``restoring``: torch initialises the optimizer's state before a load with one zero step over every
  parameter that requires a gradient; the experts, which have no storage, are kept out of it and
  given only the step count the load fills. Everything else is loaded as in memory, then each
  region of expert state is read from the checkpoint into a scratch region and written to the file.

RAM beyond the budget: one region of a save (the copy of each role's piece that DCP's writer is given),
and what DCP reads of one saved chunk in a resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from moekit.experts.grouped import local_tensor
from moekit.hostmem import release_freed_memory
from moekit.run.sharded import MODEL_PREFIX, read_metadata, read_tensors
from moekit.train.offload.engine import ExpertOffload

SAVED = ("weight", "exp_avg", "exp_avg_sq")  # the kinds a checkpoint holds (not the gradient)


class StreamedExperts:
    """The offloaded experts' entries of a checkpoint, by flattened state-dict key (``sharded.Streamed``).

    ``model``: the module whose state dict the checkpoint holds (it names the parameters);
    ``moments``: whether the AdamW moments are among the keys.
    """

    def __init__(self, offload: ExpertOffload, model: nn.Module, moments: bool) -> None:
        names = {id(p): name for name, p in model.named_parameters()}
        self.offload = offload
        self.where: dict[str, tuple[int, str, str]] = {}  # key -> (layer, kind, role)
        for layer, params in enumerate(offload.params):
            for role, p in zip(offload.roles, params, strict=True):
                self.where[MODEL_PREFIX + names[id(p)]] = (layer, "weight", role)
                for kind in SAVED[1:] if moments else ():
                    self.where[f"optim.state.{names[id(p)]}.{kind}"] = (layer, kind, role)
        self.keys = self.where.keys()
        self._held: dict[str, int] = {}  # kind -> the layer whose region its scratch buffer holds
        # NOTE: one tensor per role, each with storage of its own, reused by every read: a fresh copy
        # per read let glibc's heap grow by a few MiB at each key (freed copies of one size leave holes
        # that the next size does not fit), 70 MiB over a 12-layer save.
        self._out = {role: torch.empty_like(view) for role, view in offload.file.views(offload.scratch[0]).items()}

    def _region(self, layer: int, kind: str) -> dict[str, Tensor]:
        """Region (layer, kind) in the kind's scratch buffer, by role (read unless it is there)."""
        buf = self.offload.scratch[SAVED.index(kind)]
        if self._held.get(kind) != layer:
            self._held.pop(kind, None)
            self.offload.file.read(layer, kind, buf)
            self._held[kind] = layer
        return self.offload.file.views(buf)

    def read(self, key: str) -> Tensor:
        layer, kind, role = self.where[key]
        return self._out[role].copy_(self._region(layer, kind)[role])

    def load(self, directory: Path) -> None:
        """Every region of expert state from the checkpoint ``directory`` to the file (moments the
        checkpoint lacks, before any optimizer step, are zeros)."""
        saved = read_metadata(directory).state_dict_metadata
        key_of = {place: key for key, place in self.where.items()}
        buf = self.offload.scratch[0]
        self._held.clear()
        for layer, params in enumerate(self.offload.params):
            for kind in SAVED:
                views = self.offload.file.views(buf)
                targets = {}
                for role, p in zip(self.offload.roles, params, strict=True):
                    key = key_of[(layer, kind, role)]
                    if key in saved:
                        targets[key] = _placed_like(p, views[role])
                    else:
                        views[role].zero_()
                if targets:
                    read_tensors(directory, targets)
                self.offload.file.write(layer, kind, buf)
        self.offload.ws.forget()  # the file was rewritten under any resident layer


def weights_finite(offload: ExpertOffload) -> bool:
    """Whether every expert weight of this rank is finite, its pending updates run (read a layer at a time)."""
    offload.settle()
    offload.ws.flush()
    buf = offload.scratch[SAVED.index("weight")]
    finite = True
    for layer in range(len(offload.params)):
        offload.file.read(layer, "weight", buf)
        finite = finite and bool(torch.stack([t.isfinite().all() for t in offload.file.views(buf).values()]).all())
    return finite


@contextlib.contextmanager
def saving(offload: ExpertOffload, model: nn.Module) -> Iterator[StreamedExperts]:
    """The expert state ready to be streamed into a checkpoint of ``model`` and its optimizer."""
    offload.settle()
    offload.ws.flush()
    state = offload.optimizer.state
    if not state:
        _first_state(offload, model)
    _in_parameter_order(offload.optimizer)
    # NOTE: .get: a defaultdict entry would count as optimizer state to torch's checkpoint code.
    stepped = [p for params in offload.params for p in params if "step" in state.get(p, {})]
    for p in stepped:
        for kind in SAVED[1:]:  # after "step", in the order fused AdamW makes them
            state[p][kind] = _storage_less_like(p)
    try:
        yield StreamedExperts(offload, model, moments=bool(stepped))
    finally:
        for p in stepped:
            for kind in SAVED[1:]:
                state[p].pop(kind, None)
        release_freed_memory()


@contextlib.contextmanager
def restoring(offload: ExpertOffload, model: nn.Module) -> Iterator[StreamedExperts]:
    """The optimizer ready for a checkpoint to be loaded into ``model`` and it, the expert state to be
    streamed from it. A resume that fails removes the offloaded state (no run owns it yet)."""
    experts = [p for params in offload.params for p in params]
    try:
        try:
            for p in experts:
                p.requires_grad_(False)
            get_state_dict(model, offload.optimizer)  # initialises the rest of the optimizer's state
        finally:
            for p in experts:
                p.requires_grad_(True)
        for p in experts:  # NOTE: as fused AdamW counts: a float32 scalar (the load overwrites it)
            offload.optimizer.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
        yield StreamedExperts(offload, model, moments=True)
    except BaseException:
        offload.close()
        raise
    finally:
        release_freed_memory()


def _first_state(offload: ExpertOffload, model: nn.Module) -> None:
    """The optimizer's state before its first update, as a save in memory makes it.

    NOTE: with no state yet (every step so far skipped), torch's ``get_state_dict`` initialises it by one
    AdamW step at learning rate 0 over every trainable parameter: zero moments and a step count of 1
    for each, which the next real update then continues. The experts, which have no storage, are kept
    out of that step and given its count; their moments in the file are still the zeros it makes."""
    experts = [p for params in offload.params for p in params]
    try:
        for p in experts:
            p.requires_grad_(False)
        get_state_dict(model, offload.optimizer)
    finally:
        for p in experts:
            p.requires_grad_(True)
    for p in experts:  # NOTE: as fused AdamW counts: a float32 scalar
        offload.optimizer.state[p]["step"] = torch.tensor(1.0, dtype=torch.float32)


def _in_parameter_order(optimizer: torch.optim.Optimizer) -> None:
    """Order the optimizer's state by parameter, as in-memory training's first step makes it.

    NOTE: the experts' state is made at the step after the rest's (``DeferredAdamW.record``); the
    order of the state is the order of the checkpoint's items in its files, so without this the
    files would hold the same tensors in another order."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p in optimizer.state]
    ordered = [(p, optimizer.state.pop(p)) for p in params]
    optimizer.state.update(ordered)


def _storage_less_like(p: nn.Parameter) -> Tensor:
    """A tensor of ``p``'s type, shape and placement with no storage (never touched pages: no RSS)."""
    like = torch.empty_like(p.detach())
    local_tensor(like).untyped_storage().resize_(0)
    return like


def _placed_like(p: nn.Parameter, local: Tensor) -> Tensor:
    """``local`` (this rank's piece) placed as ``p`` is, so that DCP reads this rank's piece into it."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
