"""Training beyond memory: offloaded experts against in-memory training and the naive schedule.

    python benchmarks/train_offload.py [--json] [--steps 50] [--rounds 3] [--threads 1] [--host-regions 0]

A model whose experts' weights + gradients + AdamW moments are >= 4x ``train.memory_budget`` is
trained for ``--steps`` steps in four ways (five with ``--host-regions``), each in its own child
process (its peak RSS is the child's own ``VmHWM`` from ``/proc/self/status``, start-up included: an
offloaded run builds its experts into the file a MoE layer at a time), taking turns for
``--rounds`` rounds:

- ``memory``: every expert in RAM (the reference);
- ``offload``: ``train.memory_budget``: layer-ahead prefetch on reader threads, write-behind;
- ``sync``: the same store, budget and transfers with prefetch and write-behind off (every read and
  write waits): what the overlap alone gives;
- ``naive``: ``sync`` with the experts' AdamW step run as its own pass after each step, as
  ``optimizer.step()`` runs it (every layer's weights, gradient and moments read, the weights and
  moments written), so the next forward reads the weights again;
- ``host``: ``offload`` with a host tier (``train.host_budget``) of ``--host-regions`` regions.

Per step: median time (min .. max over rounds), bytes read and written on disk, and the bound
``max(in-memory step, bytes moved / disk bandwidth)``. The bandwidth is measured on the offload
directory the way the offload uses the disk: direct whole-region reads on ``READERS`` threads and
writes on one writer thread at the same time, in the step's read/write proportion (median of one
measurement per round, taken after the runs).
Also per step: how many expert-gradient transfers were skipped because the expert received no token
in the step (each skips its gradient's writes and reads back; ``LayerFile.experts_skipped``: an idle
expert sharing a page with a busy one moves with it and is not counted), out of all of them (layers
x experts x 2 x grad_accum).
The peak RSS limit is base + 1.1 x (budget + non-expert weights and AdamW moments + activations),
the activations being what the in-memory run holds at its peak beyond every weight and moment (its
gradients are allocated after that peak, as the backward runs, and freed by each step).
Losses of every step must equal in-memory training's bit for bit. Prints a table; with ``--json``
one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("memory", "offload", "sync", "naive", "host")
MODEL = {
    "model.n_layers": "10",
    "model.d_model": "128",
    "model.d_ff": "256",
    "model.n_heads": "4",
    "model.context_length": "64",
    "moe.num_experts": "8",
    "moe.top_k": "2",
    "train.batch_size": "8",
    "train.warmup_steps": "5",
    "train.sample_tokens": "0",
}
REGIONS = 8  # the smallest budget: 2 layers' weights and 6 gradient / moment regions


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure of this process (VmHWM: peak resident set; VmRSS: now), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(args: argparse.Namespace) -> dict:
    """One mode's run in this process: ``--steps`` steps, each timed; the figures as a dict."""
    import torch

    torch.set_num_threads(args.threads)
    base_kib = status_kib("VmRSS")  # the interpreter and torch, before any model
    from moekit import runconfig
    from moekit.train import loop
    from moekit.train.offload.engine import ExpertOffload
    from moekit.train.step import train_step

    overrides = MODEL | {"data.path": args.data, "data.cache_dir": str(Path(args.work) / "cache")}
    overrides["train.steps"] = str(args.steps)
    if args.mode != "memory":
        overrides |= {"train.memory_budget": str(args.budget), "train.offload_dir": str(Path(args.work) / args.mode)}
    if args.mode == "host":
        overrides["train.host_budget"] = str(args.host_regions * region_bytes())
    cfg = runconfig.resolve("tiny", overrides)
    run = loop._setup(cfg, Path(tempfile.mkdtemp(dir=args.work)), False, torch.device("cpu"), False, None, False)
    offload = run.experts if isinstance(run.experts, ExpertOffload) else None
    setup_kib = status_kib("VmRSS")
    if offload is not None:
        offload.ws.overlap = args.mode not in ("sync", "naive")
    times, losses, moved, skipped = [], [], [], []
    for step in range(args.steps):
        before = (
            (offload.bytes_read, offload.bytes_written, offload.file.experts_skipped["grad"]) if offload else (0, 0, 0)
        )
        started = time.perf_counter()
        record = train_step(run.pm, run.optimizer, run.corpus, cfg, run.dev, step, None, run.experts)
        if args.mode == "naive":
            offload.settle()
        times.append(time.perf_counter() - started)
        losses.append(record["loss"])
        if offload is not None:
            moved.append((offload.bytes_read - before[0], offload.bytes_written - before[1]))
            skipped.append(offload.file.experts_skipped["grad"] - before[2])
    peak_kib = status_kib("VmHWM")
    gradient_transfers = 0
    if offload is not None:
        expert = len(offload.params) * sum(torch.Size(s).numel() for s in offload.file.shapes.values())
        experts = next(iter(offload.file.shapes.values()))[0]
        gradient_transfers = len(offload.params) * experts * 2 * cfg.train.grad_accum
        offload.close()
    else:
        expert = sum(p.numel() for n, p in run.local.named_parameters() if ".experts." in n)
    plain = sum(p.numel() for n, p in run.local.named_parameters() if ".experts." not in n)
    return {
        "times_s": times,
        "losses": losses,
        "moved": moved,
        "skipped": skipped,  # expert-gradient transfers left out, per step
        "gradient_transfers": gradient_transfers,  # per step, none left out
        "peak_rss": peak_kib * 1024,
        "base_rss": base_kib * 1024,
        "setup_rss": setup_kib * 1024,
        "expert_state_bytes": 4 * 4 * expert,  # fp32 weights, gradients and two AdamW moments
        "plain_state_bytes": 4 * 4 * plain,
        "direct": bool(offload and offload.file.direct),
    }


def disk_bandwidth(directory: Path, region_bytes: int, reads: int, writes: int) -> float:
    """Bytes per second of ``reads`` region reads (``READERS`` at a time, as the reader threads do them)
    and ``writes`` region writes (one at a time, as the writer thread does them) running concurrently."""
    from concurrent.futures import ThreadPoolExecutor

    from moekit.storage.aligned import READERS
    from moekit.storage.files import StorageFile
    from moekit.train.offload.store import LayerFile

    regions = max(reads, writes)
    f = LayerFile(StorageFile.claim(directory / "bandwidth.bin"), regions, {"x": (region_bytes // 4,)})
    read_bufs = [f.buffer() for _ in range(READERS)]
    write_buf = f.buffer().fill_(1)
    try:
        for i in range(regions):  # the file's blocks exist before the timed reads, as the offload's do
            f.write(i, "weight", write_buf)
        started = time.perf_counter()
        with ThreadPoolExecutor(READERS) as readers, ThreadPoolExecutor(1) as writer:
            done = [writer.submit(f.write, i % regions, "grad", write_buf) for i in range(writes)]
            done += [readers.submit(f.read, i % regions, "weight", read_bufs[i % READERS]) for i in range(reads)]
            for future in done:
                future.result()
        return (reads + writes) * f.unit / (time.perf_counter() - started)
    finally:
        f.remove()


def run_child(mode: str, args: argparse.Namespace, budget: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--budget", str(budget), "--work", args.work]
    cmd += ["--steps", str(args.steps), "--threads", str(args.threads), "--data", args.data]
    cmd += ["--host-regions", str(args.host_regions)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def region_bytes() -> int:
    """One layer's expert weights as the offload lays them out (the budget's unit)."""
    d, f, e = int(MODEL["model.d_model"]), int(MODEL["model.d_ff"]), int(MODEL["moe.num_experts"])
    tensors = e * d * 2 * f * 4 + e * f * d * 4
    return -(-tensors // 4096) * 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per run; the first 2 are not timed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", default="/work/shared/data/tinyshakespeare.txt")
    parser.add_argument("--work", default=None, help="where runs and offloaded state go (default: a temp dir)")
    parser.add_argument("--host-regions", type=int, default=0, help="a host tier of this many regions: mode host")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    own_work = args.work is None
    args.work = args.work or tempfile.mkdtemp(prefix="moekit-train-offload-")
    budget = REGIONS * region_bytes()
    try:
        modes = MODES if args.host_regions else MODES[:-1]
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                runs[mode].append(run_child(mode, args, budget))
        read, written = (statistics.median(m[i] for m in runs["offload"][0]["moved"][2:]) for i in (0, 1))
        regions = [round(moved / region_bytes()) for moved in (read, written)]
        bandwidth = statistics.median(
            disk_bandwidth(Path(args.work), region_bytes(), *regions) for _ in runs["offload"]
        )
    finally:
        if own_work:
            shutil.rmtree(args.work, ignore_errors=True)
    report(runs, budget, read, written, bandwidth, args)


def report(runs: dict[str, list[dict]], budget: int, read: float, written: float, bandwidth: float, args) -> None:
    def step_times(mode: str) -> list[float]:  # one median step time per round
        return [statistics.median(run["times_s"][2:]) for run in runs[mode]]

    memory = statistics.median(step_times("memory"))
    first = runs["offload"][0]
    io_s = (read + written) / bandwidth
    bound = max(memory, io_s)
    expert_state, plain_state = first["expert_state_bytes"], first["plain_state_bytes"]
    # What in-memory training holds at its peak besides its activations: every weight and both AdamW
    # moments. Not its gradients: the backward allocates them after the activation peak, at its start
    # (the peak holds about 1 MB of their 34 MB), and the step frees them again.
    resident = 3 / 4 * (expert_state + plain_state)
    mem_run = runs["memory"][0]
    activations = mem_run["peak_rss"] - mem_run["base_rss"] - resident
    limit = first["base_rss"] + 1.1 * (budget + 3 / 4 * plain_state + max(activations, 0))
    same = all(run["losses"] == runs["memory"][0]["losses"] for mode in runs for run in runs[mode])
    bounds = dict.fromkeys(runs, bound)
    if "host" in runs:  # its own bound: fewer disk bytes per step
        host_read, host_written = (statistics.median(m[i] for m in runs["host"][0]["moved"][2:]) for i in (0, 1))
        bounds["host"] = max(memory, (host_read + host_written) / bandwidth)
        host_tier = args.host_regions * region_bytes()
    rows = []
    for mode in runs:
        t = step_times(mode)
        peak = [run["peak_rss"] / 1e6 for run in runs[mode]]
        rows.append(
            {
                "mode": mode,
                "step_s": {"median": statistics.median(t), "min": min(t), "max": max(t)},
                "peak_rss_mb": {"median": statistics.median(peak), "min": min(peak), "max": max(peak)},
                "x_memory": statistics.median(t) / memory,
                "x_bound": statistics.median(t) / bounds[mode],
                "disk_mb_per_step": [
                    statistics.median([m[i] for run in runs[mode] for m in run["moved"][2:]] or [0]) / 1e6
                    for i in (0, 1)
                ],
            }
        )
    print(
        f"experts' weights+grads+AdamW state {expert_state / 1e6:.1f} MB = {expert_state / budget:.1f}x "
        f"train.memory_budget {budget / 1e6:.1f} MB; direct I/O: {first['direct']}; disk {bandwidth / 1e6:.0f} MB/s "
        f"(reads and writes at once); {args.steps} steps x {args.rounds} rounds"
    )
    print(
        f"per offloaded step: {read / 1e6:.1f} MB read, {written / 1e6:.1f} MB written, I/O time {io_s * 1e3:.0f} ms; "
        f"bound max(in-memory step, I/O) = {bound * 1e3:.0f} ms"
    )
    if "host" in runs:
        print(
            f"with a host tier of {args.host_regions} regions ({host_tier / 1e6:.1f} MB, on top of the RSS limit): "
            f"{host_read / 1e6:.1f} MB read, {host_written / 1e6:.1f} MB written on disk per step; "
            f"bound {bounds['host'] * 1e3:.0f} ms"
        )
    skipped = [n for run in runs["offload"] for n in run["skipped"][2:]]
    print(
        f"expert-gradient transfers skipped per step (no token): median {statistics.median(skipped):g} "
        f"(min {min(skipped)} .. max {max(skipped)}) of {first['gradient_transfers']}"
    )
    print(
        f"{'mode':<8} {'step ms median (min .. max)':<30} {'x in-memory':>11} {'x bound':>8} {'peak RSS MB':>12} "
        f"{'MB in / out':>14}"
    )
    for row in rows:
        s = row["step_s"]
        span = f"{s['median'] * 1e3:.0f} ({s['min'] * 1e3:.0f} .. {s['max'] * 1e3:.0f})"
        print(
            f"{row['mode']:<8} {span:<30} {row['x_memory']:>11.2f} {row['x_bound']:>8.2f} "
            f"{row['peak_rss_mb']['median']:>12.0f} {'{:.0f} / {:.0f}'.format(*row['disk_mb_per_step']):>14}"
        )
    offload_s = statistics.median(step_times("offload"))
    faster = {m: statistics.median(step_times(m)) / offload_s for m in ("sync", "naive")}
    ceiling = statistics.median(step_times("naive")) / memory  # no schedule beats the in-memory step
    print(
        f"offload is {faster['naive']:.2f}x faster than naive (no schedule can be more than {ceiling:.2f}x: "
        f"naive over the in-memory step), {faster['sync']:.2f}x than its own transfers made synchronous (sync)"
    )
    print(
        f"peak RSS limit: base + 1.1 x (budget + non-expert weights and moments + the rest of in-memory "
        f"training's peak {activations / 1e6:.0f} MB: activations, data, allocator slack) = "
        f"{limit / 1e6:.0f} MB; losses of all {args.steps} steps identical to "
        f"in-memory: {same}"
    )
    if args.json:
        figures = {
            "budget_bytes": budget,
            "expert_state_bytes": expert_state,
            "disk_bw": bandwidth,
            "bytes_read_per_step": read,
            "bytes_written_per_step": written,
            "gradient_transfers_per_step": first["gradient_transfers"],
            "gradient_transfers_skipped_per_step": {
                "median": statistics.median(skipped),
                "min": min(skipped),
                "max": max(skipped),
            },
            "bound_s": bound,
            "rows": rows,
            "naive_over_offload": faster["naive"],
            "sync_over_offload": faster["sync"],
            "naive_over_memory": ceiling,
            "activations_bytes": activations,
            "rss_limit_bytes": limit,
            "losses_identical": same,
        }
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
