"""Sparse upcycling against its alternatives at equal steps and equal training FLOPs, over seeds.

    python benchmarks/upcycle.py --data tinyshakespeare.txt [--json] [--seeds 3] [--base-steps N] [--extra-steps M]
        [--threads 2]

Per seed, a dense ``shakespeare-dense`` parent is trained for N steps, then:
(a) ``upcycled``: the parent's MLPs become 8 copies each, top-2 (Komatsuzaki et al.), trained M steps;
(b) ``upcycled+dts``: the same with the DTS gate (all experts at first, annealed to top-2 over M/2 steps);
(c) ``dense``: the parent continued for M_d steps, M_d chosen so that its training FLOPs from step 0
    equal (a)'s: M_d = round(M * F_moe / F_dense);
(d) ``scratch-moe``: (a)'s architecture from a random init for N + M steps, as many as (a) from step 0,
    on the preset's schedule (warmup, lr 1e-3 cosine to 1e-4) stretched to N + M steps.
The continuations (a)-(c) start a fresh optimizer on one schedule: warmup over a tenth of their steps
to ``--lr``, cosine to the preset's 1e-4.

FLOPs per step F = tokens per step (batch x context) x ``Transformer.flops_per_token``, that is
6 x active matmul parameters (attention, the router and top-k experts of each MoE layer, the tied
output head) + 12 x layers x d_model x context (attention scores and values), forward and backward
(PaLM, appendix B). The DTS run counts at each step the experts its gate runs then (8 down to 2).

The defaults (parent 200 steps, 100 more) are cut down from the preset's 2000 iterations: three
seeds take about ten CPU-minutes (at one thread; longer in wall time on a loaded machine). Prints
each variant's steps, training FLOPs and final validation loss (median and min-max over seeds, and
each seed's), writes ``upcycle.png`` per seed (the continuations' loss curves), and with ``--json``
one JSON object on the last line.
Target: (a) below (c) and (d).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _spread import show, spread  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.convert.upcycle import upcycle  # noqa: E402
from moekit.model import Transformer  # noqa: E402
from moekit.routing import dts_schedule  # noqa: E402
from moekit.run.checkpoint import save_weights_run  # noqa: E402
from moekit.run.load import load_run  # noqa: E402
from moekit.train.loop import train  # noqa: E402
from moekit.train.plots import compare_runs  # noqa: E402

EXPERTS, TOP_K = 8, 2


def continuation(cfg: runconfig.RunConfig, steps: int, args: argparse.Namespace, **moe: object) -> runconfig.RunConfig:
    """``cfg`` on the continuations' schedule over ``steps`` (and with MoE settings ``moe``)."""
    train_cfg = dataclasses.replace(cfg.train, steps=steps, warmup_steps=steps // 10, lr=args.lr)
    return dataclasses.replace(cfg, train=train_cfg, moe=dataclasses.replace(cfg.moe, **moe))


def step_flops(model: Transformer, cfg: runconfig.RunConfig, step: int = 0, dts_steps: int = 0) -> float:
    """Training FLOPs of one step of ``model``; under the DTS gate, at ``step`` of its schedule."""
    flops = model.flops_per_token()
    if dts_steps:
        extra = dts_schedule(step, EXPERTS, TOP_K, dts_steps, 1.0)[0] - TOP_K
        for moe in model.moe_layers():
            flops += 6 * extra * sum(p[0].numel() for p in moe.experts.parameters())
    return flops * cfg.train.batch_size * cfg.model.context_length * cfg.train.grad_accum


def one_seed(seed: int, args: argparse.Namespace, out: Path) -> tuple[dict[str, float], dict[str, dict]]:
    """Train the parent and the four variants with ``seed``; (final val losses, steps and FLOPs)."""
    progress = not args.quiet
    overrides = {"train.seed": str(seed), "train.steps": str(args.base_steps), "train.sample_tokens": "0"}
    overrides |= {"data.path": args.data, "train.eval_every": str(args.eval_every), "train.eval_iters": "20"}
    parent = train(runconfig.resolve("shakespeare-dense", overrides), out / "parent", progress=progress)
    dense_cfg = runconfig.from_json(out / "parent" / "config.json")
    parent_run = load_run(out / "parent")
    dense = parent_run.model

    def upcycled(name: str, **moe: object) -> Transformer:
        model = upcycle(dense, EXPERTS, TOP_K, seed=seed, moe_overrides=moe)
        cfg = dataclasses.replace(runconfig.for_model(model.cfg, model.moe_cfg, dense_cfg.data), train=dense_cfg.train)
        save_weights_run(out / name, cfg.to_json(), model, parent_run.tokenizer, "upcycled parent")
        return model

    m, n = args.extra_steps, args.base_steps
    dts_steps = m // 2
    moe = upcycled("upcycled-init")
    upcycled("upcycled-dts-init", dts_steps=dts_steps)
    moe_cfg = runconfig.from_json(out / "upcycled-init" / "config.json")
    f_dense, f_moe = step_flops(dense, dense_cfg), step_flops(moe, moe_cfg)
    dense_steps = round(m * f_moe / f_dense)
    dts = sum(step_flops(moe, moe_cfg, s, dts_steps) for s in range(m))
    plan = {
        "parent": {"steps": f"{n}", "flops": n * f_dense},
        "dense": {"steps": f"{n}+{dense_steps}", "flops": (n + dense_steps) * f_dense},
        "upcycled": {"steps": f"{n}+{m}", "flops": n * f_dense + m * f_moe},
        "upcycled+dts": {"steps": f"{n}+{m}", "flops": n * f_dense + dts},
        "scratch-moe": {"steps": f"{n + m}", "flops": (n + m) * f_moe},
    }
    scratch_cfg = dataclasses.replace(moe_cfg, train=dataclasses.replace(moe_cfg.train, steps=n + m))
    runs = {
        "dense": (continuation(dense_cfg, dense_steps, args), out / "parent"),
        "upcycled": (continuation(moe_cfg, m, args), out / "upcycled-init"),
        "upcycled+dts": (continuation(moe_cfg, m, args, dts_steps=dts_steps), out / "upcycled-dts-init"),
        "scratch-moe": (scratch_cfg, None),
    }
    losses = {"parent": parent.val_loss}
    for name, (cfg, init) in runs.items():
        print(f"# seed {seed}: {name}", file=sys.stderr, flush=True)
        losses[name] = train(cfg, out / name, progress=progress, init=init).val_loss
    continued = {name: out / name for name, (_, init) in runs.items() if init is not None}
    compare_runs(continued, out / "upcycle.png", f"after a dense parent of {n} steps (seed {seed})")
    return losses, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the training text (tinyshakespeare.txt)")
    parser.add_argument("--out", type=Path, help="where runs and plots go (default: a temporary directory)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1, one parent each (default: 3)")
    parser.add_argument("--base-steps", type=int, default=200, help="steps of the dense parent (default: 200)")
    parser.add_argument("--extra-steps", type=int, default=100, help="steps of the upcycled runs (default: 100)")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak lr of the continuations (default: 6e-4)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between validation passes (default: 50)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args(argv)
    if not Path(args.data).is_file():
        parser.error(f"--data: no such file: {args.data}")
    if args.seeds < 1 or args.base_steps < 1 or args.extra_steps < 2:
        parser.error("--seeds and --base-steps must be >= 1, --extra-steps >= 2")
    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="moekit-upcycle-"))
    started = time.perf_counter()
    per_seed: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        losses, plan = one_seed(seed, args, out / f"seed{seed}")
        for name, value in losses.items():
            per_seed.setdefault(name, []).append(value)
    minutes = (time.perf_counter() - started) / 60

    print(f"{EXPERTS} experts top-{TOP_K} upcycled from every MLP; final val loss over seeds 0..{args.seeds - 1}")
    print(f"{'run':<14}{'steps':>9}{'train TFLOP':>13}  {'val loss median (min .. max)':<30}per seed")
    print("-" * 94)
    for name, losses in per_seed.items():
        seeds = " ".join(f"{v:.4f}" for v in losses)
        print(f"{name:<14}{plan[name]['steps']:>9}{plan[name]['flops'] / 1e12:>13.2f}  {show(losses):<30}{seeds}")
    median = {name: spread(v)["median"] for name, v in per_seed.items()}
    verdict = "met" if median["upcycled"] < min(median["dense"], median["scratch-moe"]) else "NOT met"
    print(f"target (upcycled median below dense-continued and scratch MoE): {verdict}; {minutes:.1f} min; out: {out}")
    if args.json:
        figures = {name: {**plan[name], "val_loss": spread(v), "val_loss_per_seed": v} for name, v in per_seed.items()}
        print(json.dumps({"seeds": args.seeds, "lr": args.lr, **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
