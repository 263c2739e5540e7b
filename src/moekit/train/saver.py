"""Checkpoints written and read by every rank of a run together.

Saving: rank 0 empties a staging directory; every rank writes its shards into it through DCP (on a
background thread with ``train.async_checkpoint``, so training goes on while the files are written);
each rank then hashes its share of the files, rank 0 gathers the digests into the manifest and
publishes the checkpoint (rename, then ``latest``). A save that has not finished on every rank is
never published. Reading: every rank checks its share of the newest checkpoint's checksums, all
agree on one verified checkpoint (the newest, or with ``fallback`` the newest intact one), then
each loads the pieces its layout needs.

Collectives run on a gloo group of their own (the DCP writer thread uses it) and polling for a
finished background save on another, so neither can interleave with training's collectives.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moekit.train import sharded
from moekit.train.checkpoint import (
    LATEST,
    MODEL_FILE,
    SHARDED,
    CheckpointError,
    begin_checkpoint,
    checkpoint_dir,
    checkpoint_files,
    complete_checkpoints,
    digests,
    load_manifest,
    publish_checkpoint,
    read_manifest,
    save_failed,
)
from moekit.train.consolidate import consolidate


class _Pending:
    """A save whose files are being written and hashed on a background thread."""

    def __init__(self, step: int, tmp: Path, info: dict[str, Any], hashed: Future) -> None:
        self.step, self.tmp, self.info, self.hashed = step, tmp, info, hashed


class Checkpointer:
    """The run's checkpoints, as seen from one rank (every rank makes the same calls)."""

    def __init__(self, run_dir: Path, keep: int, background: bool) -> None:
        self.run_dir, self.keep, self.background = Path(run_dir), keep, background
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.control = dist.new_group(backend="gloo") if distributed and background else self.group
        self.pending: _Pending | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="moekit-checkpoint") if background else None

    # --- saving ------------------------------------------------------------------------------------

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, info: dict[str, Any]) -> Path | None:
        """Checkpoint the state as it is now. Returns the published checkpoint on rank 0 (None while a
        background save is still being written, and on the other ranks)."""
        published = self.wait()
        try:
            tmp = self._begin(step)
            state = sharded.training_state(model, optimizer, self.group)
            if self._thread is None:
                sharded.save(state, tmp / SHARDED, self.group)
                return self._publish(step, tmp, info, self._finish_files(tmp)) or published
            upload = sharded.save_async(state, tmp / SHARDED, self.group)
        except CheckpointError:
            raise
        except sharded.FAILURES as err:  # DCP reports a failed write on every rank as one exception
            raise save_failed(self.run_dir, step, RuntimeError(sharded.describe(err))) from None
        self.pending = _Pending(step, tmp, info, self._thread.submit(self._after, upload, tmp))
        return published

    def poll(self) -> Path | None:
        """Publish a background save if every rank has finished writing it (one tiny all-reduce)."""
        if self.pending is None:
            return None
        done = torch.tensor(float(self.pending.hashed.done()))
        if self.control is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.control)
        return self.wait() if done.item() else None

    def wait(self) -> Path | None:
        """Block until the background save (if any) is written, then publish it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            files = pending.hashed.result()
        except sharded.FAILURES as err:
            files = err
        return self._publish(pending.step, pending.tmp, pending.info, files)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Stop the writer thread; after an error an unfinished save is abandoned (never published)."""
        if self._thread is not None:
            self._thread.shutdown(wait=exc_type is None, cancel_futures=True)

    def _begin(self, step: int) -> Path:
        tmp = begin_checkpoint(self.run_dir, step) if self.rank == 0 else None
        if self.group is not None:
            dist.barrier(group=self.group)
        return tmp or checkpoint_dir(self.run_dir) / f".tmp-step_{step:06d}"

    def _after(self, upload: Future, tmp: Path) -> dict[str, str]:
        upload.result()
        return self._finish_files(tmp)

    def _finish_files(self, tmp: Path) -> dict[str, str]:
        """This rank's digests (one process also consolidates the weights for inference first)."""
        if self.world == 1:
            consolidate(tmp / SHARDED, tmp / MODEL_FILE)
        return digests(tmp, checkpoint_files(tmp)[self.rank :: self.world])

    def _publish(
        self, step: int, tmp: Path, info: dict[str, Any], files: dict[str, str] | BaseException
    ) -> Path | None:
        """Gather every rank's digests (or failure) on rank 0, which publishes or reports."""
        every: list[Any] = [_portable(files)]
        if self.control is not None:
            every = [None] * self.world
            dist.all_gather_object(every, _portable(files), group=self.control)
        failures = [f for f in every if not isinstance(f, dict)]
        if failures:
            raise save_failed(self.run_dir, step, RuntimeError(failures[0]))
        if self.rank != 0:
            return None
        merged = {name: digest for part in every for name, digest in part.items()}
        try:
            return publish_checkpoint(self.run_dir, tmp, step, merged, info, self.keep)
        except OSError as err:
            raise save_failed(self.run_dir, step, err) from None

    # --- reading -----------------------------------------------------------------------------------

    def choose(self, fallback: bool, say: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Path:
        """The checkpoint to resume from, checksums verified by all ranks together.

        The newest (``latest``); with ``fallback``, when it is missing or corrupt, the newest intact one.
        """
        candidates = complete_checkpoints(self.run_dir)
        pointer = checkpoint_dir(self.run_dir) / LATEST
        named = checkpoint_dir(self.run_dir) / pointer.read_text().strip() if pointer.is_file() else None
        if named is not None and named not in candidates:
            problem = f"{pointer} names {named.name}, which is missing or incomplete"
            if not fallback:
                raise CheckpointError(problem + " (pass --fallback to resume from the newest intact checkpoint)")
            say(f"moekit: {problem}; falling back")
        elif named is not None:
            candidates = [named] + [c for c in candidates if c != named]
        for path in candidates:
            problem = self._verify(path)
            if problem is None:
                return path
            if not fallback:
                raise CheckpointError(problem + " (pass --fallback to resume from the previous complete checkpoint)")
            say(f"moekit: {problem}; falling back")
        raise CheckpointError(f"{checkpoint_dir(self.run_dir)}: no intact checkpoint to resume from")

    def _verify(self, path: Path) -> str | None:
        try:
            read_manifest(path, (self.rank, self.world))
            problem = None
        except CheckpointError as err:
            problem = str(err)
        problems = [problem]
        if self.control is not None:
            problems = [None] * self.world
            dist.all_gather_object(problems, problem, group=self.control)
        return next((p for p in problems if p), None)

    def restore(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, whole: nn.Module) -> dict:
        """Load a verified checkpoint into this rank's model and optimizer; return its manifest."""
        manifest = load_manifest(path)
        if not (path / SHARDED).is_dir():
            raise CheckpointError(
                f"{path}: holds weights only (a converted, upcycled or exported model): start from it with --init"
            )
        sharded.restore(path / SHARDED, model, optimizer, self.group, whole)
        return manifest


def _portable(files: dict[str, str] | BaseException) -> dict[str, str] | str:
    """What a rank sends rank 0: its digests, or its error as text (exceptions may not pickle)."""
    return files if isinstance(files, dict) else sharded.describe(files)
