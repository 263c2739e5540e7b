"""Deduplicated expert-parallel dispatch: all-to-all bytes per layer forward and the layer's step time.

    python benchmarks/ep_dedup.py [--json] [--ranks 4] [--tokens 1024] [--block 5] [--rounds 3]

One MoE layer on ``--ranks`` gloo ranks (ep = ranks, flat all-to-all), each rank with its own
random tokens, for: per-expert dispatch (one row per (token, expert) pair) with plain top-k and
with group-limited routing, and the deduplicated dispatch (``parallel.dispatch_dedup``: one row per
(token, rank) pair, plus its expert ids and gate weights) without groups and with
``n_group = ranks``, ``topk_group`` in {1, 2}. Bytes are counted at
``torch.distributed.all_to_all_single`` during one forward (dispatch, its ids, combine), summed
over ranks: all handed in, and the part crossing to other ranks. Step time is forward + backward
of the layer on rank 0, timed in blocks of ``--block`` steps that take turns over ``--rounds``
rounds (``_spread.alternate_blocks``): median (min-max) over rounds.

NOTE: the router is untrained and the tokens random, so routing is near uniform. Without group
limits how many ranks a token reaches depends on where its experts sit, which a trained router
may change; with ``topk_group`` the bound (at most that many ranks per token) holds for any router.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks  # noqa: E402
from _spread import alternate_blocks, spread  # noqa: E402

from moekit.config import MoEConfig, ParallelConfig  # noqa: E402
from moekit.layer import MoE  # noqa: E402
from moekit.parallel.ep import ep_groups, shard_moe  # noqa: E402
from moekit.parallel.mesh import Layout, build_mesh  # noqa: E402

LAYER = {"d_model": 256, "d_ff": 512, "num_experts": 16, "top_k": 4}


def configurations(ranks: int) -> dict[str, tuple[dict, bool]]:
    """Name -> (MoEConfig fields beyond LAYER, deduplicated dispatch)."""
    groups = {k: {"n_group": ranks, "topk_group": k} for k in (1, 2)}
    return {
        "per-expert, top-k": ({}, False),
        "per-expert, groups 1": (groups[1], False),
        "dedup, top-k": ({}, True),
        f"dedup, groups {ranks}/2": (groups[2], True),
        f"dedup, groups {ranks}/1": (groups[1], True),
    }


def _forward_bytes(moe: MoE, x: torch.Tensor) -> dict[str, int]:
    """Rows and bytes this rank hands ``all_to_all_single`` in one forward, and those leaving it."""
    real = dist.all_to_all_single
    seen = {"given": 0, "crossing": 0, "rows": 0}

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        nbytes = input.numel() * input.element_size()
        own = input_split_sizes[dist.get_rank(group)] if input_split_sizes else 0
        seen["given"] += nbytes
        seen["crossing"] += nbytes - own * nbytes // max(input.shape[0], 1)
        seen["rows"] += input.shape[0] if input.is_floating_point() else 0
        return real(output, input, output_split_sizes, input_split_sizes, group, **kwargs)

    dist.all_to_all_single = counted
    try:
        with torch.no_grad():
            moe(x)
    finally:
        dist.all_to_all_single = real
    return seen


def _worker(rank: int, world: int, tokens: int, block: int, rounds: int) -> dict:
    """Every configuration on these ranks; rank 0's times, and bytes summed over ranks."""
    dist.init_process_group("gloo")
    layout = Layout(dp=1, ep=world, tp=1, pp=1, node_size=world)
    mesh = build_mesh(layout, "cpu", timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, LAYER["d_model"], generator=g)
    grad = torch.randn(tokens, LAYER["d_model"], generator=g)
    layers, counted = {}, {}
    for name, (fields, dedup) in configurations(world).items():
        torch.manual_seed(0)
        moe = MoE(MoEConfig(**LAYER, **fields))
        cfg = ParallelConfig(ep=world, dispatch_dedup=dedup)
        shard_moe(moe, mesh, ep_groups(mesh, layout, cfg), cfg)
        layers[name] = moe
        mine = torch.tensor(list(_forward_bytes(moe, x).values()))
        dist.all_reduce(mine)
        counted[name] = dict(zip(("given", "crossing", "rows"), mine.tolist(), strict=True))

    def step(moe: MoE):
        def run() -> None:
            xr = x.clone().requires_grad_()
            (moe(xr) * grad).sum().backward()
            moe.zero_grad(set_to_none=True)

        return run

    steps = {name: step(moe) for name, moe in layers.items()}
    for run in steps.values():  # warm-up
        run()
    times = alternate_blocks(steps, block, rounds)
    return {name: {**counted[name], "step_ms": times[name]} for name in layers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks = ep degree (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank (default: %(default)s)")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args(argv)
    results = run_ranks(_worker, args.ranks, args.tokens, args.block, args.rounds)
    total = args.ranks * args.tokens
    header = (
        f"{'dispatch, routing':<24}{'rows/token':>11}{'a2a KB/token fwd':>18}{'crossing':>10}"
        f"{'layer fwd+bwd ms (min-max)':>29}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        ms = r["step_ms"]
        r["step_ms"] = spread(ms, digits=2)
        print(
            f"{name:<24}{r['rows'] / 2 / total:>11.2f}{r['given'] / total / 1e3:>18.2f}"
            f"{r['crossing'] / total / 1e3:>10.2f}"
            f"{f'{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})':>29}"
        )
    print(
        f"(rows/token: float rows the dispatch sends per token (combine returns as many); KB per token per layer "
        f"forward handed to all_to_all_single, dispatch + ids + combine, and the part crossing ranks; ms: rank 0, "
        f"median (min-max) over {args.rounds} interleaved rounds of {args.block}-step blocks; {args.ranks} gloo "
        f"ranks, {args.tokens} tokens each, layer {LAYER}; untrained router, random tokens)"
    )
    if args.json:
        print(json.dumps({"ranks": args.ranks, "tokens_per_rank": args.tokens, "layer": LAYER, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
