"""Offloaded inference against its bounds: a model whose experts are >= 4x the memory budget.

Builds (once, cached under /tmp) a byte-level MoE model with >= 2 GB of fp32 experts, then times
greedy generation from real-text prompts (tinyshakespeare) at batch 1 and 16 for:
  resident        every weight in memory (the upper bound)
  naive           accelerate-style: each MoE layer's experts all read on demand, no cache, no prefetch
  moekit-*        expert-granular reads through the budgeted cache (LRU / LFU, prefetch on / off), int8
Cold runs read directly (``O_DIRECT``; buffered reads on a filesystem without it are followed by
``posix_fadvise(DONTNEED)``) after the file's pages are dropped, so the page cache is no hidden fast
tier; one warm run per batch size reads through the page cache, labelled as such. Also: hit rate,
bytes read per token, the read-bandwidth bound (bandwidth at the reader pool's queue depth / bytes per
token), prefetch recall and precision, an offline replay of the recorded routing trace through each
policy and Belady's optimum, and validation perplexity of fp / int8 / int4 experts.

    python benchmarks/offload.py [--json] [--cache-dir /tmp/moekit-offload-bench] [--budget 512MB]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit import runconfig
from moekit.experts.grouped import apply_activation
from moekit.infer.cache import POLICIES, replay
from moekit.infer.expert_store import ExpertStore, aligned_empty
from moekit.infer.generate import generate, left_pad
from moekit.infer.offload import READERS, OffloadOptions, format_bytes, model_bytes, parse_bytes
from moekit.infer.quant import matmul, roles
from moekit.model import Transformer
from moekit.run.checkpoint import save_checkpoint
from moekit.run.load import load_run
from moekit.tokenizer import ByteTokenizer

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"
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


class NaiveLayerExperts(nn.Module):
    """Accelerate-style offload: every call reads all of its layer's experts, computes, forgets them."""

    def __init__(self, store: ExpertStore, block: int, num_experts: int, activation: str) -> None:
        super().__init__()
        self.store, self.block, self.activation = store, block, activation
        self.buffer = aligned_empty(num_experts * store.slot_bytes).view(num_experts, store.slot_bytes)
        self.bytes_read = 0

    def forward(self, x_RD: Tensor, tokens_per_expert: Tensor) -> Tensor:
        for e in range(self.buffer.shape[0]):
            self.bytes_read += self.store.read_into((self.block, e), self.buffer[e])
        y_RD, start = torch.empty_like(x_RD), 0
        for e, n in enumerate(tokens_per_expert.tolist()):
            if n:
                views = self.store.views((self.block, e), self.buffer[e])
                h = apply_activation(matmul("fp", views, "w_in", x_RD[start : start + n]), self.activation)
                y_RD[start : start + n] = matmul("fp", views, "w_out", h)
            start += n
        return y_RD


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


def timed(model: Transformer, text: Path, batch: int, new_tokens: int) -> tuple[Tensor, float]:
    ids, pad = prompts(text, batch)
    start = time.perf_counter()
    out = generate(model, ids, new_tokens, temperature=0, left_pad_B=pad)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_TEXT, help="prompt and validation text (tinyshakespeare)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/moekit-offload-bench"))
    parser.add_argument("--budget", default="512MB", help="memory budget of the offloaded runs")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per prompt")
    args = parser.parse_args()
    if not args.data.is_file():
        parser.error(f"--data: no such file: {args.data}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    run_dir = build_run(args.cache_dir / "run")
    budget = parse_bytes(args.budget)
    rows: list[dict] = []
    reference: dict[int, Tensor] = {}

    def offloaded(name: str, batch: int, warm: bool = False, **options) -> None:
        replayed = name == "moekit-lru+prefetch" and not warm  # its routing trace is replayed offline
        trace_len = TRACE_LEN if replayed else 0
        opts = OffloadOptions(
            memory_budget=budget, direct_io=not warm, drop_pages=not warm, record_trace=trace_len, **options
        )
        run = load_run(run_dir, offload=opts)
        off = run.offloader
        if not warm:
            off.store.drop_page_cache()
        out, seconds = timed(run.model, args.data, batch, args.new_tokens)
        off.close()
        tokens = batch * args.new_tokens
        stats = off.stats
        rows.append(
            dict(
                config=name + (" (warm page cache)" if warm else ""),
                batch=batch,
                tokens_per_s=tokens / seconds,
                hit_rate=stats.hit_rate,
                bytes_per_token=stats.bytes_read / tokens,
                recall=stats.prediction_recall if opts.prefetch == "router" else None,
                precision=stats.prediction_precision if opts.prefetch == "router" else None,
                prefetch_reads=stats.prefetch_reads,
                same_tokens=bool(torch.equal(out, reference[batch])) if opts.expert_format == "fp" else None,
                slots=off.cache.num_slots,
                reads_per_step=stats.mean_reads_per_step,
                max_reads_per_step=stats.max_reads_per_step,
            )
        )
        if replayed:
            assert len(off.trace.requests) == stats.steps * len(off.blocks), "TRACE_LEN is too short for the run"
            traces[batch] = (off.trace.routing(), off.cache.num_slots)

    traces: dict[int, tuple[list, int]] = {}
    for batch in (1, 16):
        resident = load_run(run_dir).model
        out, seconds = timed(resident, args.data, batch, args.new_tokens)
        reference[batch] = out
        rows.append(dict(config="resident", batch=batch, tokens_per_s=batch * args.new_tokens / seconds))
        resident_bytes = model_bytes(resident)
        del resident
        # naive: the same model with every MoE layer's experts read whole on each call
        run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget, prefetch="off", drop_pages=True))
        run.offloader.store.drop_page_cache()
        naive = []
        for block in run.offloader.blocks:
            moe = run.model.blocks[block].ffn
            moe.experts = NaiveLayerExperts(run.offloader.store, block, moe.cfg.num_experts, moe.cfg.activation)
            naive.append(moe.experts)
        out, seconds = timed(run.model, args.data, batch, args.new_tokens)
        run.offloader.close()
        tokens = batch * args.new_tokens
        rows.append(
            dict(
                config="naive (whole layers, no cache)",
                batch=batch,
                tokens_per_s=tokens / seconds,
                bytes_per_token=sum(n.bytes_read for n in naive) / tokens,
                same_tokens=bool(torch.equal(out, reference[batch])),
            )
        )
        for policy in ("lru", "lfu"):
            for prefetch in ("router", "off"):
                name = f"moekit-{policy}" + ("+prefetch" if prefetch == "router" else "")
                offloaded(name, batch, policy=policy, prefetch=prefetch)
        offloaded("moekit-fifo ring (prefetch all)", batch, policy="fifo", prefetch="all")
        offloaded("moekit-lru+prefetch int8", batch, policy="lru", prefetch="router", expert_format="int8")
        offloaded("moekit-lru+prefetch", batch, warm=True, policy="lru", prefetch="router")

    cfg = runconfig.from_json(run_dir / "config.json")
    blocks = dict.fromkeys(cfg.model.moe_layers(), cfg.moe.num_experts)
    weights = next(run_dir.glob("checkpoints/step_*")) / "model.safetensors"
    with ExpertStore(weights, blocks, roles("fp"), drop_pages=True) as store:
        bandwidth = read_bandwidth(store)
        direct = store.direct
    expert_bytes = len(store.pieces) * store.bytes_per_expert
    for row in rows:
        if row.get("bytes_per_token"):
            row["bound_tokens_per_s"] = bandwidth / row["bytes_per_token"]
            row["of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
    replays = {
        batch: {p: replay(trace, slots, p) for p in (*POLICIES, "belady")} for batch, (trace, slots) in traces.items()
    }
    perplexity = validation_perplexity(args.data, run_dir, budget)
    result = dict(
        expert_bytes_on_disk=expert_bytes,
        budget=budget,
        non_expert_bytes=resident_bytes - expert_bytes,
        read_bandwidth=bandwidth,
        direct_reads=direct,
        rows=rows,
        replay_hit_rates=replays,
        perplexity=perplexity,
    )
    print(json.dumps(result, indent=2) if args.json else table(result))


def validation_perplexity(text: Path, run_dir: Path, budget: int) -> dict[str, float]:
    """Perplexity of the tail of the text (teacher-forced, 255 tokens) with each expert format."""
    ids = torch.tensor([list(text.read_bytes()[-256:])])
    out = {}
    for fmt in ("fp", "int8", "int4"):
        run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget, expert_format=fmt, prefetch="off"))
        with torch.no_grad():
            logits = run.model(ids[:, :-1]).logits
        run.offloader.close()
        out[fmt] = math.exp(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item())
    return out


def cell(row: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    value = row.get(key)
    return "-" if value is None else format(value * scale, fmt)


def table(r: dict) -> str:
    lines = [
        f"experts on disk {format_bytes(r['expert_bytes_on_disk'])}, budget {format_bytes(r['budget'])} "
        f"(non-expert weights {format_bytes(r['non_expert_bytes'])}), cold read bandwidth "
        f"{format_bytes(r['read_bandwidth'])}/s ({'direct' if r['direct_reads'] else 'buffered'}, {READERS} readers)",
        f"{'config':36} {'batch':>5} {'tok/s':>8} {'hit':>6} {'MB/tok':>8} {'bound':>8} {'of bound':>8} "
        f"{'recall':>6} {'prec.':>6} {'same':>5}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['config']:36} {row['batch']:>5} {cell(row, 'tokens_per_s', '8.2f')} {cell(row, 'hit_rate', '6.1%')} "
            f"{cell(row, 'bytes_per_token', '8.1f', 1e-6)} {cell(row, 'bound_tokens_per_s', '8.2f')} "
            f"{cell(row, 'of_bound', '8.2f')} {cell(row, 'recall', '6.1%')} {cell(row, 'precision', '6.1%')} "
            f"{str(row.get('same_tokens', '-')):>5}"
        )
    for batch, rates in r["replay_hit_rates"].items():
        lines.append(f"replay batch {batch}: " + ", ".join(f"{p} {h:.1%}" for p, h in rates.items()))
    lines.append("validation perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in r["perplexity"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
