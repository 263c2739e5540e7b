"""Check the planner out of sample: calibrate on one model and rank count, then rank and measure every
layout of another model at another rank count.

Calibration: model A on ``--calibrate-ranks`` gloo ranks (default 2) measures the primitives the cost
model uses, every rank busy at once and the measurements interleaved round by round: forward +
backward at two micro-batch sizes (the FLOP rate and the fixed cost per block pass), all-to-all at
two sizes (latency and bandwidth) and the one-sequence pass sharded by FSDP (the fixed cost per FSDP
collective). Validation: model B (other width, depth and expert count) on ``--ranks`` (default 4): the
planner ranks every layout it enumerates, and every one of them trains for a few steps (same global
batch, median step time), all built at once and visited once a round in a shuffled order, two steps a
visit with the second timed (``_measure``); Spearman is also reported within each micro-batch count.
Reported per repeat (a fresh calibration and fresh measurements each): Spearman and Kendall tau-b
between predicted and measured step times over all layouts, and the top-1 regret (the measured step
time of the planner's pick over the fastest measured); then each repeat's Spearman against the median
of the other repeats' measured step times, beside its measurements' own against that median (the
ceiling for that reference).
``--calibrate-ranks 4`` leaves only the model out of sample; ``--in-sample`` calibrates on model B at
``--ranks`` instead. Timing on a shared CPU is noisy, and 4 ranks on 2 cores share them.

    python benchmarks/planner_calibration.py [--json] [--repeats 3] [--steps 3] [--seed 0] [--in-sample]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks, training_rank  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.model import Transformer  # noqa: E402
from moekit.parallel import planner  # noqa: E402
from moekit.parallel.runtime import ParallelModel, init_distributed  # noqa: E402

GLOBAL_BATCH = 8  # sequences per step, over all data ranks
COMMON = {
    "model.n_heads": "4",
    "model.context_length": "64",
    "model.tie_embeddings": "false",  # pipeline layouts need untied embeddings
    "model.vocab_size": "256",
    "moe.top_k": "2",
    "train.lr": "1e-3",
    "data.tokenizer": "byte",
}
MODEL_A = {**COMMON, "model.n_layers": "4", "model.d_model": "64", "model.d_ff": "128", "moe.num_experts": "8"}
MODEL_B = {**COMMON, "model.n_layers": "2", "model.d_model": "96", "model.d_ff": "192", "moe.num_experts": "4"}


def _spec(overrides: dict[str, str]) -> planner.ModelSpec:
    cfg = runconfig.resolve("tiny", overrides)
    return planner.ModelSpec("bench", cfg.model, cfg.moe, planner.Workload(GLOBAL_BATCH, dtype_bytes=4))


def _describe(overrides: dict[str, str]) -> str:
    o = overrides
    return f"{o['model.n_layers']} layers x d{o['model.d_model']}, {o['moe.num_experts']} experts of {o['model.d_ff']}"


# --- calibration ------------------------------------------------------------------------------------


def _interleaved(fns: list, rounds: int) -> list[float]:
    """Median seconds of each of ``fns``, run in turn for ``rounds`` rounds (every rank starting each
    together), so a machine busy with other work slows them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times, strict=True):
            dist.barrier()
            started = time.perf_counter()
            fn()
            out.append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def _calibrate(rank: int, world: int, overrides: dict[str, str]) -> planner.Cluster:
    """The primitives on this machine with ``world`` ranks busy at once (rank 0's figures): one model's
    forward + backward on 1 and 8 sequences (FLOP rate and fixed cost per block pass), all-to-all of
    two sizes (latency, bandwidth), the one-sequence pass sharded by FSDP over every rank (its
    excess over the plain pass and the bytes' alpha-beta time, per collective: the FSDP fixed cost),
    and that pass with the experts over every rank, its dispatch whole and in overlap chunks (the
    chunked one's excess over its extra messages, per extra chunk of a MoE layer: the chunk's fixed
    cost)."""
    cpu = torch.device("cpu")
    spec = _spec(overrides)
    cfg = runconfig.resolve("tiny", {**overrides, "parallel.dp": str(world)})
    layout, mesh = init_distributed(cfg, cpu)
    torch.manual_seed(0)
    model = Transformer(spec.model, spec.moe)
    torch.manual_seed(0)
    sharded = ParallelModel(Transformer(cfg.model, cfg.moe), cfg, cpu, layout, mesh)
    expert_parallel = []
    for chunks in (1, planner.OVERLAP_CHUNKS):
        ep_flags = {"parallel.dp": "1", "parallel.ep": str(world), "parallel.overlap_chunks": str(chunks)}
        ep_cfg = runconfig.resolve("tiny", {**overrides, **ep_flags})
        ep_layout, ep_mesh = init_distributed(ep_cfg, cpu)
        torch.manual_seed(0)
        expert_parallel.append(ParallelModel(Transformer(ep_cfg.model, ep_cfg.moe), ep_cfg, cpu, ep_layout, ep_mesh))
    one = torch.randint(0, spec.model.vocab_size, (1, spec.model.context_length))
    eight = torch.randint(0, spec.model.vocab_size, (8, spec.model.context_length))
    small, big = (torch.randn(n * world) for n in (16, 1 << 18))
    t1, t8, a_small, a_big, s1, whole, chunked = _interleaved(
        [
            lambda: model(one, one).loss.backward(),
            lambda: model(eight, eight).loss.backward(),
            lambda: dist.all_to_all_single(torch.empty_like(small), small),
            lambda: dist.all_to_all_single(torch.empty_like(big), big),
            lambda: sharded.forward_backward(one, one, 1.0),
            lambda: expert_parallel[0].forward_backward(one, one, 1.0),
            lambda: expert_parallel[1].forward_backward(one, one, 1.0),
        ],
        rounds=15,
    )
    dense_f, expert_f = planner.training_flops_per_token(spec)
    f1, f8 = (x.numel() * (dense_f + expert_f) for x in (one, eight))
    rate = (f8 - f1) / max(t8 - t1, 1e-9)  # FLOP/s of the GEMMs once the fixed cost is paid
    overhead = max(t1 - f1 / rate, 0.0) / spec.model.n_layers  # per block pass
    latency = a_small / (world - 1)
    bandwidth = big.numel() * big.element_size() * (world - 1) / world / max(a_big - a_small, 1e-9)
    cluster = planner.Cluster(
        f"cpu-{world}",
        nodes=1,
        gpus_per_node=world,
        peak_tflops=rate / 1e12,
        efficiency=1.0,
        memory_gb=64.0,
        intra_gbps=bandwidth / 1e9,
        intra_latency_us=latency * 1e6,
        inter_gbps=bandwidth / 1e9,
        inter_latency_us=latency * 1e6,
        pass_overhead_us=overhead * 1e6,
    )
    wire, collectives = planner.fsdp_collectives(spec, planner.Candidate(world, 1, 1, 1, 1, "flat", "none"), cluster)
    extra = planner.OVERLAP_CHUNKS - 1  # chunks beyond the first, each 4 more exchanges a MoE layer
    n_moe = len(spec.model.moe_layers())
    messages = extra * 4 * n_moe * (world - 1) * latency
    return dataclasses.replace(
        cluster,
        fsdp_overhead_us=max(s1 - t1 - wire, 0.0) / collectives * 1e6,
        chunk_overhead_us=max(chunked - whole - messages, 0.0) / (extra * n_moe) * 1e6,
    )


# --- validation -------------------------------------------------------------------------------------


def overrides_for(cand: planner.Candidate) -> dict[str, str]:
    """The run flags of one planned layout (micro-batches: pipeline ones, or gradient accumulation)."""
    per_rank = GLOBAL_BATCH // cand.dp
    flags = {
        "parallel.dp": str(cand.dp // cand.ep),  # moekit's dp excludes the ep ranks
        "parallel.ep": str(cand.ep),
        "parallel.tp": str(cand.tp),
        "parallel.pp": str(cand.pp),
        "parallel.all_to_all": cand.all_to_all,
        "parallel.overlap_chunks": str(planner.OVERLAP_CHUNKS) if cand.overlap == "forward" else "1",
    }
    if cand.pp > 1:
        return flags | {"parallel.pp_microbatches": str(cand.micro), "train.batch_size": str(per_rank)}
    return flags | {"train.grad_accum": str(cand.micro), "train.batch_size": str(per_rank // cand.micro)}


def label(cand: planner.Candidate) -> str:
    sizes = {"dp": cand.dp // cand.ep, "ep": cand.ep, "tp": cand.tp, "pp": cand.pp}
    parts = [f"{name}{size}" for name, size in sizes.items() if size > 1]
    two_level = "-2level" if cand.all_to_all == "two_level" else ""
    return "x".join(parts or ["1"]) + f"-mb{cand.micro}" + two_level + ("-overlap" if cand.overlap == "forward" else "")


def _measure(
    rank: int, world: int, overrides: dict, layouts: list[planner.Candidate], text: str, steps: int, seed: int
) -> list[list[float]]:
    """Rank 0's timed step times of each layout: every layout built first, then ``steps + 1`` rounds
    visiting each layout once, in a fresh shuffled order every round (the first round a warm-up). A visit
    runs two steps and times the second: the first brings the layout's weights and buffers back into
    the caches, as consecutive steps of a real run find them; interleaving the visits makes a machine
    busy with other work for a while slow every layout alike instead of the few measured then."""
    from moekit.train.step import train_step

    dist.init_process_group("gloo")
    built = []
    for cand in layouts:
        cfg = runconfig.resolve("tiny", {**overrides, **overrides_for(cand), "data.path": text})
        built.append((cfg, *training_rank(cfg, rank)))
    times: list[list[float]] = [[] for _ in layouts]
    shuffle = random.Random(seed)  # the same order on every rank
    for visit in range(steps + 1):
        for i in shuffle.sample(range(len(layouts)), len(layouts)):
            cfg, pm, opt, corpus = built[i]
            train_step(pm, opt, corpus, cfg, torch.device("cpu"), 2 * visit, None)
            dist.barrier()
            started = time.perf_counter()
            train_step(pm, opt, corpus, cfg, torch.device("cpu"), 2 * visit + 1, None)
            if visit:
                times[i].append(time.perf_counter() - started)
    return times


# --- rank statistics --------------------------------------------------------------------------------


def _average_ranks(v: list[float]) -> list[float]:
    """Ranks from 0, ties sharing their mean rank."""
    order = sorted(range(len(v)), key=v.__getitem__)
    out = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation of the (tie-averaged) ranks."""
    rx, ry = _average_ranks(xs), _average_ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def kendall_tau_b(xs: list[float], ys: list[float]) -> float:
    """Concordant minus discordant pairs, corrected for ties in either list."""
    signs = [(_sign(xs[i] - xs[j]), _sign(ys[i] - ys[j])) for i in range(len(xs)) for j in range(i)]
    score = sum(a * b for a, b in signs)
    return score / math.sqrt(sum(a != 0 for a, _ in signs) * sum(b != 0 for _, b in signs))


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def by_micro(ranked: list[planner.Estimate], predicted: list[float], measured: list[float]) -> dict[int, float]:
    """Spearman within each group of layouts with the same micro-batch count (of 4 layouts or more):
    more micro-batches are slower almost by themselves, so this is the ranking without that trend."""
    groups: dict[int, list[int]] = {}
    for i, est in enumerate(ranked):
        groups.setdefault(est.candidate.micro, []).append(i)
    return {
        micro: spearman([predicted[i] for i in idx], [measured[i] for i in idx])
        for micro, idx in sorted(groups.items())
        if len(idx) >= 4
    }


# --- driver -----------------------------------------------------------------------------------------


def run_once(repeat: int, args: argparse.Namespace, text: str) -> dict:
    """One fresh calibration, then every fitting layout of model B measured, interleaved (``_measure``)."""
    calib_model, calib_world = (MODEL_B, args.ranks) if args.in_sample else (MODEL_A, args.calibrate_ranks)
    measured_cluster = run_ranks(_calibrate, calib_world, calib_model)
    cores = len(os.sched_getaffinity(0))  # the ranks share this machine's cores
    cluster = dataclasses.replace(measured_cluster, name=f"cpu-{args.ranks}", gpus_per_node=args.ranks, cores=cores)
    spec = _spec(MODEL_B)
    enumerated = planner.candidates(spec, cluster)
    ranked = planner.plan(spec, cluster, top=len(enumerated))  # the planner's order, fastest first
    seed = args.seed * 1000 + repeat
    times = run_ranks(_measure, args.ranks, MODEL_B, [est.candidate for est in ranked], text, args.steps, seed)
    measured = [statistics.median(t) for t in times]
    predicted = [est.step_s for est in ranked]
    best = min(range(len(ranked)), key=measured.__getitem__)
    return {
        "cluster": dataclasses.asdict(measured_cluster),
        "enumerated": len(enumerated),
        "rows": [
            {
                "layout": label(est.candidate),
                "candidate": dataclasses.asdict(est.candidate),
                "predicted_s": est.step_s,
                "measured_s": m,
                "times_s": t,
            }
            for est, m, t in zip(ranked, measured, times, strict=True)
        ],
        "shuffle_seed": seed,
        "spearman_by_micro": by_micro(ranked, predicted, measured),
        "spearman": spearman(predicted, measured),
        "kendall_tau_b": kendall_tau_b(predicted, measured),
        "regret": measured[0] / measured[best],  # ranked[0] is the planner's pick
        "pick": label(ranked[0].candidate),
        "best": label(ranked[best].candidate),
        "measured_over_predicted": statistics.median(m / p for m, p in zip(measured, predicted, strict=True)),
    }


def _measured(repeats: list[dict]) -> list[dict[str, float]]:
    return [{row["layout"]: row["measured_s"] for row in r["rows"]} for r in repeats]


def ceiling(repeats: list[dict]) -> list[float]:
    """Spearman of each pair of repeats' measured step times, layout by layout: how well the measurements
    rank themselves, the most any prediction can reach on this machine."""
    measured = _measured(repeats)
    return [spearman(list(a.values()), [b[k] for k in a]) for i, a in enumerate(measured) for b in measured[i + 1 :]]


def against_the_others(repeats: list[dict], key: str) -> list[float]:
    """Spearman of each repeat's ``key`` ("predicted_s" or "measured_s") step times against the median of
    the other repeats' measured ones, layout by layout: a less noisy reference than one repeat, and none
    of the repeat's own measurements in it (with "measured_s", the ceiling for that reference)."""
    measured, out = _measured(repeats), []
    for i, r in enumerate(repeats):
        others = {k: statistics.median(m[k] for j, m in enumerate(measured) if j != i) for k in measured[i]}
        mine = {row["layout"]: row[key] for row in r["rows"]}
        out.append(spearman([mine[k] for k in others], list(others.values())))
    return out


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks model B's layouts are planned and run on")
    parser.add_argument("--calibrate-ranks", type=int, default=2, help="ranks model A calibrates on")
    parser.add_argument("--in-sample", action="store_true", help="calibrate on model B at --ranks instead")
    parser.add_argument("--repeats", type=int, default=3, help="calibrations + full measurements")
    parser.add_argument("--steps", type=int, default=3, help="timed visits per layout (after a warm-up round)")
    parser.add_argument(
        "--seed", type=int, default=0, help="of the measuring order (repeat r shuffles by seed * 1000 + r)"
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON on the last line")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"{i}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)))
        repeats = [run_once(r, args, str(text)) for r in range(args.repeats)]
    mode = (
        f"in-sample: calibrated on model B ({_describe(MODEL_B)}) at {args.ranks} ranks"
        if args.in_sample
        else f"out of sample: calibrated on model A ({_describe(MODEL_A)}) at {args.calibrate_ranks} ranks"
    )
    summary = {
        key: [r[key] for r in repeats] for key in ("spearman", "kendall_tau_b", "regret", "measured_over_predicted")
    }
    summary["ceiling"] = ceiling(repeats)
    many = len(repeats) > 1
    summary["spearman_vs_others"] = against_the_others(repeats, "predicted_s") if many else []
    summary["ceiling_vs_others"] = against_the_others(repeats, "measured_s") if many else []
    n = len(repeats[0]["rows"])
    print(f"{mode}; ranked: model B ({_describe(MODEL_B)}), global batch {GLOBAL_BATCH}, {args.ranks} gloo ranks")
    print(
        f"{n} of {repeats[0]['enumerated']} enumerated layouts fit; all {n} measured, {args.steps} timed visits each "
        "(two steps a visit, the second timed)"
    )
    for i, r in enumerate(repeats):
        c = r["cluster"]
        print(
            f"repeat {i}: {c['peak_tflops'] * 1e3:.1f} GFLOP/s per rank, {c['pass_overhead_us'] / 1e3:.2f} ms per "
            f"block pass, {c['fsdp_overhead_us'] / 1e3:.2f} ms per FSDP collective, "
            f"{c['chunk_overhead_us'] / 1e3:.2f} ms per overlap chunk, all-to-all "
            f"{c['intra_latency_us']:.0f} us per message, {c['intra_gbps']:.2f} GB/s | Spearman {r['spearman']:.2f} "
            f"Kendall {r['kendall_tau_b']:.2f} regret {r['regret']:.2f} (pick {r['pick']}, best {r['best']}); "
            "within micro-batch counts " + ", ".join(f"mb{k} {v:.2f}" for k, v in r["spearman_by_micro"].items())
        )
    print(f"{'layout (repeat 0 planner order)':>34} {'predicted ms (median)':>22} {'measured ms (min-max)':>24}")
    by_layout = [{row["layout"]: row for row in r["rows"]} for r in repeats]
    for row in repeats[0]["rows"]:
        ms = sorted(rows[row["layout"]]["measured_s"] * 1e3 for rows in by_layout)
        pred = statistics.median(rows[row["layout"]]["predicted_s"] * 1e3 for rows in by_layout)
        spread = f"{statistics.median(ms):.1f} ({ms[0]:.1f}-{ms[-1]:.1f})"
        print(f"{row['layout']:>34} {pred:>22.1f} {spread:>24}")
    print(" ".join(f"{k} {_spread(v)}" for k, v in summary.items() if v), f"(min-max over {len(repeats)} repeats;")
    print("ceiling: Spearman of one repeat's measured step times against another's, over each pair of repeats;")
    print("*_vs_others: each repeat's predicted (measured) step times against the median of the other repeats'")
    print("measured ones)")
    if args.json:
        settings = {
            "ranks": args.ranks,
            "calibrate_ranks": args.calibrate_ranks,
            "steps": args.steps,
            "seed": args.seed,
        }
        print(json.dumps({"mode": mode, "model_b": MODEL_B, **settings, "repeats": repeats, **summary}))


if __name__ == "__main__":
    main()
