"""Quality per compute and per wall-clock second: a dense model and an MoE model with the same active
parameters per token, trained side by side in this process on the same data, over seeds.

    python benchmarks/convergence.py --data tinyshakespeare.txt [--json] [--iters N] [--seeds 3] [--threads 1]
                                     [--block 50] [--eval-every 100] [--compile]
    python benchmarks/convergence.py --load OUTPUT   # the tables again, from a run's saved --json output

The dense run is the ``shakespeare-dense`` preset, nanoGPT's CPU configuration (character level,
4 layers, 4 heads, d_model 128, context 64, batch 12, 2000 iterations, lr 1e-3 -> 1e-4, no
dropout, LayerNorm and a 4x GELU MLP), with RoPE in place of learned positions. nanoGPT's README
gives val loss 1.88 for its own 2000 iterations: a published figure, not measured here. The MoE run
is ``shakespeare-moe``: every other MLP becomes 16 GELU experts of half its width, top-2 (equal
active parameters). ``--iters`` shortens both runs (the schedule decays over the shorter run); each
seed (0 .. N-1) sets both runs' init and data order. Both evaluate every ``--eval-every`` steps.

The two runs of a seed take turns ``--block`` optimizer steps at a time (the training loop's
``on_step`` hands over): this machine's speed drifts by tens of percent within minutes, so runs
timed one after the other do not compare, and turns of single steps evict each model's caches at
every step (``_spread.alternate_blocks``). A run's clock is the sum of its own optimizer steps'
seconds as the loop measures them (evaluation and checkpoints left out; with ``--compile`` the
compilation inside the first steps counts). Reported per seed: final val losses, the wall-time
ratio, each run's ms per step as the median (min-max) over its blocks, and the quality per
wall-clock figure: the time MoE needs to reach dense's final val loss (its first evaluation at or
below it) as a fraction of dense's whole time. Then the median and min-max over seeds; writes
``convergence.png`` with both loss curves per seed, and with ``--json`` one JSON object on the last line.
Because a busy spell can land in one run's blocks and not the other's, the fraction is also given with
each run's clock replaced by its median block (steps to reach dense's loss times the median ms ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
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
    """Lets runs in threads take turns, ``block`` optimizer steps at a time, and keeps each run's step seconds."""

    def __init__(self, names: list[str], block: int, bar: tqdm) -> None:
        self._cond = threading.Condition()
        self._going = list(names)  # runs not finished, in turn order
        self._turn = names[0]
        self._in_turn = 0  # steps taken in the current turn
        self.block = block
        self.step_s: dict[str, list[float]] = {name: [] for name in names}  # each optimizer step's seconds
        self.block_ms: dict[str, list[float]] = {name: [] for name in names}  # ms per step of each full turn
        self.bar = bar

    def begin(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == name)

    def stepped(self, name: str, seconds: float) -> None:
        """After each optimizer step of ``name``: count it, and hand over at the end of a turn."""
        self.step_s[name].append(seconds)
        self.bar.update(1)
        self._in_turn += 1
        if self._in_turn == self.block:
            self.block_ms[name].append(sum(self.step_s[name][-self.block :]) / self.block * 1e3)
            self.hand_over(name)
            self.begin(name)

    def hand_over(self, name: str, finished: bool = False) -> None:
        with self._cond:
            i = self._going.index(name)
            if finished:
                self._going.remove(name)
            if self._going:
                self._turn = self._going[i % len(self._going)] if finished else self._going[(i + 1) % len(self._going)]
            self._in_turn = 0
            self._cond.notify_all()


def run_one(name: str, preset: str, seed: int, args: argparse.Namespace, out_dir: Path, turns: TakeTurns) -> dict:
    overrides = {
        "data.path": args.data,
        "train.sample_tokens": "0",
        "train.seed": str(seed),
        "train.eval_every": str(args.eval_every),
        "train.compile": str(args.compile).lower(),
    }
    if args.iters:
        overrides["train.steps"] = str(args.iters)
    cfg = runconfig.resolve(preset, overrides)
    tokens_per_step = cfg.train.batch_size * cfg.model.context_length * cfg.train.grad_accum
    run_dir = out_dir / name
    result = train(
        cfg,
        run_dir,
        progress=False,
        on_step=lambda record: turns.stepped(name, tokens_per_step / record["tokens_per_s"]),
    )
    evals = [(r["step"], r["val_loss"]) for r in read_metrics(run_dir) if "val_loss" in r]
    built = Transformer(runconfig.from_json(run_dir / "config.json").model, cfg.moe if cfg.is_moe else None)
    return {
        "val_loss": round(result.val_loss, 4),
        "train_loss": round(statistics.mean(result.losses[-50:]), 4),
        "evals": evals,
        "params": built.num_params(),
        "active_params": built.num_active_params(),
        "run_dir": str(run_dir),
    }


def time_to_reach(target: float, evals: list[tuple[int, float]], step_s: list[float]) -> float | None:
    """Seconds of training up to the first evaluation at or below ``target`` (None: never reached)."""
    for step, loss in evals:
        if loss <= target:
            return sum(step_s[:step])
    return None


def train_side_by_side(seed: int, args: argparse.Namespace, out_dir: Path) -> dict[str, dict]:
    """Both runs of ``seed`` in threads taking turns step by step; each gets the seconds of its own turns."""
    steps = args.iters or runconfig.resolve(RUNS["dense"], {}).train.steps
    desc = f"seed {seed}: dense + MoE, {args.block} steps a turn"
    bar = tqdm(total=steps * len(RUNS), unit="step", disable=args.quiet, desc=desc)
    turns = TakeTurns(list(RUNS), args.block, bar)
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
        r["seconds"] = round(sum(turns.step_s[name]), 1)
        r["block_ms"] = [round(ms, 1) for ms in turns.block_ms[name]]
    reached = time_to_reach(results["dense"]["val_loss"], results["moe"]["evals"], turns.step_s["moe"])
    results["moe"]["reach_dense_s"] = None if reached is None else round(reached, 1)
    compare_runs({n: Path(r["run_dir"]) for n, r in results.items()}, out_dir / "convergence.png", f"seed {seed}")
    return {name: results[name] for name in RUNS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="the training text (tinyshakespeare.txt); required unless --load")
    parser.add_argument("--out", type=Path, help="where runs and plots go (default: a temporary directory)")
    parser.add_argument("--iters", type=int, help="iterations of each run (default: the presets' 2000)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument("--block", type=int, default=50, help="optimizer steps per turn (default: 50)")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations (default: 100)")
    parser.add_argument("--compile", action="store_true", help="train both with train.compile")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    parser.add_argument(
        "--load", type=Path, help="print the tables of an earlier run from its saved output (its --json last line)"
    )
    args = parser.parse_args(argv)
    if not args.load and not Path(args.data or "").is_file():
        parser.error(f"--data: no such file: {args.data}")
    if args.load and not args.load.is_file():
        parser.error(f"--load: no such file: {args.load}")
    if min(args.seeds, args.block, args.eval_every, args.iters or 1) < 1:
        parser.error("--seeds, --iters, --block and --eval-every must be >= 1")
    if args.load:
        saved = json.loads(args.load.read_text().strip().splitlines()[-1])
        seeds = {int(seed): runs for seed, runs in saved["seeds"].items()}
        iters, out_dir = saved["iters"], Path(seeds[min(seeds)]["dense"]["run_dir"]).parents[1]
    else:
        torch.set_num_threads(args.threads)
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="moekit-convergence-"))
        seeds = {seed: train_side_by_side(seed, args, out_dir / f"seed{seed}") for seed in range(args.seeds)}
        iters = args.iters or runconfig.resolve(RUNS["dense"], {}).train.steps
    report(seeds, iters, args, out_dir)
    return 0


def reach_step(target: float, evals: list[tuple[int, float]]) -> int | None:
    return next((step for step, loss in evals if loss <= target), None)


def report(seeds: dict[int, dict], iters: int, args: argparse.Namespace, out_dir: Path) -> None:
    """The table per seed and the medians over seeds (and the JSON line with ``--json``)."""
    first = seeds[min(seeds)]
    print(
        f"{iters} iterations; dense {first['dense']['active_params']:,} params; MoE {first['moe']['params']:,} params"
    )
    settings = (
        f"from {args.load}"
        if args.load
        else f"torch threads {args.threads}; {args.block} steps a turn; eval every {args.eval_every}; "
        f"compile {args.compile}"
    )
    print(f"({first['moe']['active_params']:,} active per token); {settings}")
    header = f"{'seed':<6}{'dense val':>10}{'MoE val':>9}{'MoE-dense':>10}{'dense s':>9}{'MoE s':>8}{'ratio':>7}"
    print(header + f"{'dense ms/step':>24}{'MoE ms/step':>24}{'MoE to dense val':>18}{'at step':>9}")
    print("-" * 134)
    for seed, r in seeds.items():
        dense, moe = r["dense"], r["moe"]
        reach = moe["reach_dense_s"]
        reach_text = f"{reach / dense['seconds']:.2f} ({reach:.0f}s)" if reach is not None else "not reached"
        step = reach_step(dense["val_loss"], moe["evals"])
        print(
            f"{seed:<6}{dense['val_loss']:>10.4f}{moe['val_loss']:>9.4f}{moe['val_loss'] - dense['val_loss']:>+10.4f}"
            f"{dense['seconds']:>9.1f}{moe['seconds']:>8.1f}{moe['seconds'] / dense['seconds']:>6.2f}x "
            f"{show(dense['block_ms'], '.1f'):>23}{show(moe['block_ms'], '.1f'):>24}{reach_text:>18}{step or '-':>9}"
        )
    figures = {
        "dense_val_loss": [r["dense"]["val_loss"] for r in seeds.values()],
        "moe_val_loss": [r["moe"]["val_loss"] for r in seeds.values()],
        "moe_minus_dense": [r["moe"]["val_loss"] - r["dense"]["val_loss"] for r in seeds.values()],
        "time_ratio": [r["moe"]["seconds"] / r["dense"]["seconds"] for r in seeds.values()],
        "step_ms_ratio": [
            statistics.median(r["moe"]["block_ms"]) / statistics.median(r["dense"]["block_ms"]) for r in seeds.values()
        ],
    }
    reached = [r["moe"]["reach_dense_s"] / r["dense"]["seconds"] for r in seeds.values() if r["moe"]["reach_dense_s"]]
    steps = [reach_step(r["dense"]["val_loss"], r["moe"]["evals"]) for r in seeds.values()]
    print(f"median (min .. max) over {len(seeds)} seeds:")
    print(f"  dense val loss {show(figures['dense_val_loss'])}; MoE val loss {show(figures['moe_val_loss'])}")
    print(f"  MoE - dense val loss {show(figures['moe_minus_dense'], '+.4f')}")
    print(f"  MoE / dense training time {show(figures['time_ratio'], '.2f')}")
    print(f"  MoE / dense median ms per step over blocks {show(figures['step_ms_ratio'], '.2f')}")
    if reached:
        figures["moe_time_to_dense_val"] = reached
        print(
            f"  MoE's time to dense's final val loss / dense's time {show(reached, '.2f')} "
            f"({len(reached)} of {len(seeds)} seeds reached it)"
        )
    if all(steps):
        # The same fraction with each run's clock replaced by its median block: robust to the machine's
        # drift when one run's blocks happen to meet a busy spell the other's do not.
        figures["moe_steps_to_dense_val"] = [step / iters for step in steps]
        figures["moe_time_to_dense_val_at_median_step"] = [
            step / iters * ratio for step, ratio in zip(steps, figures["step_ms_ratio"], strict=True)
        ]
        at_median = figures["moe_time_to_dense_val_at_median_step"]
        print(
            f"  MoE's steps to dense's final val loss / dense's steps {show(figures['moe_steps_to_dense_val'], '.2f')};"
            f" at each run's median ms per step, its time {show(at_median, '.2f')}"
        )
    if not reached:
        print("  MoE did not reach dense's final val loss in any seed")
    print(f"plots: {out_dir}/seed*/convergence.png")
    if args.json:
        summary = {name: spread(values) for name, values in figures.items()}
        print(json.dumps({"iters": iters, "seeds": {str(k): v for k, v in seeds.items()}, **summary}))


if __name__ == "__main__":
    raise SystemExit(main())
