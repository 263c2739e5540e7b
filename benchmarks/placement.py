"""Expert placement against plain expert parallelism on a skewed, drifting router (4 gloo ranks, CPU).

The router's selection bias carries a Zipf popularity profile over the experts that changes every
``--shift-every`` steps. Two scenarios:
  random       per seed, each phase's Zipf ranks are a fresh random permutation of the experts
  adversarial  Zipf ranks in expert order, moved by one rank's experts each phase, so plain expert
               parallelism always has the hottest experts together on one rank (its worst case)
Each variant trains the same model on the same batches through the training loop's own step:
  plain      expert e on rank e // El
  static     placed once, before step 0, from the first phase's profile (never follows the drift)
  live       re-placed every ``--every`` steps from the measured loads (parallel.placement_every)
  shadows    live placement plus up to 2 shadow experts per layer (parallel.shadow_experts)
The variants take turns, one step each, so the machine's drift hits them alike. Per run it measures
the rows each rank's experts computed (counted at the expert GEMMs, shadows included) and the step
time; the tables give the median and min-max over seeds, and each variant's change against plain
expert parallelism, seed by seed. A seed sets the popularity draws, the model's init and the data order.

The experts (d_model 128, 512 hidden) are most of the step's FLOPs, as in real MoE models, so the
busiest rank's expert GEMMs matter; with 4 ranks on fewer cores, even perfect balance cannot beat
total work / cores, which caps the step-time gain below what 4 devices would show. One MoE layer of
32 x 64 tokens per rank keeps the default run (2 scenarios x 3 seeds x 4 variants x 36 steps) to
15-20 minutes on 2 shared cores; fewer tokens per rank would make shadow experts not pay for their
weight traffic (``choose_shadows``), so the shadows variant would not differ from live.

    python benchmarks/placement.py [--json] [--scenario random|adversarial|both] [--seeds 0,1,2]
                                   [--steps 36] [--shift-every 12] [--every 4]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks, training_rank  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.parallel.placement import place_experts  # noqa: E402

EXPERTS, RANKS, WARMUP = 16, 4, 5
OVERRIDES = {
    "model.n_layers": "1",
    "model.n_heads": "2",
    "model.d_model": "128",
    "model.d_ff": "256",
    "model.context_length": "64",
    "model.tie_embeddings": "false",
    "moe.num_experts": str(EXPERTS),
    "moe.top_k": "2",
    "moe.d_ff": "512",
    "moe.bias_update_rate": "1e-9",  # the router uses its selection bias, which carries the Zipf skew
    "train.batch_size": "32",
    "train.lr": "1e-3",
    "train.warmup_steps": "5",
    "data.tokenizer": "byte",
    "parallel.ep": str(RANKS),
}
VARIANTS = {
    "plain": {},
    "static": {},
    "live": {"parallel.placement_every": "EVERY", "parallel.placement_min_gain": "0.05"},
    "shadows": {"parallel.placement_every": "EVERY", "parallel.shadow_experts": "2"},
}
SCENARIOS = ("random", "adversarial")


def popularity(scenario: str, seed: int, phases: int) -> list[torch.Tensor]:
    """Each phase's Zipf rank of every expert (0 = most popular)."""
    if scenario == "adversarial":
        per_rank = EXPERTS // RANKS
        return [(torch.arange(EXPERTS) - p * per_rank) % EXPERTS for p in range(phases)]
    g = torch.Generator().manual_seed(seed)
    return [torch.argsort(torch.randperm(EXPERTS, generator=g)) for _ in range(phases)]


def zipf_bias(ranks: torch.Tensor, scale: float = 0.3, s: float = 1.0) -> torch.Tensor:
    """A selection bias of scale / (i + 1)^s for the i-th most popular expert."""
    return scale / (ranks.double() + 1) ** s


class RankRows:
    """Rows each MoE layer's experts computed on this rank, step by step: the rows the grouped GEMM of
    the rank's own slots received, plus the rows it computed here for shadow experts."""

    def __init__(self, moes: list) -> None:
        self.now = torch.zeros(len(moes), dtype=torch.float64)
        self.steps: list[torch.Tensor] = []
        for i, moe in enumerate(moes):
            moe.experts.register_forward_pre_hook(functools.partial(self._owned, i))
            moe.register_forward_hook(functools.partial(self._shadowed, i))

    def _owned(self, i: int, module, args) -> None:
        self.now[i] += args[0].shape[0]

    def _shadowed(self, i: int, moe, args, out) -> None:
        shadows = list(moe.dispatcher.placement.shadows)
        if shadows:
            stats = out[1]
            self.now[i] += float((stats.tokens_per_expert - stats.dropped_per_expert)[shadows].sum())

    def end_step(self) -> None:
        self.steps.append(self.now.clone())
        self.now.zero_()


def _bench(rank: int, world: int, text: str, scenarios, seeds, steps: int, shift_every: int, every: int) -> dict:
    """Every (scenario, seed) run in turn, in one set of rank processes (each run builds its own models)."""
    return {
        scenario: {seed: _run(rank, world, text, scenario, seed, steps, shift_every, every) for seed in seeds}
        for scenario in scenarios
    }


def _run(rank: int, world: int, text: str, scenario: str, seed: int, steps: int, shift_every: int, every: int):
    import torch.distributed as dist

    from moekit.train.step import train_step

    profiles = popularity(scenario, seed, -(-steps // shift_every))
    variants = {}
    for name, extra in VARIANTS.items():
        overrides = {**OVERRIDES, "data.path": text, "train.steps": str(steps), "train.seed": str(seed)}
        overrides |= {k: v.replace("EVERY", str(every)) for k, v in extra.items()}
        cfg = runconfig.resolve("tiny", overrides)
        pm, opt, corpus = training_rank(cfg, rank)
        if name == "static":
            first = zipf_bias(profiles[0]).tolist()
            for moe in pm.moe_layers():
                pm.rebalancer.move(moe, place_experts(first, world).expert_to_slot, opt)
        variants[name] = (cfg, pm, opt, corpus, RankRows(pm.moe_layers()))
    times = {name: [] for name in variants}
    moved = dict.fromkeys(variants, 0.0)
    routed = {name: [] for name in variants}  # rows the step's loads sent to experts, all ranks
    records = {}
    # NOTE: the variants take turns step by step (all ranks starting each step together), so the
    # machine's drift over minutes hits them alike.
    for step in range(steps):
        bias = zipf_bias(profiles[step // shift_every])
        for name, (cfg, pm, opt, corpus, rows) in variants.items():
            for moe in pm.moe_layers():
                moe.router.expert_bias.copy_(bias)
            dist.barrier()
            started = time.perf_counter()
            record = train_step(pm, opt, corpus, cfg, torch.device("cpu"), step, None)
            times[name].append(time.perf_counter() - started)
            rows.end_step()
            routed[name].append(sum(record["rank_load"]))
            moved[name] += record["placement_bytes"]
            records[name] = record
    results = {}
    for name, (*_, rows) in variants.items():
        mine = torch.stack(rows.steps)  # [steps, layers]
        every_rank = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every_rank, mine)
        per_rank = torch.stack(every_rank)  # [ranks, steps, layers]
        counted = per_rank.sum((0, 2))
        assert torch.allclose(counted, torch.tensor(routed[name], dtype=counted.dtype)), "each routed row counted once"
        factor = per_rank.amax(0) / per_rank.mean(0)  # [steps, layers] max/mean over the ranks
        results[name] = {
            "step_ms": 1e3 * statistics.mean(times[name][WARMUP:]),
            "max_mean_load": factor.mean().item(),
            "rank_rows": per_rank.sum((1, 2)).tolist(),
            "mb_moved": moved[name] / 1e6,
            "final_loss": records[name]["loss"],
        }
    return results


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[int, dict]) -> dict:
    """Per variant: median and min-max over seeds of each measure, and of its change against plain EP
    in the same seed; and the largest final-loss gap to plain EP over the seeds."""
    out = {}
    for name in VARIANTS:
        pairs = [(r[name], r["plain"]) for r in runs.values()]  # (variant, plain EP) of each seed
        out[name] = {
            "max_mean_load": _spread([r["max_mean_load"] for r, _ in pairs]),
            "step_ms": _spread([r["step_ms"] for r, _ in pairs]),
            "load_change": _spread([r["max_mean_load"] / b["max_mean_load"] - 1 for r, b in pairs]),
            "time_change": _spread([r["step_ms"] / b["step_ms"] - 1 for r, b in pairs]),
            "mb_moved": _spread([r["mb_moved"] for r, _ in pairs]),
            "loss_gap": max(abs(r["final_loss"] - b["final_loss"]) for r, b in pairs),
        }
    return out


def _fmt(s: dict, form: str) -> str:
    return f"{s['median']:{form}} [{s['min']:{form}}, {s['max']:{form}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=(*SCENARIOS, "both"), default="both")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated; at least 3 for a spread")
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--shift-every", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    scenarios = SCENARIOS if args.scenario == "both" else (args.scenario,)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"{i}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)))
        runs = run_ranks(_bench, RANKS, str(text), scenarios, seeds, args.steps, args.shift_every, args.every)
    report = {scenario: {"seeds": r, "summary": summarize(r)} for scenario, r in runs.items()}
    print(
        f"{RANKS} gloo ranks, {EXPERTS} experts, Zipf router re-drawn every {args.shift_every} of {args.steps} "
        f"steps, placement every {args.every}; seeds {seeds}: median [min, max] over seeds"
    )
    for scenario, rep in report.items():
        print(f"\n{scenario}: max/mean rank rows (measured), mean step ms (after {WARMUP} steps), change vs plain")
        print(
            f"{'variant':>8} {'max/mean':>22} {'load change':>25} {'step ms':>25} {'time change':>25} {'MB moved':>9}"
        )
        for name, s in rep["summary"].items():
            print(
                f"{name:>8} {_fmt(s['max_mean_load'], '.2f'):>22} {_fmt(s['load_change'], '+.1%'):>25} "
                f"{_fmt(s['step_ms'], '.0f'):>25} {_fmt(s['time_change'], '+.1%'):>25} {s['mb_moved']['median']:>9.1f}"
            )
        gap = max(s["loss_gap"] for s in rep["summary"].values())
        print(f"final losses: largest gap to plain over variants and seeds {gap:.1e}")
        for seed, run in rep["seeds"].items():
            cells = "  ".join(f"{n} {r['max_mean_load']:.2f} {r['step_ms']:.0f}ms" for n, r in run.items())
            print(f"  seed {seed}: {cells}")
    if args.json:
        print(json.dumps({"args": vars(args), "scenarios": report}))


if __name__ == "__main__":
    main()
