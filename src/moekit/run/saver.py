"""Checkpoints written and read by every rank of a run together.

Saving: rank 0 removes what crashed saves left (once, before the first save) and empties a staging
directory; every rank writes its shards into it through DCP (on a background thread with
``train.async_checkpoint``, so training goes on while the files are written); each rank then hashes
the files it wrote itself, rank 0 gathers every rank's (name, size, SHA-256) into the manifest, checks
it sees every file, and publishes the checkpoint (rename, then ``latest``). A save that has not
finished on every rank is never published. Every rank must see the checkpoint directory at the same
path (one shared filesystem across nodes): a file rank 0 cannot see fails the save, naming its writer.

Reading: every rank checks its share of the newest checkpoint's checksums, all
agree on one verified checkpoint (the newest, or with ``fallback`` the newest intact one), then
each loads the pieces its layout needs.

Collectives run on a gloo group of their own (the DCP writer thread uses it) and polling for a
finished background save on another, so neither can interleave with training's collectives.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moekit.errors import OptionError
from moekit.run import sharded
from moekit.run.checkpoint import begin_checkpoint, publish_checkpoint, remove_stale, save_failed
from moekit.run.consolidate import consolidate
from moekit.run.layout import (
    LATEST,
    MODEL_FILE,
    SHARDED,
    CheckpointError,
    checkpoint_dir,
    complete_checkpoints,
    staging_dir,
)
from moekit.run.manifest import Digests, digests, load_manifest, read_manifest


class _Pending:
    """A save whose files are being written and hashed on a background thread."""

    def __init__(self, step: int, tmp: Path, info: dict[str, Any], hashed: Future) -> None:
        self.step, self.tmp, self.info, self.hashed = step, tmp, info, hashed


class Checkpointer:
    """The run's checkpoints, as seen from one rank (every rank makes the same calls)."""

    def __init__(self, run_dir: Path, keep: int, background: bool, timeout_s: float = 300.0) -> None:
        self.run_dir, self.keep, self.background = Path(run_dir), keep, background
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        # Own groups (a background save must not interleave with training's collectives), failing after
        # parallel.timeout_s like the mesh's rather than torch's 30-minute default.
        timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        self.control = dist.new_group(backend="gloo", timeout=timeout) if distributed and background else self.group
        self.pending: _Pending | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="moekit-checkpoint") if background else None
        if self.rank == 0:
            remove_stale(self.run_dir)  # no save of this run has begun: only crashed ones' leftovers

    # --- saving ------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        info: dict[str, Any],
        slots: sharded.Slots | None = None,
        streamed: sharded.Streamed | None = None,
    ) -> Path | None:
        """Checkpoint the state as it is now. Returns the published checkpoint on rank 0 (None while a
        background save is still being written, and on the other ranks).

        ``slots``: the live placement of re-placed experts (``ParallelModel.expert_slots``); their rows
        are written in canonical order and the model is left as it is. ``streamed``: state held outside
        the model (offloaded experts), read as it is written; never in the background.
        """
        published = self.wait()
        try:
            tmp = self._begin(step)
            state = sharded.training_state(model, optimizer, self.group)
            writer = sharded.RecordingWriter(tmp / SHARDED, serial=streamed is not None)
            if self._thread is None or streamed is not None:
                sharded.save(state, writer, self.group, slots, streamed)
                return self._publish(step, tmp, info, self._finish_files(tmp, writer)) or published
            upload = sharded.save_async(state, writer, self.group, slots)
        except CheckpointError:
            raise
        except sharded.FAILURES as err:  # DCP reports a failed write on every rank as one exception
            raise save_failed(self.run_dir, step, RuntimeError(sharded.describe(err))) from None
        self.pending = _Pending(step, tmp, info, self._thread.submit(self._after, upload, tmp, writer))
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
        return tmp or staging_dir(self.run_dir, step)

    def _after(self, upload: Future, tmp: Path, writer: sharded.RecordingWriter) -> Digests:
        upload.result()
        return self._finish_files(tmp, writer)

    def _finish_files(self, tmp: Path, writer: sharded.RecordingWriter) -> Digests:
        """Size and SHA-256 of the files this rank wrote (one process also consolidates the weights for
        inference first)."""
        names = [f"{SHARDED}/{name}" for name in sorted(writer.written)]
        if self.world == 1:
            consolidate(tmp / SHARDED, tmp / MODEL_FILE)
            names.append(MODEL_FILE)
        return digests(tmp, names)

    def _publish(self, step: int, tmp: Path, info: dict[str, Any], files: Digests | BaseException) -> Path | None:
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
        try:
            unseen = _unseen(tmp, every)
            if unseen:
                raise CheckpointError(unseen)
            merged = {name: digest for part in every for name, digest in part.items()}
            return publish_checkpoint(self.run_dir, tmp, step, merged, info, self.keep)
        except (OSError, CheckpointError) as err:
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
                reason = problem + " (pass {fallback} to resume from the newest intact checkpoint)"
                raise OptionError("resume", reason, True, fallback=True)
            say(f"moekit: {problem}; falling back")
        elif named is not None:
            candidates = [named] + [c for c in candidates if c != named]
        for path in candidates:
            problem = self._verify(path)
            if problem is None:
                return path
            if not fallback:
                reason = problem + " (pass {fallback} to resume from the previous complete checkpoint)"
                raise OptionError("resume", reason, True, fallback=True)
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

    def restore(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        whole: nn.Module,
        slots: sharded.Slots | None = None,
        streamed: sharded.Streamed | None = None,
    ) -> dict:
        """Load a verified checkpoint into this rank's model and optimizer; return its manifest.

        ``slots``: the live placement of re-placed experts (each expert is read into its slot);
        ``streamed``: state held outside the model (offloaded experts), which reads its keys itself."""
        manifest = load_manifest(path)
        if not (path / SHARDED).is_dir():
            reason = (
                str(path) + " holds weights only (a converted, upcycled or exported model): start from it with {init}"
            )
            raise OptionError("resume", reason, True, init=self.run_dir)
        sharded.restore(path / SHARDED, model, optimizer, self.group, whole, slots, streamed)
        return manifest


def _portable(files: Digests | BaseException) -> Digests | str:
    """What a rank sends rank 0: its digests, or its error as text (exceptions may not pickle)."""
    return files if isinstance(files, dict) else sharded.describe(files)


def _unseen(tmp: Path, every: list[Digests]) -> str | None:
    """A message naming the files other ranks wrote that this process (rank 0) cannot see whole, or None.

    A checkpoint directory local to each node, or a shared one that has not caught up, would otherwise
    publish a checkpoint that no single node can read."""
    problems = []
    for rank, part in enumerate(every):
        for name, (size, _) in sorted(part.items()):
            path = tmp / name
            seen = path.stat().st_size if path.is_file() else None
            if seen != size:
                got = "missing" if seen is None else f"{seen} bytes"
                problems.append(f"{name} (written by rank {rank}: {size} bytes; here: {got})")
    if not problems:
        return None
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return (
        "the checkpoint directory must be one filesystem shared by every node, at the same path: rank 0 does "
        f"not see the files other ranks wrote: {', '.join(problems[:3])}{more}"
    )
