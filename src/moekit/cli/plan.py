"""``moekit plan``: the auto-parallel planner's ranked layouts, optionally re-scored with measured loads."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="rank parallel layouts of a model on a cluster by predicted step time",
        description="The auto-parallel planner: enumerate dp x ep x tp x pp x micro-batches x all-to-all form x "
        "overlap, drop layouts that do not fit in memory, print the fastest by predicted step time. With --loads, "
        "re-score them with a run's measured expert loads, with and without load-aware placement.",
    )
    plan.set_defaults(run=run)
    plan.add_argument("--model", required=True, help="model preset (mixtral-8x7b, deepseek-moe-16b) or a .toml file")
    plan.add_argument("--cluster", required=True, help="cluster preset (h100x8, h100-ib-32, ...) or a .toml file")
    plan.add_argument("--top", type=int, default=10, help="rows to print (default: %(default)s)")
    plan.add_argument("--loads", type=Path, metavar="RUN_DIR", help="re-score with this run's measured expert loads")
    plan.add_argument("--steps-left", type=int, default=1000, help="steps a re-placement can pay back over")


def run(args: argparse.Namespace) -> int:
    from moekit.parallel import planner
    from moekit.train.metrics import mean_expert_loads

    spec, cluster = planner.load_model(args.model), planner.load_cluster(args.cluster)
    if args.top <= 0:
        raise ValueError(f"--top={args.top}: must be > 0")
    rows = planner.plan(spec, cluster, args.top)
    print(f"{spec.name} on {cluster.name} ({cluster.world} devices): {len(rows)} fastest layouts that fit")
    if not rows:
        print("no layout fits in memory: use more devices or a smaller global batch")
        return 0
    print(planner.format_table(rows))
    if args.loads is not None:
        try:
            loads = mean_expert_loads(args.loads, spec.moe.num_experts)
        except ValueError as err:
            raise ValueError(f"--loads {err}") from None
        again = planner.rescore(spec, cluster, rows, loads, args.steps_left)
        print(f"\nre-scored with the expert loads of {args.loads} (plain EP -> load-aware placement):")
        for i, r in enumerate(again, 1):
            c = r.estimate.candidate
            print(
                f"{i:>3} dp={c.dp} ep={c.ep} tp={c.tp} pp={c.pp} mb={c.micro} {c.all_to_all}"
                f"{' overlap' if c.overlap else ''}: {r.estimate.step_s:.4f} s -> {r.placed.step_s:.4f} s; "
                f"re-placing costs {r.switch_s:.4f} s: {'switch' if r.switch else 'keep'}"
            )
    return 0
