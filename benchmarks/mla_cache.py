"""MLA's latent KV cache (contiguous, and the paged one ``moekit serve`` allocates) against the naive
cache of expanded keys and values: bytes per token and decode tokens/s of the same model.

    python benchmarks/mla_cache.py [--json] [--rounds 5] [--context 256 1024] [--batch 1 8] [--steps 16] [--threads 1]

Bytes per token are read off the allocated caches (``KVCache.bytes_per_token``), for the benchmark
model and for models with DeepSeek-V2's and V3's attention shapes (built with a context of 8 tokens,
so the naive cache fits), and off a serving pool (``moekit.serve.kv.KVPool``) of the same model.
Decode: a dense model (so only attention differs) with DeepSeek's head proportions prefills a random
prompt of ``context`` tokens, then ``steps`` greedy decode steps are timed from a copy of the prefilled
cache; the latent cache decodes in the absorbed form, the naive one attends over expanded keys and
values. The two run interleaved round by round in one process
(median and min-max over rounds).
Prints a table; with ``--json`` one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _spread import show, spread  # noqa: E402

from moekit.config import ModelConfig  # noqa: E402
from moekit.model import KVCache, Transformer  # noqa: E402
from moekit.serve.kv import KVPool  # noqa: E402

# Attention shapes of published configs (config.json of deepseek-ai/DeepSeek-V2 and DeepSeek-V3).
PUBLISHED = {
    "DeepSeek-V2": dict(n_layers=60, n_heads=128, d_model=5120, q_lora_rank=1536),
    "DeepSeek-V3": dict(n_layers=61, n_heads=128, d_model=7168, q_lora_rank=1536),
}
DEEPSEEK_HEADS = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# The decode model: DeepSeek's per-head proportions at a quarter of the width, 16 heads.
BENCH = dict(
    n_layers=4,
    n_heads=16,
    d_model=1024,
    d_ff=1024,
    vocab_size=512,
    attention="mla",
    q_lora_rank=384,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    moe_every=0,
)


def cache_bytes(cfg: ModelConfig) -> tuple[int, int, int]:
    """(latent, paged latent, expanded) cache bytes per token, fp32, of allocated caches: the paged one is
    a serving pool of 4 blocks of 16 positions, its bytes over its positions."""
    cpu = torch.device("cpu")
    latent = KVCache(cfg, 1, cpu, torch.float32).bytes_per_token()
    pool = KVPool(cfg, 4, 16, cpu, torch.float32)
    paged = sum(t.nbytes for t in (*pool.keys, *pool.values)) // (pool.num_blocks * pool.block_size)
    return latent, paged, KVCache(cfg, 1, cpu, torch.float32, mla_expanded=True).bytes_per_token()


@torch.no_grad()
def prefilled(model: Transformer, prompt_BL: torch.Tensor, expanded: bool) -> tuple[KVCache, torch.Tensor]:
    """A cache holding ``prompt_BL`` and the first greedy token."""
    cache = KVCache(model.cfg, prompt_BL.shape[0], prompt_BL.device, torch.float32, mla_expanded=expanded)
    return cache, model(prompt_BL, cache=cache).logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def decode_seconds(model: Transformer, start: tuple[KVCache, torch.Tensor], steps: int) -> float:
    """Seconds for ``steps`` greedy decode steps from a copy of a prefilled cache."""
    cache, token = copy.deepcopy(start)
    started = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024], help="prompt tokens before decoding")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sizes = []
    for name, shape in {"bench model": BENCH, **PUBLISHED}.items():
        fields = shape if name == "bench model" else dict(shape, attention="mla", context_length=8, **DEEPSEEK_HEADS)
        latent, paged, expanded = cache_bytes(ModelConfig(**{**fields, "context_length": 8}))
        saved = 1 - latent / expanded
        sizes.append({"model": name, "latent": latent, "paged": paged, "expanded": expanded, "saved": saved})
    print(f"{'cache bytes/token (fp32)':<26} {'latent':>10} {'paged latent':>12} {'expanded':>12} {'smaller by':>10}")
    for s in sizes:
        print(f"{s['model']:<26} {s['latent']:>10,} {s['paged']:>12,} {s['expanded']:>12,} {s['saved']:>10.1%}")

    rows = []
    for context in args.context:
        cfg = ModelConfig(**BENCH, context_length=context + args.steps)
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
        for batch in args.batch:
            prompt = torch.randint(0, cfg.vocab_size, (batch, context), generator=torch.Generator().manual_seed(1))
            starts = {kind: prefilled(model, prompt, expanded=kind == "expanded") for kind in ("latent", "expanded")}
            times: dict[str, list[float]] = {kind: [] for kind in starts}
            decode_seconds(model, starts["latent"], 2)  # warm-up
            for _ in range(args.rounds):
                for kind, start in starts.items():
                    times[kind].append(decode_seconds(model, start, args.steps))
            tps = {k: [batch * args.steps / t for t in v] for k, v in times.items()}
            ratio = [e / lat for lat, e in zip(times["latent"], times["expanded"], strict=True)]
            rows.append(
                {
                    "context": context,
                    "batch": batch,
                    "latent_tok_s": spread(tps["latent"], 1),
                    "expanded_tok_s": spread(tps["expanded"], 1),
                    "speedup": spread(ratio, 3),
                }
            )
            print(
                f"context {context:>5} batch {batch:>2}: latent+absorbed {show(tps['latent'], '.1f')} tok/s, "
                f"expanded {show(tps['expanded'], '.1f')} tok/s, speed-up {show(ratio, '.2f')}x"
            )
    if args.json:
        meta = {"threads": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps, "model": BENCH}
        json.dump({"device": "cpu", **meta, "cache_bytes": sizes, "decode": rows}, sys.stdout)
        print()


if __name__ == "__main__":
    main()
