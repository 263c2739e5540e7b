"""Measured rate of the experts' grouped GEMMs at the planner presets' expert shapes, on this device.

    python benchmarks/expert_gemm_rates.py --device cuda [--out rates.json] [--rows 64,...] [--json]
    python benchmarks/expert_gemm_rates.py --fit rates.json [more.json ...]   # the planner's two constants

For each model preset's expert shape (d_model k, expert width n) and rows per expert m, times
moekit's expert FFN (``expert_ffn``: SwiGLU, gate and up fused in one [k, 2n] grouped GEMM, down
[n, k]) over ``--experts`` experts of m rows each, bf16 on CUDA (fp32 on a CPU), forward and
forward+backward (input and weight gradients), and one dense ``[G*m, k] @ [k, 2n]`` matmul of the
same rows as the dense-GEMM reference. TFLOP/s counts 6*m*k*n per expert forward and three times
that forward+backward. On CUDA each figure is the median of ``--reps`` calls timed with CUDA events
after ``--warmup`` untimed ones, over fresh random inputs per point (not zeros). The planner reads
the JSON (``--out``) as its measured expert-GEMM rates; the rows per expert a layout gives are
tokens per micro-batch x top-k x ep / experts.

``--fit`` reads such tables (several ``--experts`` counts belong together) and fits the planner's
small-GEMM constants: a grouped GEMM of m rows an expert and w multiply-adds over its G experts
(G * m * k * n) runs at m / (m + gemm_half_rows) x w / (w + gemm_half_work) of the large-GEMM rate,
each shape's forward+backward rate taken relative to its best, by least squares of the logs on a grid;
and ``expert_efficiency``, the large grouped GEMMs' rate over the device's peak.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

import torch

from moekit.experts.grouped import Activation, expert_ffn
from moekit.parallel.planner.presets import load_model
from moekit.train.peak import gpu_peak_tflops

ROWS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def preset_shapes() -> dict[str, tuple[int, int]]:
    """(d_model, expert width) of every model preset, by name."""
    folder = resources.files("moekit.configs").joinpath("models")
    names = sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))
    return {name: (spec.model.d_model, spec.moe.d_ff) for name in names for spec in [load_model(name)]}


def timed(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of ``fn()`` (device events on CUDA, the host clock after a sync elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(k: int, n: int, m: int, experts: int, device: torch.device, dtype: torch.dtype, warmup: int, reps: int):
    g = torch.Generator(device).manual_seed(m * 7 + k)
    x = torch.randn(experts * m, k, device=device, dtype=dtype, generator=g)
    w_in = (torch.randn(experts, k, 2 * n, device=device, dtype=dtype, generator=g) * k**-0.5).requires_grad_()
    w_out = (torch.randn(experts, n, k, device=device, dtype=dtype, generator=g) * n**-0.5).requires_grad_()
    counts = torch.full((experts,), m, device=device, dtype=torch.int64)
    act = Activation("swiglu")
    xg = x.clone().requires_grad_()
    probe = torch.randn(experts * m, k, device=device, dtype=dtype, generator=g)

    def fwd() -> None:
        with torch.no_grad():
            expert_ffn(x, w_in, w_out, counts, act, "auto")

    def fwd_bwd() -> None:
        w_in.grad = w_out.grad = xg.grad = None
        expert_ffn(xg, w_in, w_out, counts, act, "auto").backward(probe)

    w_dense = w_in[0].detach()

    def dense() -> None:
        torch.mm(x, w_dense)

    flops = 6 * experts * m * k * n
    return {
        "fwd_tflops": flops / timed(fwd, device, warmup, reps) / 1e12,
        "fwd_bwd_tflops": 3 * flops / timed(fwd_bwd, device, warmup, reps) / 1e12,
        "dense_tflops": (2 * experts * m * k * 2 * n) / timed(dense, device, warmup, reps) / 1e12,
    }


def fit_size_factor(points: list[dict]) -> tuple[float, float, float]:
    """The planner's (gemm_half_rows, gemm_half_work) closest to the measured forward+backward rates,
    each over its shape's best, by least squares of the logs on a grid; and the fit's rms log error."""
    best: dict[tuple[int, int], float] = {}
    for p in points:
        best[p["k"], p["n"]] = max(best.get((p["k"], p["n"]), 0.0), p["fwd_bwd_tflops"])
    relative = [
        (p["m"], p["experts"] * p["m"] * p["k"] * p["n"], math.log(p["fwd_bwd_tflops"] / best[p["k"], p["n"]]))
        for p in points
    ]

    def error(h: float, w: float) -> float:
        return sum((r - math.log(m / (m + h) * work / (work + w))) ** 2 for m, work, r in relative)

    grid = [(2 ** (i / 4), 10 ** (j / 16)) for i in range(0, 4 * 13) for j in range(16 * 7, 16 * 12)]
    h, w = min(grid, key=lambda hw: error(*hw))
    return h, w, math.sqrt(error(h, w) / len(relative))


def large_gemm_efficiency(points: list[dict], peak: float) -> float:
    """The planner's ``expert_efficiency``: the median over shapes of each shape's best forward+backward
    rate, over the device's peak."""
    best: dict[tuple[int, int], float] = {}
    for p in points:
        best[p["k"], p["n"]] = max(best.get((p["k"], p["n"]), 0.0), p["fwd_bwd_tflops"])
    return statistics.median(best.values()) / peak


def print_fit(paths: list[str]) -> None:
    points, devices = [], set()
    for path in paths:
        table = json.loads(Path(path).read_text())
        points += [dict(p, experts=table["experts"]) for p in table["points"]]
        devices.add(table["device"])
        print(f"{path}: {table['device']}, {table['dtype']}, {table['experts']} experts per grouped GEMM")
    h, w, rms = fit_size_factor(points)
    print(f"gemm_half_rows = {h:.0f}, gemm_half_work = {w:.3g} (rms log error {rms:.2f}, {len(points)} points)")
    peak = gpu_peak_tflops(devices.pop(), "bf16") if len(devices) == 1 else None
    if peak:
        print(f"expert_efficiency = {large_gemm_efficiency(points, peak):.2f} (of a {peak:g} TFLOP/s peak)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (fp32; for a quick check only)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per expert, comma-separated")
    parser.add_argument("--experts", type=int, default=8, help="experts per grouped GEMM (local experts)")
    parser.add_argument("--models", default="", help="comma-separated model presets (default: all)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--json", action="store_true", help="print the JSON on the last line")
    parser.add_argument("--fit", metavar="TABLE", nargs="+", help="fit the planner's constants to tables, and stop")
    args = parser.parse_args()
    if args.fit:
        return print_fit(args.fit)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = preset_shapes()
    models = args.models.split(",") if args.models else list(shapes)
    unknown = sorted(set(models) - set(shapes))
    if unknown:
        parser.error(f"--models: unknown preset(s) {', '.join(unknown)}; presets: {', '.join(shapes)}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = dict(device=name, torch=torch.__version__, dtype=str(dtype).removeprefix("torch."), experts=args.experts)
    points = []
    print(f"{name}, {table['dtype']}, {args.experts} experts per grouped GEMM; TFLOP/s, median of {args.reps}")
    print(f"{'model':18} {'k':>5} {'n':>6} {'rows':>6} {'fwd':>7} {'fwd+bwd':>8} {'dense':>7}")
    done: dict[tuple[int, int], str] = {}
    for model in models:
        k, n = shapes[model]
        if (k, n) in done:  # two presets with one expert shape: measured once
            print(f"{model:18} {k:5} {n:6}   as {done[k, n]}")
            continue
        done[k, n] = model
        for m in map(int, args.rows.split(",")):
            try:
                rates = measure(k, n, m, args.experts, device, dtype, args.warmup, args.reps)
            except torch.OutOfMemoryError:
                print(f"{model:18} {k:5} {n:6} {m:6}   out of memory", file=sys.stderr)
                torch.cuda.empty_cache()
                continue
            points.append(dict(k=k, n=n, m=m, **rates))
            print(
                f"{model:18} {k:5} {n:6} {m:6} {rates['fwd_tflops']:7.1f} {rates['fwd_bwd_tflops']:8.1f} "
                f"{rates['dense_tflops']:7.1f}",
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    table["points"] = points
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
    if args.json:
        print(json.dumps(table))


if __name__ == "__main__":
    main()
