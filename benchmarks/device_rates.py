"""Measured rates of the work the planner costs, on this device: the cluster preset's constants.

    python benchmarks/device_rates.py --device cuda [--out rates.json] [--json]

- ``efficiency``: dense bf16 GEMMs at the model presets' layer shapes (a micro-batch's 8192 rows against
  the attention, dense-FFN and output-head weights), forward and backward (``x @ w``, then the input and
  weight gradients), as a fraction of the device's dense bf16 peak (``train/peak.py``).
- ``fp8_speedup``: the same GEMMs in fp8 (``torch._scaled_mm``, e4m3 with one scale a tensor, the
  forward's accumulation fast as Transformer Engine's, the backward's not) over their bf16 rate. The casts
  into fp8 are not in it: the planner costs them as memory traffic.
- ``attention_efficiency``: causal scaled-dot-product attention, forward and backward, at the presets'
  head sizes and 4096 tokens, fastest of torch's backends, with the planner's count (3 x the forward's
  score FLOPs over a causal half) over the peak.
- ``hbm_gbps``: the planner's count of elementwise bytes (each tensor once read or written) a second,
  as eager kernels run them: a SwiGLU forward on a micro-batch's rows counted as 2 x width read and 1 x
  written, though its two kernels (silu, then the product) move 5 x width.
- ``optimizer_gbps``: bytes a second of a fused AdamW step on 2^30 fp32 parameters (28 bytes each).

Each figure is the median of ``--reps`` calls timed with CUDA events after ``--warmup`` untimed ones, on
random inputs; the constant is the median over shapes (each shape's figure printed). On a CPU (fp32, no
fp8, 64 rows, 256 tokens) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from expert_gemm_rates import timed  # noqa: E402

from moekit.train.peak import peak_tflops  # noqa: E402

ROWS, SEQ = 8192, 4096  # a micro-batch's tokens (2 sequences of 4096), attention's sequence
CPU_ROWS, CPU_SEQ = 64, 256  # on a CPU: only a check that the script runs
# (d_model, out width) of the presets' dense GEMMs: Mixtral's QKV and FFN, Qwen3-30B's QKV, Qwen3-235B's
# QKV, gpt-oss's QKV, DeepSeek-V3's dense FFN, and an output head's vocabulary slice.
GEMMS = ((4096, 6144), (4096, 28672), (2048, 5120), (4096, 9216), (2880, 5120), (7168, 36864), (4096, 32768))
# (query heads, head size) at 4096 tokens: Mixtral and the Qwen3 models' 128, gpt-oss's 64.
ATTENTION = ((32, 128), (64, 128), (64, 64))
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def gemm_seconds(rows: int, k: int, n: int, device, dtype, fp8: bool, warmup: int, reps: int) -> float:
    """Forward + backward seconds of ``[rows, k] @ [k, n]``: the output, the input gradient and the
    weight gradient, three GEMMs of ``2 rows k n`` FLOPs each."""
    x = torch.randn(rows, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
    g = torch.randn(rows, n, device=device, dtype=dtype)
    if not fp8:
        return timed(lambda: (x @ w.t(), g @ w, g.t() @ x), device, warmup, reps)
    e4, e5, one = torch.float8_e4m3fn, torch.float8_e5m2, torch.ones((), device=device)
    x8, w8, g8 = x.to(e4), w.to(e4), g.to(e5)
    w8_t = w8.t().contiguous()  # the weight's transpose for the input gradient, as Transformer Engine caches it
    x8_t, g8_t = x8.t().contiguous(), g8.t().contiguous()

    def step() -> None:
        # _scaled_mm takes a row-major left operand and a column-major right one.
        torch._scaled_mm(x8, w8.t(), one, one, out_dtype=dtype, use_fast_accum=True)
        torch._scaled_mm(g8, w8_t.t(), one, one, out_dtype=dtype)
        torch._scaled_mm(g8_t, x8_t.t(), one, one, out_dtype=dtype)

    return timed(step, device, warmup, reps)


def attention_seconds(seq: int, heads: int, head: int, backend, device, dtype, warmup: int, reps: int) -> float:
    q, k, v = (torch.randn(1, heads, seq, head, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq, head, device=device, dtype=dtype)

    def step() -> None:
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return timed(step, device, warmup, reps)


def swiglu_gbps(rows: int, width: int, device, dtype, warmup: int, reps: int) -> float:
    h = torch.randn(rows, 2 * width, device=device, dtype=dtype)

    def step() -> None:
        gate, up = h.chunk(2, dim=-1)
        F.silu(gate) * up

    return 3 * rows * width * h.element_size() / timed(step, device, warmup, reps) / 1e9


def adamw_gbps(params: int, device, warmup: int, reps: int) -> float:
    """Bytes a second of a fused AdamW step (moekit's optimizer) over ``params`` fp32 parameters in
    tensors of 16M: each parameter's weight, gradient and two moments read, weight and moments written."""
    weights = [torch.zeros(2**24, device=device, requires_grad=True) for _ in range(params // 2**24)]
    for w in weights:
        w.grad = torch.randn_like(w)
    opt = torch.optim.AdamW(weights, lr=1e-4, fused=True)
    return 28 * len(weights) * 2**24 / timed(opt.step, device, warmup, reps) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (bf16 and fp8) or cpu (fp32; a quick check only)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--json", action="store_true", help="print the JSON on the last line")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    cuda = device.type == "cuda"
    rows, seq = (ROWS, SEQ) if cuda else (CPU_ROWS, CPU_SEQ)
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = peak_tflops(None, device, "bf16" if cuda else "fp32")
    if peak is None:
        parser.error(f"--device {args.device}: no known peak for {name} (moekit/train/peak.py)")
    out: dict = dict(device=name, torch=torch.__version__, dtype=str(dtype).removeprefix("torch."), peak_tflops=peak)
    print(f"{name}, {out['dtype']}, dense peak {peak:g} TFLOP/s; medians of {args.reps} calls")

    gemms = []
    for k, n in GEMMS:
        flops = 3 * 2 * rows * k * n
        bf16 = flops / gemm_seconds(rows, k, n, device, dtype, False, args.warmup, args.reps) / 1e12
        fp8 = flops / gemm_seconds(rows, k, n, device, dtype, True, args.warmup, args.reps) / 1e12 if cuda else None
        gemms.append(dict(k=k, n=n, tflops=bf16, fp8_tflops=fp8))
        fp8_text = f", fp8 {fp8:6.1f} ({fp8 / bf16:.2f}x)" if fp8 else ""
        print(f"GEMM [{rows}, {k}] @ [{k}, {n}] fwd+bwd: {bf16:6.1f} TFLOP/s{fp8_text}", flush=True)
    out["gemms"] = gemms
    out["efficiency"] = statistics.median(r["tflops"] for r in gemms) / peak
    if cuda:
        out["fp8_speedup"] = statistics.median(r["fp8_tflops"] / r["tflops"] for r in gemms)

    attention = []
    for heads, head in ATTENTION:
        flops = 3 * 2 * 2 * heads * head * seq * seq / 2  # QK^T and PV over a causal half, x3 fwd+bwd
        rates = {}
        for label, backend in BACKENDS.items() if cuda else [("math", SDPBackend.MATH)]:
            try:
                seconds = attention_seconds(seq, heads, head, backend, device, dtype, 2, args.reps)
                rates[label] = flops / seconds / 1e12
            except RuntimeError as exc:  # a backend that does not take this shape or device
                print(f"attention {heads}x{head} {label}: not run ({str(exc).splitlines()[0][:80]})")
        best = max(rates, key=rates.get)
        attention.append(dict(heads=heads, head=head, tflops=rates[best], backend=best, rates=rates))
        print(
            f"attention {heads} heads x {head}, {seq} causal, fwd+bwd: {rates[best]:6.1f} TFLOP/s ({best})", flush=True
        )
    out["attention"] = attention
    out["attention_efficiency"] = statistics.median(a["tflops"] for a in attention) / peak

    widths = (768, 2880, 14336)
    elementwise = [swiglu_gbps(rows, w, device, dtype, args.warmup, args.reps) for w in widths]
    for w, gbps in zip(widths, elementwise, strict=True):
        print(f"SwiGLU forward on [{rows}, 2 x {w}]: {gbps:7.0f} GB/s")
    out["elementwise_gbps"] = dict(zip(map(str, widths), elementwise, strict=True))
    out["hbm_gbps"] = statistics.median(elementwise)

    out["optimizer_gbps"] = adamw_gbps(2**30 if cuda else 2**25, device, args.warmup, args.reps)
    print(f"fused AdamW step: {out['optimizer_gbps']:7.0f} GB/s")

    keys = ("efficiency", "fp8_speedup", "attention_efficiency", "hbm_gbps", "optimizer_gbps")
    print("constants: " + ", ".join(f"{k} = {out[k]:.3g}" for k in keys if k in out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
