"""``moekit plan``: the auto-parallel planner's ranked layouts, optionally re-scored with measured loads."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="rank parallel layouts of a model on a cluster by predicted step time",
        description="The auto-parallel planner: enumerate dp x ep x etp x tp x cp x pp x vp x micro-batches x "
        "all-to-all form x overlap with the techniques switched on, drop layouts that do not fit in memory, print the "
        "fastest by predicted step time with tokens/s/GPU and model TFLOP/s/GPU. With --loads, re-score them with a "
        "run's measured expert loads, with and without load-aware placement.",
    )
    plan.set_defaults(run=run)
    plan.add_argument("--model", required=True, help="model preset (mixtral-8x7b, qwen3-30b-a3b, ...) or a .toml file")
    plan.add_argument("--cluster", required=True, help="cluster preset (dgx-h100) or a .toml file")
    plan.add_argument("--nodes", type=int, help="nodes of the cluster (default: the preset's)")
    plan.add_argument("--global-batch", type=int, help="sequences per step (default: the model preset's)")
    plan.add_argument(
        "--techniques",
        default="all",
        help="all (default), moekit (moekit's own runtime: none of them) or a comma-separated list of: "
        "overlapped_grads, a2a_overlap, interleave, recompute, sequence_parallel, fp8, expert_tp, context_parallel, "
        "deduplicated_dispatch, weighted_activation",
    )
    plan.add_argument("--top", type=int, default=10, help="rows to print (default: %(default)s)")
    plan.add_argument("--loads", type=Path, metavar="RUN_DIR", help="re-score with this run's measured expert loads")
    plan.add_argument("--steps-left", type=int, default=1000, help="steps a re-placement can pay back over")


def run(args: argparse.Namespace) -> int:
    from moekit.parallel import planner
    from moekit.train.metrics import mean_expert_loads

    for name in ("top", "nodes", "global_batch"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={value}: must be > 0")
    if args.steps_left < 0:
        raise ValueError(f"--steps-left={args.steps_left}: must be >= 0")
    spec = planner.load_model(args.model, args.global_batch)
    loads = None
    if args.loads is not None:  # read before planning: a bad run directory is reported at once
        try:
            loads = mean_expert_loads(args.loads, spec.moe.num_experts)
        except (ValueError, OSError) as err:
            raise ValueError(f"--loads={args.loads}: {err}") from None
    cluster, tech = planner.load_cluster(args.cluster, args.nodes), planner.parse_techniques(args.techniques)
    rows = planner.plan(spec, cluster, args.top, tech=tech)
    w = spec.workload
    print(
        f"{spec.name} on {cluster.name} ({cluster.world} devices), global batch {w.global_batch} x {spec.seq_len} "
        f"tokens = {w.global_batch * spec.seq_len / 1e6:.2f}M tokens a step, {w.precision}; techniques: "
        f"{', '.join(tech.names()) or 'none (moekit)'}; {len(rows)} fastest layouts that fit"
    )
    if not rows:
        print("no layout fits in memory: use more devices or a smaller global batch")
        return 0
    print(planner.format_table(rows, spec, cluster))
    print("mbs: sequences a micro-batch; mb: micro-batches a step; TFLOP/s: model FLOPs (6N active + attention)")
    if loads is not None:
        again = planner.rescore(spec, cluster, rows, loads, args.steps_left)
        print(f"\nre-scored with the expert loads of {args.loads} (plain EP -> load-aware placement):")
        for i, r in enumerate(again, 1):
            c = r.estimate.candidate
            print(
                f"{i:>3} dp={c.dp} ep={c.ep} tp={c.tp} pp={c.pp} mb={c.micro} {c.all_to_all}"
                f"{'' if c.overlap == 'none' else ' overlap=' + c.overlap}: "
                f"{r.estimate.step_s:.4f} s -> {r.placed.step_s:.4f} s; "
                f"re-placing costs {r.switch_s:.4f} s: {'switch' if r.switch else 'keep'}"
            )
    return 0
