"""Expert-parallel training steps on real ranks: step time and bytes per collective type.

    python benchmarks/parallel.py [--json] [--steps 8] [--runs 3] [--ranks 1,2,4]

For 1, 2 and 4 ranks (EP = ranks; the rest of the model data-parallel with FSDP2), with the flat
all-to-all, the two-level one (nodes of 2 ranks) and the chunked overlap (2 chunks) on or off, each
configuration trains the same small MoE model on random tokens. Each of ``--runs`` rounds runs every
configuration (those of one world size in one set of processes, in an order rotated per round), so
a busy machine slows them alike. Every rank counts what it hands each torch.distributed collective
(a counting wrapper around the functions the code calls) and how much of it crosses to other ranks:
for an all-to-all, all but the split a rank sends to itself; for the ring collectives, what a ring
sends per rank (all-gather (W-1) x input, reduce-scatter (W-1)/W x input, all-reduce 2 (W-1)/W x
input). The table shows rank 0's step time (median over runs of each run's median, min-max over
runs), the cross-rank bytes per step summed over ranks, and the all-to-all's bytes per token per MoE
layer (dispatch + combine, forward + backward), crossing and self-sent apart: the planner's cost
model charges only the crossing part. gloo on CPU; NCCL on a GPU machine (``--device cuda``).
"""

from __future__ import annotations

import argparse
import inspect
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


def _crossing(name: str, call: inspect.BoundArguments, nbytes: int) -> int:
    """The bytes of one call that leave this rank (see the module docstring)."""
    group = call.arguments.get("group")
    W = dist.get_world_size(group)
    if name == "all_to_all_single":
        splits, rows = call.arguments.get("input_split_sizes"), call.arguments["input"].shape[0]
        own = splits[dist.get_rank(group)] / rows if splits else 1 / W  # the split for this rank itself
        return round(nbytes * (1 - own)) if nbytes else 0
    if name in ("all_gather_single", "all_gather"):
        return nbytes * (W - 1)
    return nbytes * (W - 1) // W * (2 if name == "all_reduce" else 1)


def _count_bytes(given: dict[str, int], crossing: dict[str, int]) -> None:
    """Wrap the collectives so each call adds the bytes this rank hands in and those leaving it."""

    def wrap(name, fn):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            call = signature.bind(*args, **kwargs)
            # the input tensor: the second parameter (after the output or output list), all_reduce's only one
            tensor = call.arguments[list(signature.parameters)[0 if name == "all_reduce" else 1]]
            nbytes = tensor.numel() * tensor.element_size()
            given[name] += nbytes
            crossing[name] += _crossing(name, call, nbytes)
            return fn(*args, **kwargs)

        return counted

    for name in COUNTED:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _worker(rank: int, world: int, configs: list[tuple[str, dict]], steps: int, device: str) -> dict:
    """Every configuration of this world size in turn, in one process group; rank 0's figures by name."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    given: dict[str, int] = defaultdict(int)
    crossing: dict[str, int] = defaultdict(int)
    _count_bytes(given, crossing)
    return {name: _train(rank, world, overrides, steps, device, given, crossing) for name, overrides in configs}


def _train(rank: int, world: int, overrides: dict, steps: int, device: str, given: dict, crossing: dict) -> dict | None:
    """Train one configuration for ``steps`` timed steps; its step time and bytes per step (rank 0)."""
    cfg = runconfig.resolve("tiny", {**MODEL, **overrides})
    dev = torch.device(device)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).to(dev)
    layout, mesh = init_distributed(cfg, dev)
    pm = ParallelModel(model, cfg, dev, layout, mesh)
    opt = build_optimizer(pm.named_parameters(), cfg.train)
    g = torch.Generator().manual_seed(rank)
    times, counted = [], []
    for step in range(steps + 2):
        tokens = torch.randint(0, 256, (cfg.train.batch_size, cfg.model.context_length + 1), generator=g).to(dev)
        before = {"given": dict(given), "crossing": dict(crossing)}
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
            now = {"given": given, "crossing": crossing}
            counted.append({(kind, k): v - before[kind].get(k, 0) for kind, d in now.items() for k, v in d.items()})
    per_step = {key: statistics.median(c.get(key, 0) for c in counted) for key in counted[0]} if counted else {}
    totals = [per_step]
    if mesh is not None:
        totals = [None] * world
        dist.all_gather_object(totals, per_step)
    if rank != 0:
        return None
    summed = {kind: {k: sum(t.get((kind, k), 0) for t in totals) for k in COUNTED} for kind in ("given", "crossing")}
    token_layers = cfg.train.batch_size * cfg.model.context_length * world * len(cfg.model.moe_layers())
    a2a_given, a2a_crossing = (summed[kind]["all_to_all_single"] for kind in ("given", "crossing"))
    return {
        "step_ms": statistics.median(times) * 1e3,
        "bytes_crossing": summed["crossing"],
        "bytes_given": summed["given"],
        "a2a_crossing_per_token_layer": a2a_crossing / token_layers,
        "a2a_self_per_token_layer": (a2a_given - a2a_crossing) / token_layers,
    }


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
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    results: dict[str, dict] = {}
    for run in range(args.runs):  # interleaved: every configuration once per round, in a rotated order
        for world in ranks:
            configs = [(name, overrides) for name, w, overrides in configurations(ranks) if w == world]
            configs = configs[run % len(configs) :] + configs[: run % len(configs)]
            print(f"# run {run}: {world} ranks", file=sys.stderr, flush=True)
            for name, out in run_ranks(_worker, world, configs, args.steps, args.device).items():
                step_ms = out.pop("step_ms")
                entry = results.setdefault(name, {"ranks": world, **out, "step_ms_runs": []})
                entry["step_ms_runs"].append(step_ms)

    kinds = ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce")
    header = (
        f"{'configuration':<30}{'step ms (min-max)':>22}{'a2a MB':>9}{'ag MB':>8}{'rs MB':>8}{'ar MB':>8}"
        f"{'a2a B/tok/layer: cross':>24}{'self':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        ms = r["step_ms_runs"]
        mb = "".join(f"{r['bytes_crossing'][k] / 1e6:>{9 if k == kinds[0] else 8}.2f}" for k in kinds)
        print(
            f"{name:<30}{f'{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})':>22}{mb}"
            f"{r['a2a_crossing_per_token_layer']:>24.0f}{r['a2a_self_per_token_layer']:>6.0f}"
        )
    print(
        f"(step ms: median over {args.runs} interleaved runs of each run's median of {args.steps} steps; MB per step "
        f"crossing ranks, summed over ranks; model: {MODEL})"
    )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
