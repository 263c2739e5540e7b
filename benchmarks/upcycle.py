"""Sparse upcycling against its alternatives, at equal extra training steps, in this process.

    python benchmarks/upcycle.py --data ../shared/data/tinyshakespeare.txt [--json] [--base-steps N] [--extra-steps M]

A dense ``shakespeare-dense`` model is trained for N steps (the parent). From there, M more steps of:
(a) the dense parent, continued; (b) the parent upcycled to 8 copies of each MLP, top-2
(Komatsuzaki et al.); (c) the same MoE architecture trained from scratch; (d) the upcycled model with
the DTS gate (all experts at first, annealed to top-2 over the first half of the M steps). Every
continuation uses a fresh optimizer and the same schedule. Prints a table of validation losses and
wall times, writes ``upcycle.png`` (loss curves) into the output directory, and with ``--json`` one
JSON object on the last line. Target: (b) below (a) and (c).
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

from moekit import runconfig
from moekit.convert.upcycle import upcycle
from moekit.run.checkpoint import save_weights_run
from moekit.run.load import load_run
from moekit.train.loop import train
from moekit.train.plots import compare_runs

EXPERTS, TOP_K = 8, 2


def continuation(cfg: runconfig.RunConfig, args: argparse.Namespace, **moe: object) -> runconfig.RunConfig:
    """``cfg`` with the shared schedule of the M extra steps (and MoE settings)."""
    train_cfg = dataclasses.replace(
        cfg.train, steps=args.extra_steps, warmup_steps=args.extra_steps // 10, lr=args.lr, eval_every=args.eval_every
    )
    return dataclasses.replace(cfg, train=train_cfg, moe=dataclasses.replace(cfg.moe, **moe))


def timed(name: str, make, out: Path) -> dict:
    print(f"# {name}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    result = make(out / name)
    return {"val_loss": round(result.val_loss, 4), "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the training text (tinyshakespeare.txt)")
    parser.add_argument("--out", type=Path, help="where runs and the plot go (default: a temporary directory)")
    parser.add_argument("--base-steps", type=int, default=300, help="steps of the dense parent (default: 300)")
    parser.add_argument("--extra-steps", type=int, default=150, help="steps of each continuation (default: 150)")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak lr of the continuations (default: 6e-4)")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between validation passes (default: 25)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args(argv)
    if not Path(args.data).is_file():
        parser.error(f"--data: no such file: {args.data}")
    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="moekit-upcycle-"))
    progress = not args.quiet

    base_cfg = runconfig.resolve(
        "shakespeare-dense",
        {
            "data.path": args.data,
            "train.steps": str(args.base_steps),
            "train.sample_tokens": "0",
            "train.eval_iters": "10",
        },
    )
    parent = timed("parent", lambda d: train(base_cfg, d, progress=progress), out)
    dense_cfg = runconfig.from_json(out / "parent" / "config.json")
    dense = load_run(out / "parent")

    def upcycled(name: str, **moe: object) -> Path:
        model = upcycle(dense.model, EXPERTS, TOP_K, moe_overrides=moe)
        cfg = dataclasses.replace(runconfig.for_model(model.cfg, model.moe_cfg, dense_cfg.data), train=dense_cfg.train)
        save_weights_run(out / name, cfg.to_json(), model, dense.tokenizer, "upcycled parent")
        return out / name

    moe_cfg = runconfig.from_json(upcycled("upcycled-init") / "config.json")
    dts_steps = args.extra_steps // 2
    upcycled("upcycled-dts-init", dts_steps=dts_steps)
    runs = {
        "dense": lambda d: train(continuation(dense_cfg, args), d, progress=progress, init=out / "parent"),
        "upcycled": lambda d: train(continuation(moe_cfg, args), d, progress=progress, init=out / "upcycled-init"),
        "scratch-moe": lambda d: train(continuation(moe_cfg, args), d, progress=progress),
        "upcycled+dts": lambda d: train(
            continuation(moe_cfg, args, dts_steps=dts_steps), d, progress=progress, init=out / "upcycled-dts-init"
        ),
    }
    results = {name: timed(name, make, out) for name, make in runs.items()}
    plot = compare_runs({name: out / name for name in runs}, out / "upcycle.png", "continuing a dense parent")

    print(f"dense parent: {args.base_steps} steps, val loss {parent['val_loss']:.4f}, {parent['seconds']:.0f} s")
    print(f"then {args.extra_steps} more steps each ({EXPERTS} experts, top-{TOP_K}; DTS over {dts_steps} steps):")
    print(f"{'run':<14}{'val loss':>10}{'seconds':>10}")
    print("-" * 34)
    for name, r in results.items():
        print(f"{name:<14}{r['val_loss']:>10.4f}{r['seconds']:>10.1f}")
    best_other = min(results["dense"]["val_loss"], results["scratch-moe"]["val_loss"])
    verdict = "met" if results["upcycled"]["val_loss"] < best_other else "NOT met"
    print(f"target (upcycled below dense-continued and scratch MoE): {verdict}; plot: {plot}")
    if args.json:
        print(json.dumps({"parent": parent, **results, "base_steps": args.base_steps, "extra_steps": args.extra_steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
