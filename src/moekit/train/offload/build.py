"""Offloaded experts built straight into their file, one MoE layer at a time: a run whose expert weights
do not fit in RAM starts.

The model is built with its routed experts on the meta device (``Transformer(expert_sink=...)``). Their
init still draws every value, whole and in its place in the generator's stream, so every weight (the
experts' and the rest's) is the in-memory build's bit for bit; each stacked weight, as it is drawn,
comes here: this rank's ep shard of it (the experts ``apply_ep`` would keep) is copied into the layer's
region buffer and the draw is dropped. A layer's buffer goes to its weight region once the next layer
starts (biases: zeros, as built), with zero AdamW moments. Start-up RAM beyond the non-expert model
and the budget: one stacked weight of one layer, every ep rank's experts (drawn whole to keep the
stream), and one region. Another run's weights (``init``) replace a layer's the same way
(``rewrite``, from ``init.py``).

Once the model is placed on the mesh (its ep shards meta DTensors), ``finish`` swaps each expert
parameter for one of the same type, shape and placement on the CPU without storage: what the
optimizer and ``ExpertOffload`` take.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moekit.experts.grouped import local_tensor
from moekit.hostmem import release_freed_memory
from moekit.layer import MoE
from moekit.storage.files import FileInUse, StorageFile
from moekit.train.offload.engine import regions_in_budget
from moekit.train.offload.store import LayerFile, region_bytes


def claim_file(path: Path) -> StorageFile:
    """This rank's offload file, claimed (``StorageFile.claim``) for this run alone; a directory that
    cannot hold it is a ``ValueError`` naming ``train.offload_dir``."""
    try:
        return StorageFile.claim(path)
    except OSError as err:
        raise offload_dir_error(path, err) from None


def offload_dir_error(path: Path, err: OSError) -> ValueError:
    """What is wrong with ``train.offload_dir`` (the directory of ``path``), in one line."""
    directory = path.parent
    if isinstance(err, FileInUse):
        why = f"{path.name} is in use by another run; give each run its own train.offload_dir"
    elif any(p.exists() and not p.is_dir() for p in (directory, *directory.parents)):
        why = "is a file, not a directory"
    else:
        why = f"cannot hold the offloaded expert state: {err.strerror}"
    return ValueError(f"train.offload_dir={directory}: {why}")


class ExpertWriter:
    """This rank's ep shard (``ep_rank`` of ``ep``) of ``layers`` MoE layers' experts into ``storage`` (a
    claimed file), as the model's init draws them (an ``ExpertSink``). ``budget``: ``train.memory_budget``,
    checked as soon as a layer's size is known, before the file takes its room."""

    def __init__(self, storage: StorageFile, layers: int, budget: str, ep_rank: int = 0, ep: int = 1) -> None:
        self.storage, self.path, self.layers, self.budget = storage, storage.path, layers, budget
        self.ep_rank, self.ep = ep_rank, ep
        self.file: LayerFile | None = None
        self._buf: Tensor | None = None
        self._layer = -1  # the layer whose weights the buffer holds
        self.written = 0  # layers in the file

    def __call__(self, moe: MoE, role: str, values: Tensor) -> None:
        if self.file is None:
            self._open(moe.experts)
        if moe.index != self._layer:
            self._flush()
            assert moe.index == self.written, f"MoE layer {moe.index} drawn after {self.written} layers"
            self._layer = moe.index
        assert self.file is not None and self._buf is not None
        view = self.file.views(self._buf)[role]
        view.copy_(values[self._rows(view.shape[0])])

    def rewrite(self, layer: int, read: Callable[[str, slice], Tensor]) -> None:
        """Layer ``layer``'s weights replaced by another run's (``init``): ``read(role, rows)`` gives
        role's rows of this rank's ep shard; the moments stay zero."""
        self._flush()
        assert self.file is not None and self._buf is not None
        for role, view in self.file.views(self._buf).items():
            view.copy_(read(role, self._rows(view.shape[0])))
        self.file.write(layer, "weight", self._buf)
        self._buf.zero_()

    def _rows(self, local: int) -> slice:
        """This rank's experts of a stacked weight, ``local`` of them (``apply_ep``'s ``Shard(0)``)."""
        return slice(self.ep_rank * local, (self.ep_rank + 1) * local)

    def _open(self, experts: nn.Module) -> None:
        shapes = {}
        for role, p in experts.named_parameters(recurse=False):
            assert p.is_meta and p.dtype == torch.float32 and p.shape[0] % self.ep == 0, "fp32 meta, split evenly"
            shapes[role] = (p.shape[0] // self.ep, *p.shape[1:])
        regions_in_budget(self.budget, region_bytes(shapes))
        try:
            self.file = LayerFile(self.storage, self.layers, shapes)
        except OSError as err:
            raise offload_dir_error(self.path, err) from None
        self._buf = self.file.buffer()
        self._buf.zero_()

    def _flush(self) -> None:
        """The buffer's layer to its weight region, zero moments beside it; the buffer zeroed."""
        if self._layer < 0:
            return
        assert self.file is not None and self._buf is not None
        self.file.write(self._layer, "weight", self._buf)
        self._buf.zero_()
        for kind in ("exp_avg", "exp_avg_sq"):
            self.file.write(self._layer, kind, self._buf)
        self._layer = -1
        self.written += 1

    def finish(self, model: nn.Module) -> LayerFile:
        """The last layer written, every expert parameter of ``model`` (placed on its mesh) swapped for a
        storage-less one on the CPU; returns the file."""
        self._flush()
        assert self.file is not None and self.written == self.layers, f"{self.written} of {self.layers} layers"
        self._buf = None
        for moe in model.moe_layers():
            for role, p in list(moe.experts.named_parameters(recurse=False)):
                setattr(moe.experts, role, nn.Parameter(_storage_less_like(p), requires_grad=p.requires_grad))
        release_freed_memory()
        return self.file

    def discard(self) -> None:
        """Remove the file and the directories made for it (a start-up that failed)."""
        self.storage.remove()


def _storage_less_like(p: Tensor) -> Tensor:
    """A CPU tensor of ``p``'s type, shape and placement, without storage (its pages never touched)."""
    local = torch.empty(local_tensor(p).shape, dtype=p.dtype)
    local.untyped_storage().resize_(0)
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
