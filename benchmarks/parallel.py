"""Expert-parallel training steps on real ranks: step time and bytes moved per collective type.

    python benchmarks/parallel.py [--json] [--steps 8] [--ranks 1,2,4]

For 1, 2 and 4 ranks (EP = ranks; the rest of the model data-parallel with FSDP2), with the flat
all-to-all, the two-level one (nodes of 2 ranks) and the chunked overlap (2 chunks) on or off, each
configuration trains the same small MoE model on random tokens. Every rank counts the bytes it sends
through each torch.distributed collective (a counting wrapper around the functions the code calls);
the table shows rank 0's median step time and the bytes per step summed over ranks, and the bytes
the all-to-all moves per token per MoE layer (dispatch + combine, forward + backward) — the figure the
planner's cost model uses. gloo on CPU; NCCL on a GPU machine (``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.model import Transformer  # noqa: E402
from moekit.parallel.runtime import ParallelModel, init_distributed  # noqa: E402
from moekit.train.optim import build_optimizer  # noqa: E402

MODEL = {
    "model.n_layers": "4",
    "model.n_heads": "4",
    "model.d_model": "128",
    "model.d_ff": "256",
    "model.context_length": "64",
    "model.vocab_size": "256",
    "moe.num_experts": "8",
    "moe.top_k": "2",
    "train.batch_size": "8",
}
COUNTED = ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather")


def _count_bytes(sent: dict[str, int]) -> None:
    """Wrap the collectives so each call adds the bytes this rank sends."""

    def wrap(name, fn):
        def counted(*args, **kwargs):
            # the input tensor: second argument (after the output or output list), first for all_reduce
            given = [*args, *kwargs.values()]
            tensor = given[0] if name == "all_reduce" else given[1]
            sent[name] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    for name in COUNTED:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _worker(rank: int, world: int, overrides: dict, steps: int, device: str) -> dict | None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    sent: dict[str, int] = defaultdict(int)
    _count_bytes(sent)
    cfg = runconfig.resolve("tiny", {**MODEL, **overrides})
    dev = torch.device(device)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).to(dev)
    layout, mesh = init_distributed(cfg, dev)
    pm = ParallelModel(model, cfg, dev, layout, mesh)
    opt = build_optimizer(pm.parameters(), cfg.train)
    g = torch.Generator().manual_seed(rank)
    times, counted = [], []
    for step in range(steps + 2):
        tokens = torch.randint(0, 256, (cfg.train.batch_size, cfg.model.context_length + 1), generator=g).to(dev)
        before = dict(sent)
        if mesh is not None:
            dist.barrier()
        started = time.perf_counter()
        pm.forward_backward(tokens[:, :-1], tokens[:, 1:], 1.0)
        pm.finish_gradients()
        pm.clip_gradients(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 2:  # two warm-up steps
            times.append(time.perf_counter() - started)
            counted.append({k: v - before.get(k, 0) for k, v in sent.items()})
    per_step = {k: statistics.median(c.get(k, 0) for c in counted) for k in COUNTED}
    totals = [per_step]
    if mesh is not None:
        totals = [None] * world
        dist.all_gather_object(totals, per_step)
    if rank != 0:
        return None
    summed = {k: sum(t[k] for t in totals) for k in COUNTED}
    tokens_per_step = cfg.train.batch_size * cfg.model.context_length * world
    a2a_per_token_layer = summed["all_to_all_single"] / tokens_per_step / cfg.model.n_layers
    return {
        "step_ms": statistics.median(times) * 1e3,
        "bytes": summed,
        "a2a_bytes_per_token_layer": a2a_per_token_layer,
    }


def run(world: int, overrides: dict, steps: int, device: str) -> dict:
    return run_ranks(_worker, world, overrides, steps, device)


def configurations(ranks: list[int]) -> list[tuple[str, int, dict]]:
    configs = []
    for world in ranks:
        if world == 1:
            configs.append(("1 rank (no EP)", 1, {}))
            continue
        ep = {"parallel.ep": str(world)}
        configs.append((f"EP={world} flat", world, ep))
        configs.append((f"EP={world} flat, overlap", world, {**ep, "parallel.overlap_chunks": "2"}))
        if world >= 4:
            two = {**ep, "parallel.all_to_all": "two_level", "parallel.node_size": "2"}
            configs.append((f"EP={world} two-level", world, two))
            configs.append((f"EP={world} two-level, overlap", world, {**two, "parallel.overlap_chunks": "2"}))
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    results = {}
    for name, world, overrides in configurations(ranks):
        print(f"# {name}", file=sys.stderr, flush=True)
        results[name] = {"ranks": world, **run(world, overrides, args.steps, args.device)}

    header = (
        f"{'configuration':<30}{'step ms':>10}{'a2a MB':>10}{'ag MB':>9}{'rs MB':>9}{'ar MB':>9}{'a2a B/tok/layer':>17}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        b = r["bytes"]
        mb = [b[k] / 1e6 for k in ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce")]
        print(
            f"{name:<30}{r['step_ms']:>10.1f}{mb[0]:>10.2f}{mb[1]:>9.2f}{mb[2]:>9.2f}{mb[3]:>9.2f}"
            f"{r['a2a_bytes_per_token_layer']:>17.0f}"
        )
    print(f"(bytes per step summed over ranks; model: {MODEL})")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
