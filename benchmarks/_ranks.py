"""Run a function on N gloo ranks in spawned processes and collect rank 0's return value."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, fn, args, out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        result = fn(rank, world, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args):
    """``fn(rank, world, *args)`` on ``world`` ranks; returns what rank 0 returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pt"
        mp.start_processes(_entry, args=(world, port, fn, args, out), nprocs=world, start_method="spawn")
        return torch.load(out, weights_only=False)


def training_rank(cfg, rank: int):
    """This rank's ``(ParallelModel, optimizer, corpus)`` for ``cfg`` on CPU, built as ``moekit train``
    builds them (same seed), for benchmarks that drive ``train_step`` themselves."""
    from moekit.model import Transformer
    from moekit.parallel.runtime import ParallelModel, init_distributed
    from moekit.train import loop
    from moekit.train.optim import build_optimizer

    cpu = torch.device("cpu")
    layout, mesh = init_distributed(cfg, cpu)
    corpus = loop._prepare_corpus_once(cfg, rank == 0, True, None)
    torch.manual_seed(cfg.train.seed)
    pm = ParallelModel(Transformer(cfg.model, cfg.moe), cfg, cpu, layout, mesh)
    return pm, build_optimizer(pm.named_parameters(), cfg.train), corpus
