"""Calibrate the planner on this machine and check its ranking against measured step times.

For 2 and 4 gloo ranks on this CPU: measure the primitives the cost model uses, with every rank busy
at once (the model's forward + backward at two micro-batch sizes gives the FLOP rate and the fixed
per-block overhead; all-to-all at two sizes gives latency and bandwidth; the same pass sharded by
FSDP gives the fixed cost of its collectives), write them as a cluster,
rank every layout the planner enumerates for a small MoE model, then train the top, the bottom and
evenly spaced layouts between for a few steps each (same global batch) and compare the measured step
times with the predictions: Spearman rank correlation per world size and over all layouts run.
Timing on a shared CPU is noisy, and 4 ranks on 2 cores share them.

    python benchmarks/planner_calibration.py [--json] [--steps 6] [--layouts 7]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from moekit.model import Transformer  # noqa: E402
from moekit.parallel import planner  # noqa: E402
from moekit.parallel.runtime import ParallelModel, init_distributed  # noqa: E402

GLOBAL_BATCH = 16  # sequences per step, over all data ranks
MODEL = {
    "model.n_layers": "4",
    "model.n_heads": "4",
    "model.d_model": "64",
    "model.d_ff": "128",
    "model.context_length": "64",
    "model.tie_embeddings": "false",
    "model.vocab_size": "256",
    "moe.num_experts": "8",
    "moe.top_k": "2",
    "train.lr": "1e-3",
    "data.tokenizer": "byte",
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


def measure_cluster(world: int, spec: planner.ModelSpec) -> planner.Cluster:
    """The primitives on this machine with ``world`` ranks busy at once."""
    torch.manual_seed(0)
    model = Transformer(spec.model, spec.moe)
    dense_f, expert_f = planner.training_flops_per_token(spec)
    one = torch.randint(0, spec.model.vocab_size, (1, spec.model.context_length))
    eight = torch.randint(0, spec.model.vocab_size, (8, spec.model.context_length))
    t1, t8 = (_timed(lambda x=x: model(x, x).loss.backward(), 7) for x in (one, eight))
    f1, f8 = (x.numel() * (dense_f + expert_f) for x in (one, eight))
    rate = (f8 - f1) / max(t8 - t1, 1e-9)  # FLOP/s of the GEMMs once the fixed cost is paid
    overhead = max(t1 - f1 / rate, 0.0) / spec.model.n_layers  # per block pass

    def a2a(n: int) -> float:
        x, out = torch.randn(n * world), torch.empty(n * world)
        return _timed(lambda: dist.all_to_all_single(out, x), 20)

    small, big = a2a(16), a2a(1 << 18)
    latency = small / (world - 1)
    bandwidth = 4 * world * (1 << 18) * (world - 1) / world / max(big - small, 1e-9)
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
    return dataclasses.replace(cluster, fsdp_overhead_us=fsdp_overhead(world, spec, cluster, t1) * 1e6)


def fsdp_overhead(world: int, spec: planner.ModelSpec, cluster: planner.Cluster, plain_s: float) -> float:
    """Seconds per FSDP collective beyond alpha-beta: the same one-sequence forward + backward sharded
    over every rank, less the unsharded one and the bytes' predicted time, per collective."""
    cpu = torch.device("cpu")
    cfg = runconfig.resolve("tiny", {**MODEL, "parallel.dp": str(world)})
    layout, mesh = init_distributed(cfg, cpu)
    torch.manual_seed(0)
    pm = ParallelModel(Transformer(cfg.model, cfg.moe), cfg, cpu, layout, mesh)
    x = torch.randint(0, spec.model.vocab_size, (1, spec.model.context_length))
    sharded_s = _timed(lambda: pm.forward_backward(x, x, 1.0), 7)
    wire, collectives = planner.fsdp_collectives(spec, planner.Candidate(world, 1, 1, 1, 1, "flat", False), cluster)
    return max(sharded_s - plain_s - wire, 0.0) / collectives


def picks(ranked: list[planner.Estimate], count: int) -> list[planner.Estimate]:
    """The top, the bottom and evenly spaced layouts between, from the planner's ranking."""
    if len(ranked) <= count:
        return ranked
    return [ranked[round(i * (len(ranked) - 1) / (count - 1))] for i in range(count)]


def overrides_for(cand: planner.Candidate) -> dict[str, str]:
    """The run flags of one planned layout (micro-batches: pipeline ones, or gradient accumulation)."""
    per_rank = GLOBAL_BATCH // (cand.dp * cand.ep)
    flags = {
        "parallel.dp": str(cand.dp),
        "parallel.ep": str(cand.ep),
        "parallel.tp": str(cand.tp),
        "parallel.pp": str(cand.pp),
        "parallel.all_to_all": cand.all_to_all,
        "parallel.overlap_chunks": "2" if cand.overlap else "1",
    }
    if cand.pp > 1:
        return flags | {"parallel.pp_microbatches": str(cand.micro), "train.batch_size": str(per_rank)}
    return flags | {"train.grad_accum": str(cand.micro), "train.batch_size": str(per_rank // cand.micro)}


def label(cand: planner.Candidate) -> str:
    parts = [f"{name}{getattr(cand, name)}" for name in ("dp", "ep", "tp", "pp") if getattr(cand, name) > 1]
    return "x".join(parts or ["1"]) + f"-mb{cand.micro}" + ("-overlap" if cand.overlap else "")


def _bench(rank: int, world: int, text: str, steps: int, count: int) -> dict:
    from moekit.train import loop

    dist.init_process_group("gloo")
    base = runconfig.resolve("tiny", MODEL)
    spec = planner.ModelSpec("calibration", base.model, base.moe, planner.Workload(GLOBAL_BATCH, dtype_bytes=4))
    shared = [measure_cluster(world, spec)]
    dist.broadcast_object_list(shared, src=0)  # rank 0's figures, so every rank picks the same layouts
    cluster = shared[0]
    ranked = sorted(
        (planner.estimate(spec, cand, cluster) for cand in planner.candidates(spec, cluster)), key=lambda e: e.step_s
    )
    rows = []
    for est in picks(ranked, count):
        cfg = runconfig.resolve("tiny", {**MODEL, **overrides_for(est.candidate), "data.path": text})
        pm, opt, corpus = training_rank(cfg, rank)
        times = []
        for step in range(steps + 2):
            dist.barrier()
            started = time.perf_counter()
            loop._train_step(pm, None, opt, corpus, cfg, torch.device("cpu"), step, None)
            times.append(time.perf_counter() - started)
        rows.append(
            {"layout": label(est.candidate), "measured_s": statistics.median(times[2:]), "predicted_s": est.step_s}
        )
    return {"cluster": cluster.__dict__, "candidates": len(ranked), "rows": rows}


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
    parser.add_argument("--steps", type=int, default=6, help="timed steps per layout (after 2 warm-up steps)")
    parser.add_argument("--layouts", type=int, default=7, help="layouts run per world size (top, bottom, between)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"{i}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)))
        for world in (2, 4):
            results[world] = run_ranks(_bench, world, str(text), args.steps, args.layouts)
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
            f"{world} ranks: {c['peak_tflops'] * 1e3:.1f} GFLOP/s per rank, {c['pass_overhead_us'] / 1e3:.2f} ms per "
            f"block pass, {c['fsdp_overhead_us'] / 1e3:.2f} ms per FSDP collective, all-to-all "
            f"{c['intra_latency_us']:.0f} us per message, {c['intra_gbps']:.2f} GB/s; "
            f"{len(res['rows'])} of {res['candidates']} planned layouts run"
        )
        for r in res["rows"]:
            ms, pred = r["measured_s"] * 1e3, r["predicted_s"] * 1e3
            print(f"  {r['layout']:>22} measured {ms:8.1f} ms  predicted {pred:8.1f} ms")
    print(" ".join(f"{k} {v:.2f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
