"""A run's training state as a sharded checkpoint (``torch.distributed.checkpoint``, DCP).

Every rank writes the pieces it holds (expert shards, FSDP shards, tensor-parallel slices) under
canonical parameter names with their global shapes, so any other layout reads back exactly the
pieces it needs: a checkpoint saved at dp=2 x ep=2 loads at ep=4, pp=2 or in one process. The state
is ``{"model": ..., "optim": ..., "rng": [world, n] uint8}`` (the RNG states of every rank, so a
resume at the same world size continues each rank's stream; at another size rank r takes the
saved rank ``r % saved_world``'s).

Re-placed experts are written and read in canonical order, and offloaded training's expert state is
streamed from and to files of its own, by the planners of ``planners.py``; either way the files are
those of an in-memory model at the canonical placement.

Publication (temporary directory, manifest, atomic rename, ``latest``) is ``checkpoint.py``'s; this
module only reads and writes the ``sharded/`` directory inside a checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moekit.run.layout import CheckpointError
from moekit.run.planners import MODEL_PREFIX, Slots, Streamed, load_planner, save_planner

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
    built from what every rank reports it wrote, not from one rank's view of the directory.

    ``serial``: tensors are resolved one at a time, each as it is written (no copying ahead), as a
    streamed save needs."""

    def __init__(self, path: Path, serial: bool = False) -> None:
        super().__init__(str(path), **({"per_thread_copy_ahead": 0} if serial else {}))
        self.written: set[str] = set()

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        self.written.update(result.storage_data.relative_path for result in done.wait())
        return done

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written.add(METADATA)


def save(
    state: dict,
    writer: RecordingWriter,
    group: dist.ProcessGroup | None,
    slots: Slots | None = None,
    streamed: Streamed | None = None,
) -> None:
    """Write ``state`` through ``writer`` (``slots``: expert rows to write in canonical order;
    ``streamed``: keys read as the writer reaches them, through a ``serial`` writer)."""
    planner = save_planner(slots, streamed)
    assert streamed is None or (
        writer.per_thread_copy_ahead == 0
        and writer.thread_count == 1
        and writer.serialization_format is SerializationFormat.TORCH_SAVE
    ), "a serial writer that writes each tensor as it is given (torch.save)"
    with _dcp_call():
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=group is None)


def save_async(
    state: dict, writer: RecordingWriter, group: dist.ProcessGroup | None, slots: Slots | None = None
) -> Future:
    """Copy the state to CPU staging memory now; write it on a background thread (the returned future)."""
    with _dcp_call():
        return dcp.async_save(
            state, storage_writer=writer, planner=save_planner(slots), process_group=group, no_dist=group is None
        )


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
    streamed: Streamed | None = None,
) -> None:
    """Load weights, optimizer state and this rank's RNG stream from a checkpoint of any layout.

    ``whole``: the full model (the structure every rank keeps), whose names and global shapes the
    checkpoint must match before any rank reads a byte. ``slots``: the live placement of re-placed
    experts, whose canonical rows are read into the slots they occupy. ``streamed``: keys left to
    their owner, which reads them last.
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
                planner=load_planner(slots, streamed),
                process_group=group,
                no_dist=group is None,
            )
        if streamed is not None:
            streamed.load(directory)
    except FAILURES as err:
        raise CheckpointError(f"{directory}: could not be read ({describe(err)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank = dist.get_rank(group) if group is not None else 0
    _set_rng_row(state["rng"][rank % state["rng"].shape[0]])


def read_tensors(directory: Path, state: dict[str, Tensor]) -> None:
    """Fill ``state``'s tensors (flattened keys; a DTensor takes its own piece) from a checkpoint of any
    layout, in this process alone."""
    with _dcp_call():
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)


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
        read_tensors(directory, state)
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
