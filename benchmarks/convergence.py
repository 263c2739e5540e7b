"""Quality per compute: a dense model and an MoE model with the same active parameters per token,
trained side by side in this process on the same data, against nanoGPT's documented CPU run.

    python benchmarks/convergence.py --data ../shared/data/tinyshakespeare.txt [--json] [--steps N]

The dense run is the ``shakespeare-dense`` preset (nanoGPT's CPU configuration: character level,
4 layers, 4 heads, d_model 128, context 64, batch 12, 2000 iterations, lr 1e-3 -> 1e-4, no
dropout, LayerNorm and a 4x GELU MLP; nanoGPT reports val loss 1.88). The MoE run is
``shakespeare-moe``: every other MLP becomes 16 GELU experts of half its width, top-2 (equal active
parameters). Prints a table, writes
``convergence.png`` with both loss curves into the output directory, and with ``--json`` one JSON
object on the last line.

The two runs take turns, one optimizer step each (the training loop's ``on_step`` hands over), and
each run's seconds are the sum of its own turns: this machine's speed drifts by tens of percent
within minutes, so runs timed one after the other do not compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from moekit import runconfig
from moekit.model import Transformer
from moekit.train.loop import train
from moekit.train.metrics import read_metrics
from moekit.train.plots import compare_runs

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


def run_one(name: str, preset: str, args: argparse.Namespace, out_dir: Path, turns: TakeTurns) -> dict:
    overrides = {"data.path": args.data, "train.sample_tokens": "0"}
    if args.steps:
        overrides["train.steps"] = str(args.steps)
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
        "tokens_per_s": round(tokens_per_step / step_ms * 1e3, 1),
        "params": built.num_params(),
        "active_params": built.num_active_params(),
        "run_dir": str(run_dir),
    }


def train_side_by_side(args: argparse.Namespace, out_dir: Path) -> dict[str, dict]:
    """Both runs in threads taking turns step by step; each result gets the seconds of its own turns."""
    steps = args.steps or runconfig.resolve(RUNS["dense"], {}).train.steps
    bar = tqdm(total=steps * len(RUNS), unit="step", disable=args.quiet, desc="dense + MoE, turn by turn")
    turns = TakeTurns(list(RUNS), bar)
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def work(name: str, preset: str) -> None:
        turns.begin(name)
        try:
            results[name] = run_one(name, preset, args, out_dir, turns)
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
    return {name: results[name] for name in RUNS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the training text (tinyshakespeare.txt)")
    parser.add_argument("--out", type=Path, help="where runs and the plot go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, help="override the 2000 iterations (for a quick look)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args(argv)
    if not Path(args.data).is_file():
        parser.error(f"--data: no such file: {args.data}")
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="moekit-convergence-"))
    results = train_side_by_side(args, out_dir)
    plot = compare_runs(
        {n: Path(r["run_dir"]) for n, r in results.items()}, out_dir / "convergence.png", "dense vs MoE"
    )

    columns = [("model", 7), ("val loss", 10), ("train loss", 12), ("seconds", 10), ("ms/iter", 10)]
    columns += [("tokens/s", 11), ("params", 11), ("active", 11)]
    header = "".join(f"{name:<{w}}" if i == 0 else f"{name:>{w}}" for i, (name, w) in enumerate(columns))
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<7}{r['val_loss']:>10.4f}{r['train_loss']:>12.4f}{r['seconds']:>10.1f}{r['ms_per_iter']:>10.2f}"
            f"{r['tokens_per_s']:>11.0f}{r['params']:>11,}{r['active_params']:>11,}"
        )
    dense, moe = results["dense"], results["moe"]
    print(
        f"MoE - dense val loss: {moe['val_loss'] - dense['val_loss']:+.4f}; "
        f"MoE / dense wall time: {moe['seconds'] / dense['seconds']:.2f}x; plot: {plot}"
    )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
