"""DCP planners for training state that is not simply the model's and optimizer's tensors.

- Experts re-placed by the rebalancer (``parallel/rebalance.py``) hold row s = slot s, not expert s.
  They are written and read in canonical order (row e = expert e) without moving them: each run of
  local rows holding consecutive experts is described as a chunk at its canonical offset, so the
  files look as if nothing had moved, and a load writes each expert's rows into whatever slot it
  occupies now. The live model is never touched by a save.
- Streamed state (``Streamed``: offloaded training's expert state, held in files of its own): its
  state-dict entries are storage-less tensors that carry only their type, shape and placement, which
  is all planning reads. A save reads each of them when the writer reaches it, over the previous
  one; a load leaves them to their owner, which reads them afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Protocol

from torch import Size, Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from moekit.parallel.rebalance import MOMENTS  # AdamW's per-row state, permuted with the expert weights

MODEL_PREFIX = "model."


Slots = dict[str, tuple[int, ...]]  # expert parameter name -> its layer's expert_to_slot (non-identity only)


def permuted_keys(slots: Slots) -> dict[str, tuple[int, ...]]:
    """The flattened state-dict keys whose rows are slots: each expert weight and its AdamW moments."""
    keys = {}
    for name, expert_to_slot in slots.items():
        keys[MODEL_PREFIX + name] = expert_to_slot
        for moment in MOMENTS:
            keys[f"optim.state.{name}.{moment}"] = expert_to_slot
    return keys


@dataclasses.dataclass(frozen=True)
class _Run:
    """Local rows ``[row, row + length)`` hold experts ``[expert, expert + length)``."""

    row: int
    expert: int
    length: int


def _runs(tensor: Tensor, expert_to_slot: tuple[int, ...]) -> list[_Run]:
    """This rank's rows of ``tensor`` (a ``Shard(0)`` DTensor of slots) as runs of consecutive experts."""
    assert isinstance(tensor, DTensor) and tensor.shape[0] == len(expert_to_slot), "expert rows are slots"
    local = tensor.to_local()
    first = tensor.__create_chunk_list__()[0].offsets[0]  # the first slot this rank holds
    slot_to_expert = {slot: e for e, slot in enumerate(expert_to_slot)}
    runs: list[_Run] = []
    for row in range(local.shape[0]):
        expert = slot_to_expert[first + row]
        last = runs[-1] if runs else None
        if last is not None and last.expert + last.length == expert:
            runs[-1] = _Run(last.row, last.expert, last.length + 1)
        else:
            runs.append(_Run(row, expert, 1))
    return runs


def _chunk(tensor: Tensor, run: _Run) -> ChunkStorageMetadata:
    rest = tuple(tensor.shape[1:])
    offsets = Size((run.expert, *[0] * len(rest)))
    return ChunkStorageMetadata(offsets=offsets, sizes=Size((run.length, *rest)))


def _rows(state: dict, fqn: str, expert_to_slot: tuple[int, ...], offsets: Size) -> Tensor:
    """The local rows of ``state[fqn]`` that hold the chunk starting at canonical ``offsets``."""
    tensor = state[fqn]
    run = next(r for r in _runs(tensor, expert_to_slot) if r.expert == offsets[0])
    return tensor.to_local()[run.row : run.row + run.length]


class _CanonicalSavePlanner(DefaultSavePlanner):
    """Writes the permuted keys as one chunk per run of consecutive experts, at canonical offsets."""

    def __init__(self, keys: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.keys = keys

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        missing = [k for k in self.keys if k.startswith(MODEL_PREFIX) and k not in self.state_dict]
        assert not missing, f"expert weights not in the state dict: {missing}"
        items = [item for item in plan.items if item.index.fqn not in self.keys]
        for fqn, expert_to_slot in self.keys.items():
            tensor = self.state_dict.get(fqn)
            if tensor is None:
                continue  # moments before the first optimizer step
            properties = next(i.tensor_data.properties for i in plan.items if i.index.fqn == fqn)
            for run in _runs(tensor, expert_to_slot):
                chunk = _chunk(tensor, run)
                data = TensorWriteData(chunk=chunk, properties=properties, size=tensor.shape)
                index = MetadataIndex(fqn, chunk.offsets)
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if fqn not in self.keys:
            return super().resolve_data(write_item)
        return _rows(self.state_dict, fqn, self.keys[fqn], write_item.index.offset)


class _CanonicalLoadPlanner(DefaultLoadPlanner):
    """Reads each run of consecutive experts from its canonical offset into the rows that hold it now."""

    def __init__(self, keys: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.keys = keys

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        items = [item for item in plan.items if item.dest_index.fqn not in self.keys]
        for fqn, expert_to_slot in self.keys.items():
            tensor = self.state_dict.get(fqn)
            if tensor is None:
                continue
            chunks = [_chunk(tensor, run) for run in _runs(tensor, expert_to_slot)]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        if index.fqn not in self.keys:
            return super().lookup_tensor(index)
        return _rows(self.state_dict, index.fqn, self.keys[index.fqn], index.offset)


class Streamed(Protocol):
    """Tensors of the training state held outside the model and optimizer (offloaded expert state)."""

    keys: Collection[str]  # their flattened state-dict keys ("model.<name>", "optim.state.<name>.<moment>")

    def read(self, key: str) -> Tensor:
        """This rank's local tensor of ``key``, read now into storage of its own (exactly its size, so
        DCP's writer does not copy it), valid until the next ``read``."""
        ...

    def load(self, directory: Path) -> None:
        """Read every key from the sharded checkpoint ``directory`` into where it is held."""
        ...


class _StreamingSavePlanner(DefaultSavePlanner):
    """Resolves each streamed key by reading it (``Streamed.read``) when the writer asks for it.

    NOTE: a read overwrites the previous one, which a serial writer has written by then. DCP's file
    writer keeps every tensor it wrote referenced until its file is closed, but uses them again only
    for the safetensors format (refused in ``sharded.save``).
    """

    def __init__(self, streamed: Streamed) -> None:
        super().__init__()
        self.streamed = streamed

    def create_local_plan(self) -> SavePlan:
        _check_streamed(self.streamed.keys, self.state_dict)
        return super().create_local_plan()

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if fqn not in self.streamed.keys:
            return super().resolve_data(write_item)
        tensor = self.streamed.read(fqn)
        assert write_item.tensor_data is not None and tensor.shape == write_item.tensor_data.chunk.sizes
        return tensor


class _SkippingLoadPlanner(DefaultLoadPlanner):
    """Reads everything but the streamed keys (their owner reads them afterwards)."""

    def __init__(self, skipped: Collection[str]) -> None:
        super().__init__()
        self.skipped = skipped

    def create_local_plan(self) -> LoadPlan:
        _check_streamed([k for k in self.skipped if k.startswith(MODEL_PREFIX)], self.state_dict)
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[i for i in plan.items if i.dest_index.fqn not in self.skipped])


def _check_streamed(keys: Iterable[str], state: dict) -> None:
    missing = [k for k in keys if k not in state]
    assert not missing, f"streamed keys not in the state dict: {missing[:3]}"


def save_planner(slots: Slots | None, streamed: Streamed | None = None) -> DefaultSavePlanner:
    assert not (slots and streamed), "offloaded experts are not re-placed"
    if streamed is not None:
        return _StreamingSavePlanner(streamed)
    return _CanonicalSavePlanner(permuted_keys(slots)) if slots else DefaultSavePlanner()


def load_planner(slots: Slots | None, streamed: Streamed | None = None) -> DefaultLoadPlanner:
    assert not (slots and streamed), "offloaded experts are not re-placed"
    if streamed is not None:
        return _SkippingLoadPlanner(streamed.keys)
    return _CanonicalLoadPlanner(permuted_keys(slots)) if slots else DefaultLoadPlanner()
