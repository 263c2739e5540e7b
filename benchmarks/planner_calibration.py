"""Calibrate the planner on this machine and check its ranking against measured step times.

For 2 and 4 gloo ranks on this CPU: measure the primitives the cost model uses (matmul rate per rank
with all ranks busy, all-to-all latency and bandwidth), write them as a cluster, then train a small
MoE model for a few steps in each of >= 6 layouts (same global batch) and compare the measured step
times with the planner's predictions: Spearman rank correlation per world size and over all layouts.
Timing on a shared CPU is noisy.

    python benchmarks/planner_calibration.py [--json] [--steps 6]
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks, training_rank  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.parallel import planner  # noqa: E402

GLOBAL_BATCH = 16  # sequences per step, over all data ranks
MODEL = {
    "model.n_layers": "4",
    "model.n_heads": "4",
    "model.d_model": "64",
    "model.d_ff": "128",
    "model.context_length": "64",
    "model.tie_embeddings": "false",
    "moe.num_experts": "8",
    "moe.top_k": "2",
    "train.lr": "1e-3",
    "data.tokenizer": "byte",
}
LAYOUTS = {
    2: {
        "dp2": {"parallel.dp": "2"},
        "ep2": {"parallel.ep": "2"},
        "ep2-overlap": {"parallel.ep": "2", "parallel.overlap_chunks": "2"},
        "tp2": {"parallel.tp": "2"},
        "pp2-mb2": {"parallel.pp": "2", "parallel.pp_microbatches": "2"},
        "pp2-mb8": {"parallel.pp": "2", "parallel.pp_microbatches": "8"},
    },
    4: {
        "dp4": {"parallel.dp": "4"},
        "ep4": {"parallel.ep": "4"},
        "ep2xdp2": {"parallel.ep": "2", "parallel.dp": "2"},
        "tp2xdp2": {"parallel.tp": "2", "parallel.dp": "2"},
        "tp4": {"parallel.tp": "4"},
        "pp2xdp2": {"parallel.pp": "2", "parallel.dp": "2", "parallel.pp_microbatches": "2"},
        "pp4-mb8": {"parallel.pp": "4", "parallel.pp_microbatches": "8"},
    },
}


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, every rank starting together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_cluster(world: int) -> planner.Cluster:
    """The primitives on this machine with ``world`` ranks busy at once."""
    a = torch.randn(256, 256)
    flops = 2 * 256**3 * 20 / _timed(lambda: [a @ a for _ in range(20)], 5)

    def a2a(n: int) -> float:
        x, out = torch.randn(n * world), torch.empty(n * world)
        return _timed(lambda: dist.all_to_all_single(out, x), 20)

    small, big = a2a(16), a2a(1 << 18)
    latency = small / (world - 1)
    nbytes = 4 * world * (1 << 18) * (world - 1) / world
    bandwidth = nbytes / max(big - small, 1e-9)
    return planner.Cluster(
        f"cpu-{world}",
        1,
        world,
        flops / 1e12,
        1.0,
        64.0,
        bandwidth / 1e9,
        latency * 1e6,
        bandwidth / 1e9,
        latency * 1e6,
    )


def _candidate(cfg, layout) -> planner.Candidate:
    micro = cfg.parallel.pp_microbatches if layout.pp > 1 else 1
    overlap = cfg.parallel.overlap_chunks > 1
    return planner.Candidate(layout.dp, layout.ep, layout.tp, layout.pp, micro, cfg.parallel.all_to_all, overlap)


def _bench(rank: int, world: int, text: str, steps: int) -> dict:
    from moekit.train import loop

    dist.init_process_group("gloo")
    cluster = measure_cluster(world)
    rows = []
    for name, extra in LAYOUTS[world].items():
        probe = runconfig.resolve("tiny", {**MODEL, **extra})
        batch_ranks = world // (probe.parallel.tp * probe.parallel.pp)
        overrides = {**MODEL, **extra, "data.path": text, "train.batch_size": str(GLOBAL_BATCH // batch_ranks)}
        cfg = runconfig.resolve("tiny", overrides)
        pm, opt, corpus = training_rank(cfg, rank)
        times = []
        for step in range(steps + 2):
            dist.barrier()
            started = time.perf_counter()
            loop._train_step(pm, None, opt, corpus, cfg, torch.device("cpu"), step, None)
            times.append(time.perf_counter() - started)
        spec = planner.ModelSpec(name, cfg.model, cfg.moe, planner.Workload(GLOBAL_BATCH, dtype_bytes=4))
        predicted = planner.estimate(spec, _candidate(cfg, pm.layout), cluster).step_s
        rows.append({"layout": name, "measured_s": statistics.median(times[2:]), "predicted_s": predicted})
    return {"cluster": cluster.__dict__, "rows": rows}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (no ties expected among timings)."""

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0] * len(v)
        for r, i in enumerate(order):
            out[i] = r
        return out

    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"{i}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)))
        for world in (2, 4):
            results[world] = run_ranks(_bench, world, str(text), args.steps)
    every = [r for w in results.values() for r in w["rows"]]
    summary = {
        f"spearman_{w}": spearman([r["measured_s"] for r in res["rows"]], [r["predicted_s"] for r in res["rows"]])
        for w, res in results.items()
    }
    summary["spearman_all"] = spearman([r["measured_s"] for r in every], [r["predicted_s"] for r in every])
    if args.json:
        print(json.dumps({"worlds": results, **summary}, indent=2))
        return
    for world, res in results.items():
        c = res["cluster"]
        print(
            f"{world} ranks: {c['peak_tflops'] * 1e3:.1f} GFLOP/s per rank, all-to-all {c['intra_latency_us']:.0f} us "
            f"per message, {c['intra_gbps']:.2f} GB/s"
        )
        for r in res["rows"]:
            ms, pred = r["measured_s"] * 1e3, r["predicted_s"] * 1e3
            print(f"  {r['layout']:>12} measured {ms:8.1f} ms  predicted {pred:8.1f} ms")
    print(" ".join(f"{k} {v:.2f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
