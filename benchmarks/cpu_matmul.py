"""The CPU kernels inference chooses between, timed on this machine: the figures behind
``moekit.experts.matmul``, ``moekit.infer.quant``, ``moekit.model.sdpa`` and docs/inference.md.

    python benchmarks/cpu_matmul.py [--threads 1] [--rows 1 2 4 8 16 32 64 512] [--rounds 5] [--json]

Matmuls: ``--weights`` distinct 1024 x 4096 weights (more than the last-level cache holds, so each is
read from memory, as a model's are), every layout and kernel, ms per weight by rows; median (min-max)
of the rounds, each round visiting the kernels in turn. CPU time of this thread with one thread (a
shared machine's other work then costs less), wall time with more. Attention: SDPA against the
one-query path (bf16, 16 heads over 4 key/value groups, head dim 64) by sequences and positions.
Overhead: a batch-1 decode step of the d1024 layout at width 64 (what a step pays besides its weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _provenance import source_commit

from moekit.experts.matmul import mm, native_16bit, packed_linear, prepack, unpacked_linear
from moekit.hostmem import keep_freed_memory
from moekit.infer.quant import dequantize_int8, int4_mm, int8_mm, pack_int4_for_cpu, quantize_int8
from moekit.kernels import rows_available, rows_bf16, rows_isa
from moekit.model.sdpa import one_query

K, N = 1024, 4096


def kernels(weights_NK: list[torch.Tensor]) -> dict[str, Callable[[torch.Tensor], object]]:
    """name -> f(x [rows, K] fp32) running the kernel over every weight."""
    bf16 = [w.bfloat16() for w in weights_NK]
    fp16 = [w.half() for w in weights_NK]
    fp32_kn = [w.t().contiguous() for w in weights_NK]
    packed32 = [prepack(w) for w in weights_NK]
    packed32_one_row = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights_NK]
    q8 = [quantize_int8(w.t()) for w in weights_NK]
    q4 = [pack_int4_for_cpu(w.t()) for w in weights_NK]

    def gemv_off(x, ws):
        with torch.backends.mkldnn.flags(enabled=False):
            return [torch.mm(x, w.t()) for w in ws]

    table = {
        "fp32 [K,N] mm": lambda x: [torch.mm(x, w) for w in fp32_kn],
        "fp32 prepacked": lambda x: [packed_linear(x, p) for p in packed32],
        "fp32 prepacked for one row": lambda x: [packed_linear(x, p) for p in packed32_one_row],
        "fp32 unpacked_linear (offloaded)": lambda x: [unpacked_linear(x, w) for w in weights_NK],
        "bf16 [N,K] oneDNN": lambda x: [torch.mm(x.bfloat16(), w.t()) for w in bf16],
        "bf16 [N,K] ATen GEMV": lambda x: gemv_off(x.bfloat16(), bf16),
        "fp16 [N,K] mm": lambda x: [torch.mm(x.half(), w.t()) for w in fp16],
        "fp16 upcast": lambda x: [torch.mm(x, w.float().t()) for w in fp16],
        "int8 (int8_mm)": lambda x: [int8_mm(x.bfloat16(), q, s) for q, s in q8],
        "int8 torch kernel": lambda x: [torch._weight_int8pack_mm(x.bfloat16(), q, s.bfloat16()) for q, s in q8],
        "bf16 mm (upcast from 6 rows without native bf16)": lambda x: [mm(x.bfloat16(), w.t()) for w in bf16],
        "int8 dequantised + mm": lambda x: [
            torch.mm(x.bfloat16(), dequantize_int8(q, s, torch.bfloat16)) for q, s in q8
        ],
        "int4 kernel": lambda x: [int4_mm(x.bfloat16(), p, s) for p, s in q4],
    }
    if native_16bit(torch.bfloat16):  # oneDNN packs bf16 only where it has native kernels (AVX-512, AMX)
        packed16 = [prepack(w) for w in bf16]
        table["bf16 prepacked"] = lambda x: [packed_linear(x.bfloat16(), p) for p in packed16]
        table["bf16 unpacked_linear (offloaded)"] = lambda x: [unpacked_linear(x.bfloat16(), w) for w in bf16]
        # without native bf16 a [K, N] weight takes 13-40x its bytes' time: minutes
        bf16_kn = [w.t().contiguous() for w in bf16]
        table["bf16 [K,N] mm"] = lambda x: [torch.mm(x.bfloat16(), w) for w in bf16_kn]
    if rows_available():  # moekit.kernels' row kernel over the plain [N, K] weight (inference's, up to FEW_ROWS rows)
        table["bf16 rows kernel"] = lambda x: [rows_bf16(x.bfloat16(), w) for w in bf16]
    return table


def clock(threads: int) -> Callable[[], float]:
    return time.thread_time if threads == 1 else time.perf_counter


def matmul_table(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(N, K, generator=gen) * 0.02 for _ in range(args.weights)]
    table = kernels(weights)
    now = clock(args.threads)
    out: dict = {}
    for rows in args.rows:
        x = torch.randn(rows, K, generator=gen)
        times: dict[str, list[float]] = {name: [] for name in table}
        for f in table.values():
            f(x)  # warm
        for _ in range(args.rounds):
            for name, f in table.items():
                t = now()
                f(x)
                times[name].append((now() - t) / len(weights) * 1e3)
        out[rows] = {name: (statistics.median(v), min(v), max(v)) for name, v in times.items()}
    return out


def attention_table(args) -> dict:
    """ms per layer: SDPA and the one-query path over keys already gathered, and a serving step's whole
    attention (``PagedStep.attend``: this step's keys and values written to the pool, each sequence's
    blocks gathered, the one-query path) over a pool of those sequences' blocks, in bf16 and fp32."""
    now, out = clock(args.threads), {}
    for B, S in ((1, 64), (16, 64), (64, 128), (64, 512)):
        q = torch.randn(B, 16, 1, 64).bfloat16()
        k, v = (torch.randn(B, S, 4, 64).bfloat16().transpose(1, 2) for _ in range(2))
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        calls = {
            "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),  # noqa: B023
            "one-query": lambda: one_query(q, k, v, mask, 0.125),  # noqa: B023
            **{f"paged step {name}": paged_attention(B, S, dtype) for name, dtype in PAGED_DTYPES.items()},
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, f in calls.items():
                f()
                t = now()
                for _ in range(5):
                    f()
                times[name].append((now() - t) / 5 * 1e3)
        out[f"{B} x {S}"] = {name: (statistics.median(v), min(v), max(v)) for name, v in times.items()}
    return out


PAGED_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def paged_attention(B: int, S: int, dtype: torch.dtype) -> Callable[[], object]:
    """One layer of a decode step's attention over ``B`` sequences at position ``S - 1``, in blocks of 16
    spread over a pool of twice their number (16 heads over 4 key/value groups, head dim 64)."""
    from moekit import runconfig
    from moekit.serve.kv import Chunk, KVPool, PagedStep

    fields = {"model.n_heads": "16", "model.n_kv_heads": "4", "model.head_dim": "64", "model.n_layers": "1"}
    cfg = runconfig.resolve("tiny", fields).model
    per_seq = -(-S // 16)
    pool = KVPool(cfg, 2 * B * per_seq, 16, torch.device("cpu"), dtype)
    for t in (*pool.keys, *pool.values):
        t.normal_()
    blocks = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [Chunk(blocks[b * per_seq : (b + 1) * per_seq], S - 1, 1) for b in range(B)]
    step = PagedStep(pool, chunks, torch.device("cpu"))
    q, k, v = (torch.randn(1, heads, B, 64).to(dtype) for heads in (16, 4, 4))

    @torch.inference_mode()  # as the serving engine's steps run
    def attend() -> object:
        return step.attend(0, q, k, v)

    return attend


def step_overhead(args) -> dict:
    """ms of a batch-1 decode step of engines.py's d1024 layout (8 blocks, 8 experts top-2, 16 heads
    over 4, vocabulary 8192) at width 64: its weights cost next to nothing, so this is what the step
    pays besides reading weights (Python, op dispatch, small ops), by expert format."""
    from moekit import runconfig
    from moekit.infer.generate import decode_step, prefill
    from moekit.infer.resident_experts import prepack_, quantize_experts_
    from moekit.model import Transformer

    fields = {"model.n_layers": "8", "model.d_model": "64", "model.n_heads": "16", "model.n_kv_heads": "4"}
    fields |= {"model.head_dim": "4", "moe.num_experts": "8", "moe.top_k": "2", "model.vocab_size": "8192"}
    fields |= {"model.context_length": "256", "model.tie_embeddings": "false", "moe.d_ff": "128"}
    cfg = runconfig.resolve("tiny", fields)
    now, out = clock(args.threads), {}
    for fmt in ("bf16", "int8", "int4"):
        model = Transformer(cfg.model, cfg.moe).bfloat16().eval()
        if fmt != "bf16":
            quantize_experts_(model, fmt)
        prepack_(model)
        times = []
        with torch.no_grad():
            logits, cache = prefill(model, torch.randint(0, 8192, (1, 16)))
            token = logits.argmax(-1, keepdim=True)
            for _ in range(args.rounds):
                t = now()
                for _ in range(20):
                    token = decode_step(model, token, cache).argmax(-1, keepdim=True)
                times.append((now() - t) / 20 * 1e3)
        out[fmt] = (statistics.median(times), min(times), max(times))
    return {"d1024 layout at width 64": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 512])
    parser.add_argument("--weights", type=int, default=16, help="distinct weights (16 x 16 MB in fp32)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as moekit serve does: freed blocks reused, not faulted in again
    report = {
        "threads": args.threads,
        "native bf16": native_16bit(torch.bfloat16),
        "native fp16": native_16bit(torch.float16),
        "row kernel build": rows_isa(),
        "commit": source_commit(),
        "matmul ms per 1024 x 4096 weight": matmul_table(args),
        "attention ms per layer": attention_table(args),
        "decode step overhead ms": step_overhead(args),
    }
    print(
        f"threads {args.threads}, native bf16 {report['native bf16']}, native fp16 {report['native fp16']}, "
        f"row kernel build {report['row kernel build']}"
    )
    for section in ("matmul ms per 1024 x 4096 weight", "attention ms per layer", "decode step overhead ms"):
        print(f"\n{section}: median (min-max)")
        for key, row in report[section].items():
            cells = "  ".join(f"{name} {m:.3f} ({lo:.3f}-{hi:.3f})" for name, (m, lo, hi) in row.items())
            print(f"  {key}: {cells}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
