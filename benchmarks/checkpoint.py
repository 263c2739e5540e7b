"""Checkpoint cost of the ``default`` preset at 1, 2 and 4 ranks (gloo on CPU; experts spread over ep = ranks).

    python benchmarks/checkpoint.py [--json] [--ranks 1 2 4] [--steps 6]

For each world size: the time to save a checkpoint synchronously (DCP shards, per-rank checksums,
manifest, publication), the time a background save blocks training (staging copies) and the time
until it is published, the time to load it back, and the training time lost to a background save:
the steps run while it is being written, against the same steps without one. Prints a table; with
``--json`` one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks  # noqa: E402


def _rank(rank: int, world: int, steps: int, root: str) -> dict[str, float] | None:
    import torch.distributed as dist

    from moekit import runconfig
    from moekit.model import Transformer
    from moekit.parallel.runtime import ParallelModel, init_distributed
    from moekit.run.saver import Checkpointer
    from moekit.run.sharded import local_model
    from moekit.train.optim import build_optimizer

    cfg = runconfig.resolve("default", {"parallel.ep": str(world), "model.vocab_size": "256"})
    dev = torch.device("cpu")
    layout, mesh = init_distributed(cfg, dev)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    pm = ParallelModel(model, cfg, dev, layout, mesh)
    local = local_model(pm.modules)
    optimizer = build_optimizer(pm.named_parameters(), cfg.train)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (cfg.train.batch_size, cfg.model.context_length + 1), generator=g)

    def step() -> float:
        started = time.perf_counter()
        pm.forward_backward(x[:, :-1], x[:, 1:], 1.0)
        pm.finish_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    step()  # optimizer state exists, as in a real checkpoint
    out: dict[str, float] = {}
    sync = Checkpointer(Path(root) / "sync", keep=1, background=False)
    barrier()
    started = time.perf_counter()
    path = sync.save(1, local, optimizer, {})
    barrier()
    out["save_s"] = time.perf_counter() - started
    if rank == 0:
        out["bytes"] = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    baseline = [step() for _ in range(steps)]

    background = Checkpointer(Path(root) / "async", keep=1, background=True)
    with background:
        barrier()
        started = time.perf_counter()
        background.save(1, local, optimizer, {})
        out["async_block_s"] = time.perf_counter() - started
        during = []
        while background.pending is not None and len(during) < 10 * steps:
            during.append(step())
            background.poll()
        background.wait()
        out["async_total_s"] = time.perf_counter() - started
        out["steps_during"] = len(during)
        out["lost_s"] = out["async_block_s"] + sum(during) - len(during) * sum(baseline) / len(baseline)
        out["step_s"] = sum(baseline) / len(baseline)

    barrier()
    started = time.perf_counter()
    sync.restore(sync.choose(fallback=False, say=lambda m: None), local, optimizer, model)
    barrier()
    out["load_s"] = time.perf_counter() - started
    return out if rank == 0 else None


def measure(world: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        return {"ranks": world, **run_ranks(_rank, world, steps, root)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=6, help="baseline training steps per measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(world, args.steps) for world in args.ranks]
    head = f"{'ranks':>5} {'MB':>6} {'save s':>7} {'load s':>7} {'async blocks s':>14} {'async done s':>12}"
    print(head + f" {'step s':>7} {'steps during':>12} {'lost s':>7}")
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['bytes'] / 1e6:>6.1f} {r['save_s']:>7.3f} {r['load_s']:>7.3f} "
            f"{r['async_block_s']:>14.3f} {r['async_total_s']:>12.3f} {r['step_s']:>7.3f} "
            f"{r['steps_during']:>12d} {r['lost_s']:>7.3f}"
        )
    if args.json:
        json.dump({"device": "cpu/gloo", "preset": "default", "rows": rows}, sys.stdout)
        print()


if __name__ == "__main__":
    main()
