"""Run a function on N real processes joined by torch.distributed (gloo on CPU), as torchrun would."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch.multiprocessing as mp

# What the ranks' fork server imports once: torch and the training stack. One server serves a whole
# test session (the first list given starts it), so every test names these same modules.
MOEKIT = ("moekit.train.loop", "moekit.run.load")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, local_world: int, fn, args, errors: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank % local_world),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(local_world),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    except BaseException:
        (errors / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn, world: int, *args, tmp_path: Path, local_world: int | None = None, preload: tuple[str, ...] = ()
) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` spawned ranks; raise with the first rank's traceback.

    ``preload``: modules imported once by a fork server that the ranks are forked from, instead of
    by every rank (importing torch and moekit is most of a small test's time on a loaded machine).
    """
    errors = tmp_path / "rank-errors"
    errors.mkdir(exist_ok=True)
    if preload:
        mp.set_forkserver_preload(list(preload))
    try:
        mp.start_processes(
            _entry,
            args=(world, free_port(), local_world or world, fn, args, errors),
            nprocs=world,
            start_method="forkserver" if preload else "spawn",
        )
    except mp.ProcessRaisedException as err:
        first = sorted(errors.glob("rank*.txt"))
        raise AssertionError(first[0].read_text() if first else str(err)) from None
