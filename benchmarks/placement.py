"""Expert placement against plain expert parallelism on a skewed, drifting router (4 gloo ranks, CPU).

The router's selection bias is set to a Zipf profile over the experts, rotated by a quarter of the
experts every ``--shift-every`` steps (the popular experts move to another rank). Each variant trains
the same model on the same batches through the training loop's own step:
  plain      expert e on rank e // El
  static     placed once, at step 0, from the first Zipf profile (never follows the drift)
  live       re-placed every ``--every`` steps from the measured loads (parallel.placement_every)
  shadows    live placement plus up to 2 shadow experts per layer (parallel.shadow_experts)
The variants take turns, one step each, so the machine's drift hits them alike. It reports mean step
time and mean max/mean rank load (rows each rank's experts compute), then the planner's simulated
step times for the cluster presets (flat vs two-level, plain vs placed, with the Zipf loads).

The experts (d_model 128, 512 hidden) are most of the step's FLOPs, as in real MoE models, so the
busiest rank's expert GEMMs matter; with 4 ranks on fewer cores, even perfect balance cannot beat
total work / cores, which caps the step-time gain below what 4 devices would show.

    python benchmarks/placement.py [--json] [--steps 90] [--shift-every 30] [--every 10]
"""

from __future__ import annotations

import argparse
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
from moekit.parallel import planner  # noqa: E402
from moekit.parallel.placement import place_experts  # noqa: E402

EXPERTS = 16
OVERRIDES = {
    "model.n_layers": "2",
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
    "parallel.ep": "4",
}
VARIANTS = {
    "plain": {},
    "static": {},
    "live": {"parallel.placement_every": "EVERY", "parallel.placement_min_gain": "0.05"},
    "shadows": {"parallel.placement_every": "EVERY", "parallel.shadow_experts": "2"},
}


def zipf_bias(shift: int, scale: float = 0.3, s: float = 1.0) -> torch.Tensor:
    """A selection bias whose top expert is ``shift``: scale / (i + 1)^s for the i-th most popular."""
    ranks = (torch.arange(EXPERTS) - shift) % EXPERTS
    return scale / (ranks.double() + 1) ** s


def _bench(rank: int, world: int, text: str, steps: int, shift_every: int, every: int) -> dict:
    import torch.distributed as dist

    from moekit.train import loop

    variants = {}
    for name, extra in VARIANTS.items():
        overrides = {**OVERRIDES, "data.path": text, "train.steps": str(steps)}
        overrides |= {k: v.replace("EVERY", str(every)) for k, v in extra.items()}
        cfg = runconfig.resolve("tiny", overrides)
        pm, opt, corpus = training_rank(cfg, rank)
        if name == "static":
            first = zipf_bias(0).tolist()
            for moe in pm.moe_layers():
                pm.rebalancer.move(moe, place_experts(first, world).expert_to_slot, opt)
        variants[name] = (cfg, pm, opt, corpus)
    times = {name: [] for name in variants}
    imbalance = {name: [] for name in variants}
    moved = dict.fromkeys(variants, 0.0)
    records = {}
    # NOTE: the variants take turns step by step (all ranks starting each step together), so the
    # machine's drift over minutes hits them alike.
    for step in range(steps):
        bias = zipf_bias((step // shift_every) * EXPERTS // 4)
        for name, (cfg, pm, opt, corpus) in variants.items():
            for moe in pm.moe_layers():
                moe.router.expert_bias.copy_(bias)
            dist.barrier()
            started = time.perf_counter()
            record = loop._train_step(pm, None, opt, corpus, cfg, torch.device("cpu"), step, None)
            times[name].append(time.perf_counter() - started)
            imbalance[name].append(record["rank_imbalance"])
            moved[name] += record["placement_bytes"]
            records[name] = record
    results = {}
    for name in variants:
        warm = times[name][5:]
        results[name] = {
            "step_ms": 1e3 * statistics.mean(warm),
            "step_ms_median": 1e3 * statistics.median(warm),
            "rank_imbalance": statistics.mean(imbalance[name]),
            "mb_moved": moved[name] / 1e6,
            "final_loss": records[name]["loss"],
        }
    return results


def simulated(loads: list[list[float]]) -> list[dict]:
    """The planner's step times for each cluster preset: best flat and two-level layouts, with the
    measured-like Zipf loads, under plain expert parallelism and after placement."""
    spec = planner.load_model("deepseek-moe-16b")
    rows = []
    for name in ("h100x8", "h100-ib-32", "h100-ib-256", "h100-ib-2048"):
        cluster = planner.load_cluster(name)
        best = planner.plan(spec, cluster, top=200)
        for form in ("flat", "two_level"):
            pick = [e for e in best if e.candidate.all_to_all == form and e.candidate.ep > 1][:1]
            if not pick:
                continue
            (r,) = planner.rescore(spec, cluster, pick, loads, remaining_steps=1000)
            c = r.estimate.candidate
            rows.append(
                {
                    "cluster": name,
                    "all_to_all": form,
                    "layout": f"dp{c.dp} ep{c.ep} tp{c.tp} pp{c.pp} mb{c.micro}{' overlap' if c.overlap else ''}",
                    "balanced_s": pick[0].step_s,
                    "plain_s": r.estimate.step_s,
                    "placed_s": r.placed.step_s,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--shift-every", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"{i}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)))
        runs = run_ranks(_bench, 4, str(text), args.steps, args.shift_every, args.every)
    zipf = [1 / (i + 1) ** 1.1 for i in range(64)]  # Zipf shares over DeepSeek-MoE's 64 experts
    sims = simulated([zipf])
    base = runs["plain"]
    for r in runs.values():
        r["imbalance_cut"] = 1 - r["rank_imbalance"] / base["rank_imbalance"]
        r["step_time_cut"] = 1 - r["step_ms"] / base["step_ms"]
    if args.json:
        print(json.dumps({"runs": runs, "simulated": sims}, indent=2))
        return
    print(f"4 gloo ranks, {EXPERTS} experts, Zipf router shifted every {args.shift_every} of {args.steps} steps")
    print(f"{'variant':>8} {'step ms':>8} {'median':>8} {'max/mean':>9} {'cut':>6} {'time cut':>9} {'MB moved':>9}")
    for name, r in runs.items():
        print(
            f"{name:>8} {r['step_ms']:>8.1f} {r['step_ms_median']:>8.1f} {r['rank_imbalance']:>9.3f} "
            f"{r['imbalance_cut']:>6.1%} {r['step_time_cut']:>9.1%} {r['mb_moved']:>9.2f}"
        )
    print("\nplanner, deepseek-moe-16b-like, Zipf(1.1) load over its 64 experts (step seconds):")
    for s in sims:
        print(
            f"{s['cluster']:>12} {s['all_to_all']:>9} {s['layout']:<32} balanced {s['balanced_s']:.3f} "
            f"plain {s['plain_s']:.3f} placed {s['placed_s']:.3f}"
        )


if __name__ == "__main__":
    main()
