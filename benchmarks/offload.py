"""Offloaded inference against its bounds: a model whose experts are >= 4x the memory budget.

Builds (once, cached under /tmp) a byte-level MoE model with >= 2 GB of fp32 experts, then times
greedy generation from real-text prompts (tinyshakespeare) at batch 1 and 16 for:
  resident        every weight in memory (the upper bound)
  naive           accelerate-style: each MoE layer's experts all read on demand, no cache, no prefetch
  moekit-*        expert-granular reads through the budgeted cache (LRU / LFU, prefetch on / off), int8
Cold runs read directly (``O_DIRECT``; buffered reads on a filesystem without it are followed by
``posix_fadvise(DONTNEED)``) after the file's pages are dropped, so the page cache is no hidden fast
tier; one warm run per batch size reads the file into the page cache first, then through it, labelled
as such. Every configuration runs --repeats times, round by round (each run cold again); tokens/s is
reported as median and min-max. Also: hit rate, bytes read per token, the read-bandwidth bound
(bandwidth at the reader pool's queue depth / bytes per token), prefetch recall and precision, and an
offline replay of the recorded routing trace through each policy and Belady's optimum. The int8 row
shows speed only (random weights say nothing of quality: see benchmarks/quant_quality.py).

``--device cuda``: the fast tier is GPU memory, the slow tier page-locked host memory filled from the file
before the clock (``storage.loaders.pinned_tier``). resident holds every weight on the GPU; moekit copies
single experts into its budgeted GPU cache on a side stream (``CudaLoader``); naive copies each MoE
layer's experts whole on every call into one layer's buffer, as one copy queued on the compute stream.
The bound is the measured pinned host->GPU copy bandwidth (a 1 GiB copy, median of 5, each round) /
bytes copied per token, naive's too. No page cache lies between pinned memory and the GPU: no warm rows.
The clock starts and stops on a synchronized device; greedy tokens are compared with resident's on the
same device. ``--json`` prints the table to stderr as well.

    python benchmarks/offload.py [--json] [--device cuda] [--budget 512MB] [--repeats 3] [--variants naive int8 ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from _naive_offload import NaiveCopiedLayerExperts, NaiveLayerExperts, pinned_layer
from torch import Tensor

from moekit import runconfig
from moekit.infer.expert_store import ExpertStore
from moekit.infer.generate import generate, left_pad
from moekit.infer.offload import OffloadOptions, model_bytes
from moekit.infer.quant import roles
from moekit.model import Transformer
from moekit.run.checkpoint import save_checkpoint
from moekit.run.load import load_run
from moekit.storage.aligned import READERS, aligned_empty
from moekit.storage.slots import POLICIES, replay
from moekit.tokenizer import ByteTokenizer
from moekit.units import format_bytes, parse_bytes

REPO = Path(__file__).resolve().parents[1]
# the shared data beside the repository, or a copy of it inside (where the repository travels alone)
TEXTS = [root / "shared" / "data" / "tinyshakespeare.txt" for root in (REPO.parent, REPO)]
# Fine-grained experts (DeepSeek-MoE, OLMoE): 128 per layer, so a batch of 16 top-2 tokens needs
# about a fifth of a layer's experts, the case expert-granular offload is for.
OVERRIDES = {
    "model.n_layers": "4",
    "model.d_model": "1024",
    "model.d_ff": "352",
    "model.n_heads": "8",
    "model.context_length": "256",
    "moe.num_experts": "128",
    "moe.top_k": "2",
}
COMPUTE_NOTE = (
    "int8/int4 experts save bytes read and cache slots, not compute: every multiply-add runs in the compute "
    "dtype. Offloaded int4 experts, and int8 ones with more than 32 rows or on a GPU, are dequantized into a "
    "full-precision weight before torch.mm (extra work per use); int8 with up to 32 rows on a CPU goes through "
    "torch._weight_int8pack_mm, which converts the weights inside the kernel. No integer GEMM yet."
)
# --variants: name -> (label, OffloadOptions fields; warm: through a filled page cache); "naive" is built apart
OFFLOADED = {
    "lru+prefetch": ("moekit-lru+prefetch", dict(policy="lru", prefetch="router")),
    "lru": ("moekit-lru", dict(policy="lru", prefetch="off")),
    "lfu+prefetch": ("moekit-lfu+prefetch", dict(policy="lfu", prefetch="router")),
    "lfu": ("moekit-lfu", dict(policy="lfu", prefetch="off")),
    "fifo-ring": ("moekit-fifo ring (prefetch all)", dict(policy="fifo", prefetch="all")),
    "int8": ("moekit-lru+prefetch int8", dict(policy="lru", prefetch="router", expert_format="int8")),
    "warm": ("moekit-lru+prefetch", dict(policy="lru", prefetch="router", warm=True)),
}
VARIANTS = ("naive", *OFFLOADED)
TRACE_LEN = 100_000  # layer requests recorded for the offline replay: far more than a run here makes


def build_run(run_dir: Path) -> Path:
    """The benchmark model's run directory (random weights; routing is what matters here)."""
    if (run_dir / "config.json").is_file():
        return run_dir
    cfg = runconfig.resolve("tiny", OVERRIDES)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    run_dir.mkdir(parents=True, exist_ok=True)
    ByteTokenizer().save(run_dir)
    save_checkpoint(run_dir, 1, model, {}, keep=1)
    (run_dir / "config.json").write_text(cfg.to_json())  # last: marks the directory complete
    return run_dir


def prompts(text: Path, batch: int, length: int = 32) -> tuple[Tensor, Tensor]:
    data = text.read_bytes()
    step = len(data) // 17
    return left_pad([list(data[i * step : i * step + length]) for i in range(batch)])


def read_bandwidth(store: ExpertStore, count: int = 48) -> float:
    """Cold bytes/s of the store's own read path over ``count`` experts, read by as many threads at
    once as the offloader's reader pool (the disk's rate at the queue depth moekit keeps)."""
    store.drop_page_cache()
    slots = [aligned_empty(store.slot_bytes) for _ in range(READERS)]
    keys = sorted(store.pieces)[:: max(1, len(store.pieces) // count)][:count]
    start = time.perf_counter()
    with ThreadPoolExecutor(READERS) as pool:
        total = sum(pool.map(lambda i: store.read_into(keys[i], slots[i % READERS]), range(len(keys))))
    return total / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on a GPU (which runs behind the host), so the clock reads it all."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a large pinned host->GPU copy (the slow tier's best rate): median of ``repeats`` after one more."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        gpu.copy_(host, non_blocking=True)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds[1:])


def timed(model: Transformer, text: Path, batch: int, new_tokens: int) -> tuple[Tensor, float]:
    device = model.embed.weight.device
    ids, pad = (t.to(device) for t in prompts(text, batch))
    synchronize(device)
    start = time.perf_counter()
    out = generate(model, ids, new_tokens, temperature=0, left_pad_B=pad)
    synchronize(device)
    return out, time.perf_counter() - start


def warm_page_cache(path: Path, chunk: int = 1 << 24) -> None:
    """Read the whole file through the OS page cache, so a buffered run's reads all hit it."""
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass


def median_row(runs: list[dict]) -> dict:
    """One row per configuration over its repeated runs: each figure's median (a ``max_`` figure's maximum,
    a flag only if it held in every run), and tokens/s with its min-max."""
    row = dict(runs[0])
    for key, value in row.items():
        if isinstance(value, bool):
            row[key] = all(r[key] for r in runs)
        elif isinstance(value, int | float) and key != "batch":  # the batch names the row
            row[key] = (max if key.startswith("max_") else statistics.median)(r[key] for r in runs)
    speeds = [r["tokens_per_s"] for r in runs]
    row.update(runs=len(runs), tokens_per_s_min=min(speeds), tokens_per_s_max=max(speeds))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    text = next((p for p in TEXTS if p.is_file()), TEXTS[0])
    parser.add_argument("--data", type=Path, default=text, help="prompt text (tinyshakespeare)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: experts in pinned host memory")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/moekit-offload-bench"))
    parser.add_argument("--budget", default="512MB", help="memory budget of the offloaded runs")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, round by round")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 on a busy machine)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="batch sizes")
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="what runs beside resident (all)"
    )
    args = parser.parse_args()
    if not args.data.is_file():
        parser.error(f"--data: no such file: {args.data}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, on_cpu = torch.device(args.device), args.device == "cpu"
    variants = [v for v in args.variants if on_cpu or v != "warm"]  # no page cache between pinned memory and GPU
    run_dir = build_run(args.cache_dir / "run")
    budget = parse_bytes(args.budget, "--budget")
    cfg = runconfig.from_json(run_dir / "config.json")
    weights = next(run_dir.glob("checkpoints/step_*")) / "model.safetensors"
    runs: dict[tuple[str, int], list[dict]] = {}
    reference: dict[int, Tensor] = {}
    traces: dict[int, tuple[list, int]] = {}
    bandwidths: list[float] = []  # cold read (cuda: pinned copy) bandwidth, measured at the start of each round
    failures: list[str] = []  # configurations that raised: reported, the others still run

    def record(
        name: str, batch: int, out: Tensor, seconds: float, compare: bool = True, bound: bool = True, **figures
    ) -> None:
        """One run's row; ``compare``: whether its tokens should equal the resident model's (the first run);
        ``bound``: whether the bandwidth measured at moekit's reads bounds it."""
        reference.setdefault(batch, out)
        same = bool(torch.equal(out, reference[batch])) if compare else None
        row = dict(config=name, batch=batch, tokens_per_s=batch * args.new_tokens / seconds, same_tokens=same)
        if bound and figures.get("bytes_per_token"):  # this round's bandwidth: it drifts on a shared machine
            row["bound_tokens_per_s"] = bandwidths[-1] / figures["bytes_per_token"]
            row["of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
        runs.setdefault((name, batch), []).append({**row, **figures})
        print(f"# {name} batch {batch}: {row['tokens_per_s']:.2f} tokens/s", file=sys.stderr, flush=True)

    def offloaded(name: str, batch: int, first_round: bool, warm: bool = False, **options) -> None:
        replayed = name == "moekit-lru+prefetch" and not warm and first_round  # its routing trace is replayed offline
        cold = on_cpu and not warm  # cuda: the file is read once into pinned memory, before the clock
        opts = OffloadOptions(
            memory_budget=budget,
            direct_io=cold,
            drop_pages=cold,
            record_trace=TRACE_LEN if replayed else 0,
            **options,
        )
        run = load_run(run_dir, args.device, offload=opts)
        off = run.offloader
        if warm:
            warm_page_cache(off.store.path)
        elif cold:
            off.store.drop_page_cache()
        try:
            out, seconds = timed(run.model, args.data, batch, args.new_tokens)
        finally:
            off.close()
        stats, tokens, router = off.stats, batch * args.new_tokens, opts.prefetch == "router"
        record(
            name + (" (warm page cache)" if warm else ""),
            batch,
            out,
            seconds,
            compare=opts.expert_format == "fp",  # quantized experts may pick other tokens
            hit_rate=stats.hit_rate,
            bytes_per_token=stats.bytes_read / tokens,
            recall=stats.prediction_recall if router else None,
            precision=stats.prediction_precision if router else None,
            prefetch_reads=stats.prefetch_reads,
            slots=off.cache.num_slots,
            reads_per_step=stats.mean_reads_per_step,
            max_reads_per_step=stats.max_reads_per_step,
        )
        if replayed:
            assert len(off.trace.requests) == stats.steps * len(off.blocks), "TRACE_LEN is too short for the run"
            traces[batch] = (off.trace.routing(), off.cache.num_slots)

    def naive(batch: int) -> None:
        """The same model with every MoE layer's experts read (cuda: copied) whole on each call."""
        opts = OffloadOptions(memory_budget=budget, prefetch="off", direct_io=on_cpu, drop_pages=on_cpu)
        run = load_run(run_dir, args.device, offload=opts)
        off = run.offloader
        layers = []
        # One layer's room, shared by the layers in turn: naive holds one layer of experts, not all of them.
        E = max(run.model.blocks[block].ffn.cfg.num_experts for block in off.blocks)
        buffer = aligned_empty(E * off.store.slot_bytes).view(E, off.store.slot_bytes)
        if not on_cpu:
            buffer = torch.empty_like(buffer, device=args.device)
        for block in off.blocks:
            moe = run.model.blocks[block].ffn
            E, activation = moe.cfg.num_experts, moe.experts.activation
            if on_cpu:
                moe.experts = NaiveLayerExperts(off.store, block, buffer[:E], activation)
            else:  # the offloader's pinned copy of the experts (CudaLoader's) is naive's source; its cache stays unused
                host_ES = pinned_layer(off.loader.host, block, E)
                moe.experts = NaiveCopiedLayerExperts(off.store, block, host_ES, buffer[:E], activation)
            layers.append(moe.experts)
        if on_cpu:
            off.store.drop_page_cache()
        try:
            out, seconds = timed(run.model, args.data, batch, args.new_tokens)
        finally:
            off.close()
        read = sum(n.bytes_read for n in layers)
        # NOTE: no bound on the CPU: reading whole layers in file order is sequential, faster than moekit's
        # scattered reads; on a GPU the bandwidth is measured on such whole, contiguous copies.
        per_token = read / (batch * args.new_tokens)
        record("naive (whole layers, no cache)", batch, out, seconds, bound=not on_cpu, bytes_per_token=per_token)

    def attempt(name: str, batch: int, run_one: Callable[[], None]) -> None:
        """Run one configuration; a failure is reported and the benchmark goes on with the others."""
        try:
            run_one()
        except Exception as err:  # one configuration's failure must not cost the others' figures
            traceback.print_exc()
            failures.append(f"{name} batch {batch}, round {len(bandwidths)}: {type(err).__name__}: {err}")
        gc.collect()  # each offloaded model pins or reads gigabytes: release them before the next one's

    resident = load_run(run_dir, args.device).model
    resident_bytes = model_bytes(resident)
    blocks = dict.fromkeys(cfg.model.moe_layers(), cfg.moe.num_experts)
    if not on_cpu:  # the CUDA context's lazy start (cuBLAS handles, kernels loaded) outside every clock
        timed(resident, args.data, 1, 2)
    gpu = None if on_cpu else torch.cuda.get_device_name(device)  # asked before an error can poison the device
    try:
        for round_ in range(args.repeats):
            first = round_ == 0
            with ExpertStore(weights, blocks, roles("fp"), drop_pages=True) as store:
                bandwidths.append(read_bandwidth(store) if on_cpu else copy_bandwidth(device))
                direct = store.direct
            for batch in args.batches:
                out, seconds = timed(resident, args.data, batch, args.new_tokens)
                record("resident", batch, out, seconds)  # first: the tokens the others must match
                for variant in variants:
                    if variant == "naive":
                        attempt(variant, batch, partial(naive, batch))
                    else:
                        label, options = OFFLOADED[variant]
                        attempt(variant, batch, partial(offloaded, label, batch, first, **options))
            print(f"# round {round_ + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    except Exception as err:  # a GPU error poisons every later call: report what was measured up to it
        if not bandwidths:
            raise
        traceback.print_exc()
        failures.append(f"stopped in round {len(bandwidths)}: {type(err).__name__}: {err}")

    expert_bytes = len(store.pieces) * store.bytes_per_expert
    rows = [median_row(r) for r in runs.values()]
    replays = {
        batch: {p: replay(trace, slots, p) for p in (*POLICIES, "belady")} for batch, (trace, slots) in traces.items()
    }
    result = dict(
        device=args.device,
        gpu=gpu,
        expert_bytes_on_disk=expert_bytes,
        budget=budget,
        non_expert_bytes=resident_bytes - expert_bytes,
        read_bandwidth=statistics.median(bandwidths),
        read_bandwidth_min=min(bandwidths),
        read_bandwidth_max=max(bandwidths),
        direct_reads=direct if on_cpu else None,
        repeats=args.repeats,
        rows=rows,
        replay_hit_rates=replays,
        failures=failures,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    print(table(result), file=sys.stderr if args.json else sys.stdout)
    if failures:
        sys.exit(1)


def cell(row: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    value = row.get(key)
    return f"{'-':>{int(fmt.split('.')[0] or 0)}}" if value is None else format(value * scale, fmt)


def table(r: dict) -> str:
    bandwidth = (
        f"{format_bytes(r['read_bandwidth'])}/s ({format_bytes(r['read_bandwidth_min'])}-"
        f"{format_bytes(r['read_bandwidth_max'])}/s"
    )
    if r["device"] == "cpu":
        tier = f"cold read bandwidth {bandwidth}, {'direct' if r['direct_reads'] else 'buffered'}, {READERS} readers)"
    else:
        tier = (
            f"on {r['gpu']}: slow tier pinned host memory (filled from the file before the clock), host->GPU copy "
            f"bandwidth {bandwidth}, 1 GiB copies); no warm rows: no page cache or O_DIRECT between pinned memory "
            "and the GPU"
        )
    lines = [
        f"experts {format_bytes(r['expert_bytes_on_disk'])}, budget {format_bytes(r['budget'])} "
        f"(non-expert weights {format_bytes(r['non_expert_bytes'])}), {tier}",
        f"median (min-max) of {r['repeats']} runs of each configuration, interleaved round by round; "
        "other figures: medians (bound: the round's bandwidth / MB per token); same: greedy tokens equal to "
        "the resident model's (on the same device) in every run",
        f"{'config':36} {'batch':>5} {'tok/s':>8} {'(min-max)':>15} {'hit':>6} {'MB/tok':>8} {'bound':>8} "
        f"{'of bound':>8} {'recall':>6} {'prec.':>6} {'same':>5}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['config']:36} {row['batch']:>5} {cell(row, 'tokens_per_s', '8.2f')} "
            f"{'(' + cell(row, 'tokens_per_s_min', '.2f') + '-' + cell(row, 'tokens_per_s_max', '.2f') + ')':>15} "
            f"{cell(row, 'hit_rate', '6.1%')} {cell(row, 'bytes_per_token', '8.1f', 1e-6)} "
            f"{cell(row, 'bound_tokens_per_s', '8.2f')} {cell(row, 'of_bound', '8.2f')} {cell(row, 'recall', '6.1%')} "
            f"{cell(row, 'precision', '6.1%')} {'-' if row.get('same_tokens') is None else str(row['same_tokens']):>5}"
        )
    for batch, rates in r["replay_hit_rates"].items():
        lines.append(f"replay batch {batch}: " + ", ".join(f"{p} {h:.1%}" for p, h in rates.items()))
    lines.append(COMPUTE_NOTE + " Quality on a trained model: benchmarks/quant_quality.py.")
    lines += [f"FAILED: {failure}" for failure in r["failures"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
