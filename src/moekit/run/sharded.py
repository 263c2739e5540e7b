"""A run's training state as a sharded checkpoint (``torch.distributed.checkpoint``, DCP).

Every rank writes the pieces it holds (expert shards, FSDP shards, tensor-parallel slices) under
canonical parameter names with their global shapes, so any other layout reads back exactly the
pieces it needs: a checkpoint saved at dp=2 x ep=2 loads at ep=4, pp=2 or in one process. The state
is ``{"model": ..., "optim": ..., "rng": [world, n] uint8}`` (the RNG states of every rank, so a
resume at the same world size continues each rank's stream; at another size rank r takes the
saved rank ``r % saved_world``'s).

Experts re-placed by the rebalancer (``parallel/rebalance.py``) hold row s = slot s, not expert s.
They are written and read in canonical order (row e = expert e) without moving them: the planners
below describe each run of local rows holding consecutive experts as a chunk at its canonical offset,
so the files look as if nothing had moved, and a load writes each expert's rows into whatever slot it
occupies now. The live model is never touched by a save.

Publication (temporary directory, manifest, atomic rename, ``latest``) is ``checkpoint.py``'s; this
module only reads and writes the ``sharded/`` directory inside a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from moekit.parallel.rebalance import MOMENTS  # AdamW's per-row state, permuted with the expert weights
from moekit.run.layout import CheckpointError

MODEL_PREFIX = "model."
METADATA = ".metadata"  # the file DCP's coordinator writes
# DCP gathers every rank's failure into a CheckpointException, which is not an Exception.
FAILURES = (Exception, CheckpointException)


class LocalModel(nn.Module):
    """The parameters this rank holds, under the whole model's names (``embed``, ``blocks.3``, ...).

    One pipeline rank may hold several stage models; DCP and the optimizer see them as one module.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict()
        for module in modules:
            for name in ("embed", "norm", "lm_head"):
                part = getattr(module, name, None)
                if part is not None:
                    setattr(self, name, part)
            items = module.blocks.items() if isinstance(module.blocks, nn.ModuleDict) else enumerate(module.blocks)
            for index, block in items:
                self.blocks[str(index)] = block


def local_model(modules: list[nn.Module]) -> nn.Module:
    return modules[0] if len(modules) == 1 else LocalModel(modules)


def _rng_row() -> Tensor:
    """This process's RNG states (CPU, then CUDA where present) as one uint8 vector."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    return torch.cat(states)


def _set_rng_row(row: Tensor) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(row[:cpu].clone())
    if torch.cuda.is_available() and row.numel() > cpu:
        torch.cuda.set_rng_state(row[cpu:].clone())


def _rng_table(group: dist.ProcessGroup | None) -> Tensor:
    """Every rank's RNG row as rows of one tensor (saved identically by all ranks)."""
    mine = _rng_row()
    if group is None:
        return mine.unsqueeze(0)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows)


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None) -> dict:
    """What a checkpoint holds of this rank: its shards of the weights and optimizer, and the RNG table."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "rng": _rng_table(group)}


def describe(err: BaseException) -> str:
    """One line for a failed DCP call: the first failing rank's own error."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, cause = next(iter(sorted(err.failures.items(), key=lambda item: item[0])))
        err = cause
        where = f"rank {rank}: "
    else:
        where = ""
    if isinstance(err, OSError) and err.strerror:
        return where + err.strerror
    text = str(err).strip().splitlines()
    return where + (text[-1] if text else type(err).__name__)[:300]


@contextlib.contextmanager
def _dcp_call():
    """DCP warns on every single-process call that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (relative names): the manifest is
    built from what every rank reports it wrote, not from one rank's view of the directory."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.written: set[str] = set()

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        self.written.update(result.storage_data.relative_path for result in done.wait())
        return done

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written.add(METADATA)


def save(state: dict, writer: RecordingWriter, group: dist.ProcessGroup | None, slots: Slots | None = None) -> None:
    """Write ``state`` through ``writer`` (``slots``: expert rows to write in canonical order)."""
    with _dcp_call():
        dcp.save(state, storage_writer=writer, planner=_save_planner(slots), process_group=group, no_dist=group is None)


def save_async(
    state: dict, writer: RecordingWriter, group: dist.ProcessGroup | None, slots: Slots | None = None
) -> Future:
    """Copy the state to CPU staging memory now; write it on a background thread (the returned future)."""
    with _dcp_call():
        return dcp.async_save(
            state, storage_writer=writer, planner=_save_planner(slots), process_group=group, no_dist=group is None
        )


# --- expert rows in canonical order ------------------------------------------------------------------

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
    offsets = torch.Size((run.expert, *[0] * len(rest)))
    return ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((run.length, *rest)))


def _rows(state: dict, fqn: str, expert_to_slot: tuple[int, ...], offsets: torch.Size) -> Tensor:
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


def _save_planner(slots: Slots | None) -> DefaultSavePlanner:
    return _CanonicalSavePlanner(permuted_keys(slots)) if slots else DefaultSavePlanner()


def _load_planner(slots: Slots | None) -> DefaultLoadPlanner:
    return _CanonicalLoadPlanner(permuted_keys(slots)) if slots else DefaultLoadPlanner()


def read_metadata(directory: Path) -> Metadata:
    try:
        return FileSystemReader(str(directory)).read_metadata()
    except (OSError, RuntimeError, ValueError, EOFError) as err:
        raise CheckpointError(f"{directory}: unreadable sharded checkpoint metadata ({err})") from None


def _flat_shapes(state: dict, prefix: str = "") -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_shapes(value, name + "."))
        elif isinstance(value, Tensor):
            out[name] = tuple(value.shape)  # a DTensor's shape is the global one
    return out


def check_fits(directory: Path, metadata: Metadata, wanted: dict[str, tuple[int, ...]]) -> None:
    """CheckpointError naming the keys and shapes by which the checkpoint differs from ``wanted``."""
    saved = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    missing = sorted(k for k in wanted if k not in saved)
    unexpected = sorted(k for k in saved if k.startswith(MODEL_PREFIX) and k not in wanted)
    shapes = [f"{k} {list(saved[k])} != {list(v)}" for k, v in wanted.items() if k in saved and saved[k] != v]
    problems = [f"{what} {_few(keys)}" for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
    if shapes:
        problems.append(f"shapes (checkpoint != model) {'; '.join(shapes[:3])}")
    if problems:
        raise CheckpointError(f"{directory}: does not fit this model ({', '.join(problems)})")


def _few(keys: list[str]) -> str:
    return f"{keys[:3]}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def saved_world(metadata: Metadata) -> int:
    return int(metadata.state_dict_metadata["rng"].size[0])


def restore(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None,
    whole: nn.Module,
    slots: Slots | None = None,
) -> None:
    """Load weights, optimizer state and this rank's RNG stream from a checkpoint of any layout.

    ``whole``: the full model (the structure every rank keeps), whose names and global shapes the
    checkpoint must match before any rank reads a byte. ``slots``: the live placement of re-placed
    experts, whose canonical rows are read into the slots they occupy.
    """
    metadata = read_metadata(directory)
    check_fits(directory, metadata, _flat_shapes({"model": whole.state_dict()}))
    state = training_state(model, optimizer, group)
    state["rng"] = torch.empty((saved_world(metadata), state["rng"].shape[1]), dtype=torch.uint8)
    try:
        with _dcp_call():
            dcp.load(
                state,
                checkpoint_id=str(directory),
                planner=_load_planner(slots),
                process_group=group,
                no_dist=group is None,
            )
    except FAILURES as err:
        raise CheckpointError(f"{directory}: could not be read ({describe(err)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank = dist.get_rank(group) if group is not None else 0
    _set_rng_row(state["rng"][rank % state["rng"].shape[0]])


def model_groups(metadata: Metadata) -> list[list[str]]:
    """The weight keys (without the ``model.`` prefix) in model order, one group per block: what a
    consolidation holds in memory at a time."""
    keys = [k.removeprefix(MODEL_PREFIX) for k in metadata.state_dict_metadata if k.startswith(MODEL_PREFIX)]
    groups: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split(".")
        head = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        groups.setdefault(head, []).append(key)
    order = sorted(groups, key=lambda h: (h.startswith("blocks"), int(h.split(".")[1]) if "." in h else 0))
    return [groups[h] for h in order]


def read_weights(directory: Path, metadata: Metadata, keys: Iterable[str]) -> dict[str, Tensor]:
    """The full tensors of ``keys`` (model names), read in this process from a checkpoint of any layout."""
    state = {}
    for key in keys:
        meta = metadata.state_dict_metadata[MODEL_PREFIX + key]
        assert isinstance(meta, TensorStorageMetadata)
        state[MODEL_PREFIX + key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    try:
        with _dcp_call():
            dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    except FAILURES as err:
        raise CheckpointError(f"{directory}: could not be read ({describe(err)})") from None
    return {k.removeprefix(MODEL_PREFIX): v for k, v in state.items()}


def load_weights(directory: Path, model: nn.Module) -> None:
    """Load the weights of a sharded checkpoint into a single-process ``model`` (shapes checked first)."""
    metadata = read_metadata(directory)
    wanted = {MODEL_PREFIX + k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_fits(directory, metadata, wanted)
    weights = read_weights(directory, metadata, [k.removeprefix(MODEL_PREFIX) for k in wanted])
    model.load_state_dict(weights)


def nbytes(metadata: Metadata) -> int:
    """Bytes of the tensors in a checkpoint (for the benchmark's throughput)."""
    total = 0
    for meta in metadata.state_dict_metadata.values():
        if isinstance(meta, TensorStorageMetadata):
            total += math.prod(meta.size) * meta.properties.dtype.itemsize
    return total
