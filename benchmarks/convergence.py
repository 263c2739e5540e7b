"""Quality per compute: a dense model and an MoE model with the same active parameters per token,
trained side by side in this process on the same data, over seeds.

    python benchmarks/convergence.py --data tinyshakespeare.txt [--json] [--iters N] [--seeds 3] [--threads 2]

The dense run is the ``shakespeare-dense`` preset, nanoGPT's CPU configuration (character level,
4 layers, 4 heads, d_model 128, context 64, batch 12, 2000 iterations, lr 1e-3 -> 1e-4, no
dropout, LayerNorm and a 4x GELU MLP), with RoPE in place of learned positions. nanoGPT's README
gives val loss 1.88 for its own 2000 iterations: a published figure, not measured here. The MoE run
is ``shakespeare-moe``: every other MLP becomes 16 GELU experts of half its width, top-2 (equal
active parameters). ``--iters`` shortens both runs (the schedule decays over the shorter run); each
seed (0 .. N-1) sets both runs' init and data order.

The two runs of a seed take turns, one optimizer step each (the training loop's ``on_step`` hands
over), and each run's seconds are the sum of its own turns: this machine's speed drifts by tens of
percent within minutes, so runs timed one after the other do not compare. Prints each seed's row
and the median and min-max over seeds of the val losses, their difference and the wall-time ratio;
writes ``convergence.png`` with both loss curves per seed, and with ``--json`` one JSON object on the
last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from _spread import show, spread  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.model import Transformer  # noqa: E402
from moekit.train.loop import train  # noqa: E402
from moekit.train.metrics import read_metrics  # noqa: E402
from moekit.train.plots import compare_runs  # noqa: E402

RUNS = {"dense": "shakespeare-dense", "moe": "shakespeare-moe"}


class TakeTurns:
    """Lets runs in threads take turns, one optimizer step at a time, and times each run's own turns."""

    def __init__(self, names: list[str], bar: tqdm) -> None:
        self._cond = threading.Condition()
        self._going = list(names)  # runs not finished, in turn order
        self._turn = names[0]
        self._since = 0.0
        self.seconds = dict.fromkeys(names, 0.0)
        self.bar = bar

    def begin(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == name)
            self._since = time.perf_counter()

    def hand_over(self, name: str, finished: bool = False) -> None:
        with self._cond:
            self.seconds[name] += time.perf_counter() - self._since
            i = self._going.index(name)
            if finished:
                self._going.remove(name)
            else:
                self.bar.update(1)
            if self._going:
                self._turn = self._going[i % len(self._going)] if finished else self._going[(i + 1) % len(self._going)]
            self._cond.notify_all()
        if not finished:
            self.begin(name)


def run_one(name: str, preset: str, seed: int, args: argparse.Namespace, out_dir: Path, turns: TakeTurns) -> dict:
    overrides = {"data.path": args.data, "train.sample_tokens": "0", "train.seed": str(seed)}
    if args.iters:
        overrides["train.steps"] = str(args.iters)
    cfg = runconfig.resolve(preset, overrides)
    run_dir = out_dir / name
    result = train(cfg, run_dir, progress=False, on_step=lambda record: turns.hand_over(name))
    records = read_metrics(run_dir)
    tokens_per_step = cfg.train.batch_size * cfg.model.context_length * cfg.train.grad_accum
    step_ms = statistics.median(tokens_per_step / r["tokens_per_s"] * 1e3 for r in records)
    built = Transformer(runconfig.from_json(run_dir / "config.json").model, cfg.moe if cfg.is_moe else None)
    return {
        "val_loss": round(result.val_loss, 4),
        "train_loss": round(statistics.mean(result.losses[-50:]), 4),
        "ms_per_iter": round(step_ms, 2),
        "params": built.num_params(),
        "active_params": built.num_active_params(),
        "run_dir": str(run_dir),
    }


def train_side_by_side(seed: int, args: argparse.Namespace, out_dir: Path) -> dict[str, dict]:
    """Both runs of ``seed`` in threads taking turns step by step; each gets the seconds of its own turns."""
    steps = args.iters or runconfig.resolve(RUNS["dense"], {}).train.steps
    bar = tqdm(total=steps * len(RUNS), unit="step", disable=args.quiet, desc=f"seed {seed}: dense + MoE, turn by turn")
    turns = TakeTurns(list(RUNS), bar)
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def work(name: str, preset: str) -> None:
        turns.begin(name)
        try:
            results[name] = run_one(name, preset, seed, args, out_dir, turns)
        except BaseException as err:  # reported by the main thread
            errors.append(err)
        finally:
            turns.hand_over(name, finished=True)

    threads = [threading.Thread(target=work, args=item, name=f"train-{item[0]}") for item in RUNS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    if errors:
        raise errors[0]
    for name, r in results.items():
        r["seconds"] = round(turns.seconds[name], 1)
    compare_runs({n: Path(r["run_dir"]) for n, r in results.items()}, out_dir / "convergence.png", f"seed {seed}")
    return {name: results[name] for name in RUNS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the training text (tinyshakespeare.txt)")
    parser.add_argument("--out", type=Path, help="where runs and plots go (default: a temporary directory)")
    parser.add_argument("--iters", type=int, help="iterations of each run (default: the presets' 2000)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default: 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args(argv)
    if not Path(args.data).is_file():
        parser.error(f"--data: no such file: {args.data}")
    if args.seeds < 1 or (args.iters is not None and args.iters < 1):
        parser.error("--seeds and --iters must be >= 1")
    torch.set_num_threads(args.threads)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="moekit-convergence-"))
    seeds = {seed: train_side_by_side(seed, args, out_dir / f"seed{seed}") for seed in range(args.seeds)}

    iters = args.iters or runconfig.resolve(RUNS["dense"], {}).train.steps
    first = seeds[0]
    print(
        f"{iters} iterations; dense {first['dense']['active_params']:,} params; MoE {first['moe']['params']:,} params"
    )
    print(f"({first['moe']['active_params']:,} active per token); torch threads {torch.get_num_threads()}")
    print(f"{'seed':<6}{'dense val':>11}{'MoE val':>10}{'MoE-dense':>11}{'dense s':>9}{'MoE s':>9}{'time ratio':>12}")
    print("-" * 68)
    for seed, r in seeds.items():
        dense, moe = r["dense"], r["moe"]
        print(
            f"{seed:<6}{dense['val_loss']:>11.4f}{moe['val_loss']:>10.4f}{moe['val_loss'] - dense['val_loss']:>+11.4f}"
            f"{dense['seconds']:>9.1f}{moe['seconds']:>9.1f}{moe['seconds'] / dense['seconds']:>11.2f}x"
        )
    figures = {
        "dense_val_loss": [r["dense"]["val_loss"] for r in seeds.values()],
        "moe_val_loss": [r["moe"]["val_loss"] for r in seeds.values()],
        "moe_minus_dense": [r["moe"]["val_loss"] - r["dense"]["val_loss"] for r in seeds.values()],
        "time_ratio": [r["moe"]["seconds"] / r["dense"]["seconds"] for r in seeds.values()],
    }
    print(f"median (min .. max) over {args.seeds} seeds:")
    print(f"  dense val loss {show(figures['dense_val_loss'])}; MoE val loss {show(figures['moe_val_loss'])}")
    print(f"  MoE - dense val loss {show(figures['moe_minus_dense'], '+.4f')}")
    print(f"  MoE / dense wall time {show(figures['time_ratio'], '.2f')}")
    print(f"plots: {out_dir}/seed*/convergence.png")
    if args.json:
        summary = {name: spread(values) for name, values in figures.items()}
        print(json.dumps({"iters": iters, "seeds": {str(k): v for k, v in seeds.items()}, **summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
