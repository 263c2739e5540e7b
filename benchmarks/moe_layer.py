"""MoE layer throughput: moekit against transformers' MoE blocks, a per-expert loop and two limits.

    python benchmarks/moe_layer.py [--json] [--threads 1] [--shapes S1,S2] [--pass fwd+bwd] [--rounds 5]
                                   [--only PREFIXES] [--skip PREFIXES] [--device cpu] [--dtype fp32]
    python benchmarks/moe_layer.py --device cuda [--dtype bf16] [--shapes G1,G2] [--pass fwd,fwd+bwd] [--json]

Legend: T tokens, D model dim, F expert hidden dim, E experts, K picks per token.

Every implementation computes the same function from the same weights (router softmax over E,
top-K, the K weights renormalised to sum to 1, SwiGLU experts); the untimed warm-up call of each is
checked against moekit-dropless first (outputs and input gradients, max error relative to the
largest value <= ``TOLERANCE``; in bf16 ``TOLERANCE_BF16``, tokens near a routing tie left out, see
``near_tie``). An impl that fails there (an error, out of memory, a disagreement) is a row "not run:
<reason>" and the run goes on; a disagreement makes the exit status 1. They are timed in one
process, interleaved round by round (the order rotates each round); each row gives the median and
min-max over the rounds, ratios are taken within each round. An impl over ``SLOW`` x moekit's warm-up
time is timed in the first ``SLOW_ROUNDS`` rounds only. On a shared CPU use ``--threads 1``: with two
threads every op ends in an OpenMP barrier that waits for a descheduled thread, and the timings
measure the neighbours.

On ``--device cuda`` (bf16 by default, shapes G1 and G2) every weight, input and impl lives on the
GPU. Kernels run asynchronously, so each timed round waits for the device before starting the clock
and again before stopping it, and times a block of back-to-back calls of at least ``MIN_ROUND_S``
(from the second warm-up call's time; one call on CPU shapes) so that launch and timer noise stay
small; a round's figure is the block's time per call. Each impl gets two untimed warm-up calls
there (lazy kernel loading, cuBLAS set-up, the caching allocator), the first checked. The caching
allocator is emptied between shapes and passes, and after an impl that failed.

- moekit-dropless: ``moekit.MoE`` with ``gemm="auto"``, and ``/<backend>`` with each grouped GEMM
  forced; a line per run gives the other backend's speed relative to the one ``auto`` picks.
- moekit-capacity: capacity factor 1.25 (drops over-capacity tokens: not checked, drops printed).
- loop-linear: transformers' Mixtral block before version 5, a Python loop over experts held as
  separate ``nn.Linear`` modules (w1, w3, w2); loop-linear-fused: gate and up in one ``nn.Linear``.
- hf-<family>/<mode>: transformers' own ``MixtralSparseMoeBlock`` and ``Qwen3MoeSparseMoeBlock``
  (``norm_topk_prob``) built from a local config, under each experts implementation that runs on
  the device (``eager``: a loop over stacked ``[E, ...]`` weights indexed per expert;
  ``grouped_mm``; ``batched_mm`` when its per-assignment weight copies fit in a quarter of the memory,
  free GPU memory on cuda; on cuda also the kernel-backed modes, ``deepgemm`` and ``sonicmoe``, which
  are "not run" where their kernels are not installed). The fastest is the baseline of the
  ``x baseline`` column.
- limit: the same expert FLOPs on perfectly balanced tokens, no router and no gather: one
  ``torch.bmm`` per weight, gate/up fused, or ``torch._grouped_mm``; the fastest form counts.
- dense-gemm: one ``[T*K, D] @ [D, 3F]`` matmul, the experts' FLOPs in one GEMM: the device's
  dense GEMM rate at this size and dtype, to read each row's FLOP rate against.

GFLOP/s (TFLOP/s in the table on cuda; ``gflops`` in the JSON on both) counts the dropless expert
FLOPs, 6*T*K*D*F per forward and three times that per forward+backward (router, gather and combine
left out).

Where the differences come from (CPU, fp32):
- moekit, loop-linear and hf-*/grouped_mm run the same GEMMs, one per expert and weight: on CPU
  torch._grouped_mm is itself a loop of matmuls (per_expert_mm a Python one), and a loop's own cost
  is small beside the GEMMs, so they meet. Where a loop leads in forward it is cache locality: it
  runs SwiGLU and the second GEMM on one expert's rows, moekit on all T*K rows at once.
- hf-*/eager index the stacked [E, ...] weights per expert: the backward of each index is a
  zero-filled gradient as large as all E experts' weights, summed E times per step, so its cost
  grows with E and the size of every expert. Forward-only it is the plain loop.
- On a GPU (``--device cuda``) the same rows measure launches and host syncs beside the FLOPs:
  moekit's ``auto`` picks one grouped-GEMM kernel per weight (bf16, compute capability 9.0+) and its
  run line gives per_expert_mm's speed against it; the loops launch E small matmuls, each behind a
  per-expert `where` whose output size the host must wait for; hf-*/eager's backward adds E
  zero-filled weight-sized gradients; the limits and dense-gemm give the GEMM rate to read them by.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _moe_layer_impls import DTYPES, Case, Shape, Target, make_cases, reason
from _spread import spread
from torch import Tensor

from moekit import MoE
from moekit.experts.gemm import resolve_backend

TOLERANCE = 1e-4  # max |a - b| / max |b|, fp32: GEMM blocking and summation order differ by impl
# bf16 keeps 8 significant bits: a value rounded to it moves by up to u = 2**-8 of itself. The impls
# share the same bf16 inputs and weights and accumulate in fp32, but round different intermediates to
# bf16 (router weights, gate/up, the SwiGLU product, each expert's output before or after the weighted
# sum over K; and the same in reverse in the backward): up to ~8 roundings placed differently on the
# path to dx, each <= u of that intermediate's largest value, so at worst 8u = 3.1e-2 of the largest.
# Seen errors sit well below (the roundings have random signs); a routing or weighting bug is O(1).
TOLERANCE_BF16 = 8 * 2.0**-8
SLOW, SLOW_ROUNDS = 10, 3  # impls over SLOW x moekit's warm-up time are timed in SLOW_ROUNDS rounds only
MIN_ROUND_S = 0.01  # a timed round calls an impl back to back until about this long (at most MAX_CALLS)
MAX_CALLS = 100
FOOTNOTE = __doc__[__doc__.index("Where the differences") :].rstrip()


SHAPES = {
    "S1": Shape("S1", 512, 1024, 8, 2, 4096),
    "S2": Shape("S2", 1024, 1408, 64, 4, 2048),
    "G1": Shape("G1", 4096, 14336, 8, 2, 16384),  # Mixtral-8x7B-like
    "G2": Shape("G2", 2048, 768, 128, 8, 16384),  # Qwen3-30B-A3B-like: fine-grained experts
}


# ---------------------------------------------------------------------------------------------
# Timing and the agreement check.


def call(case: Case, backward: bool, grads: dict[torch.Size, Tensor]) -> tuple[Tensor, Tensor | None]:
    """One call from unset gradients, as after ``zero_grad(set_to_none=True)``: the output and the
    first leaf's gradient (the shared input's, for checked cases).

    The output gradient is a fixed random tensor per output shape (made on the untimed first call).
    Gradients are dropped afterwards, so that only one impl's are held at a time.
    """
    if backward:
        y = case.run()
        if y.shape not in grads:
            grads[y.shape] = torch.randn_like(y)
        y.backward(grads[y.shape])
    else:
        with torch.no_grad():
            y = case.run()
    dx = case.leaves[0].grad
    for leaf in case.leaves:
        leaf.grad = None
    return y.detach(), dx


def timed(
    case: Case, backward: bool, grads: dict[torch.Size, Tensor], target: Target, calls: int = 1
) -> tuple[float, Tensor, Tensor | None]:
    """Seconds per call over ``calls`` back-to-back calls, the device idle at the start and waited
    for at the end (its kernels run asynchronously); and the last call's ``call`` results."""
    target.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        y, dx = call(case, backward, grads)
    target.synchronize()
    return (time.perf_counter() - start) / calls, y, dx


def relative_error(got: list[Tensor], want: list[Tensor], rows: Tensor) -> float:
    """max |a - b| / max |b| over the token ``rows`` kept (a bool mask), the worst of the tensors."""
    pairs = [(a[rows].float(), b[rows].float()) for a, b in zip(got, want, strict=True)]
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)


def near_tie(moe: MoE, x_TD: Tensor) -> Tensor:
    """The tokens whose K-th and (K+1)-th router logits lie within bf16's rounding of each other.

    moekit computes the router logits in fp32; the loops and transformers' blocks round them to bf16,
    which moves each by up to u = 2**-8 of itself, so their order, and the token's experts, may differ
    from moekit's where the gap is <= 2u of the larger. Such a token's output and input gradient are
    a different function of it, not an error: the bf16 check leaves those rows out.
    """
    if moe.cfg.top_k >= moe.cfg.num_experts:
        return torch.zeros(x_TD.shape[0], dtype=torch.bool, device=x_TD.device)
    with torch.no_grad():
        logits = F.linear(x_TD.float(), moe.router.gate.weight.float())
        pair = logits.topk(moe.cfg.top_k + 1, dim=-1).values[:, -2:]
        return pair[:, 0] - pair[:, 1] <= 2 * 2.0**-8 * pair.abs().amax(dim=-1)


def wanted(name: str, only: list[str], skip: list[str]) -> bool:
    """``--only`` and ``--skip`` take name prefixes."""
    return any(name.startswith(p) for p in only or [""]) and not any(name.startswith(p) for p in skip)


def time_shape(
    s: Shape, backward: bool, rounds: int, only: list[str], skip: list[str], target: Target
) -> tuple[dict[str, list[float]], dict[str, str], str, list[str]]:
    """Seconds per call of each timed round per impl (after untimed warm-up calls, the first checked
    for agreement), why each impl that failed was not run, the backend ``gemm="auto"`` picks for this
    shape and pass, and notes."""
    torch.manual_seed(0)
    with target.building():
        cases, moe, x, notes = make_cases(s, target)
    cases = {k: v for k, v in cases.items() if k == "moekit-dropless" or wanted(k, only, skip)}
    assert next(iter(cases)) == "moekit-dropless", "the reference runs first"
    tolerance, kept = TOLERANCE, torch.ones(s.tokens, dtype=torch.bool, device=target.device)
    if target.dtype == torch.bfloat16:
        tolerance, kept = TOLERANCE_BF16, ~near_tie(moe, x)
        notes.append(f"{int((~kept).sum())} of {s.tokens} tokens near a bf16 routing tie left out of the check")
    grads: dict[torch.Size, Tensor] = {}
    warmup, errors, failed, want = {}, {}, {}, []
    y = dx = None

    def fail(name: str, why: str) -> None:
        failed[name] = why
        for leaf in cases[name].leaves:
            leaf.grad = None
        target.free_memory()

    for name, case in cases.items():  # untimed warm-up calls of each, the first checked against moekit's
        try:
            warmup[name], y, dx = timed(case, backward, grads, target)
            if target.cuda:  # the first call paid for lazy kernel loading and cuBLAS set-up
                warmup[name] = timed(case, backward, grads, target)[0]
        except Exception as e:  # e.g. out of memory, or a transformers mode whose kernels are missing
            fail(name, reason(e))
            continue
        got = [y, dx] if backward else [y]
        if name == "moekit-dropless":
            want = got
        elif case.checked and want:
            errors[name] = relative_error(got, want, kept)
            if errors[name] > tolerance:
                fail(name, f"disagrees with moekit-dropless: relative error {errors[name]:.1e} > {tolerance:.1e}")
    del want, y, dx
    if "moekit-dropless" in failed:  # the other rows still say what they measure
        notes.append("moekit-dropless, the reference, failed: the other impls ran unchecked")
    agree = {n: e for n, e in errors.items() if n not in failed}
    if agree:
        worst = max(agree, key=agree.__getitem__)
        notes.append(f"{len(agree)} impls agree with moekit-dropless; worst {worst}, {agree[worst]:.1e}")
    names = [n for n in cases if n not in failed]
    reference = warmup.get("moekit-dropless", min(warmup.values(), default=0.0))
    slow = {n for n in names if warmup[n] > SLOW * reference}
    notes += [f"{n}: timed in the first {SLOW_ROUNDS} rounds only, over {SLOW}x moekit's time" for n in sorted(slow)]
    calls = {n: max(1, min(MAX_CALLS, math.ceil(MIN_ROUND_S / warmup[n]))) for n in names}
    if any(c > 1 for c in calls.values()):
        notes.append("calls per timed round: " + ", ".join(f"{n} {c}" for n, c in calls.items() if c > 1))
    times = {name: [] for name in names}
    for round_ in range(rounds if names else 0):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            if name in failed or (name in slow and round_ >= SLOW_ROUNDS):
                continue
            try:
                times[name].append(timed(cases[name], backward, grads, target, calls[name])[0])
            except Exception as e:
                fail(name, f"round {round_ + 1}: {reason(e)}")
        print(f"# {s.name} round {round_ + 1} of {rounds}", file=sys.stderr, flush=True)
    with torch.set_grad_enabled(backward):
        picked = resolve_backend("auto", x, moe.experts.w_in)
    return {n: t for n, t in times.items() if n not in failed}, failed, picked, notes


# ---------------------------------------------------------------------------------------------
# Report.


def fastest(times: dict[str, list[float]], prefix: str) -> str | None:
    names = [n for n in times if n.startswith(prefix)]
    return min(names, key=lambda n: statistics.median(times[n])) if names else None


def ratios(times: dict[str, list[float]], name: str, other: str | None) -> dict[str, float] | None:
    """How many times faster ``name`` ran than ``other``, round by round: median, min, max."""
    if other is None:
        return None
    pairs = zip(times[other], times[name], strict=False)  # a slow impl ran only the first rounds
    return spread([a / b for a, b in pairs], 3)


def summarize(
    s: Shape, pass_name: str, times: dict[str, list[float]], failed: dict[str, str], picked: str
) -> tuple[list[dict], dict]:
    """Table rows, the impls not run last; and the run's references, with what ``auto`` picked beside
    the other backend."""
    limit, baseline = fastest(times, "limit"), fastest(times, "hf-") or fastest(times, "loop-")
    flops = s.expert_flops(pass_name == "fwd+bwd")
    rows = []
    for name, t in times.items():
        median = statistics.median(t)
        rows.append(
            {
                "shape": s.name,
                "pass": pass_name,
                "impl": name,
                "ms": spread([x * 1e3 for x in t], 3),
                "tokens_per_s": spread([s.tokens / x for x in t], 1),
                "gflops": round(flops / median / 1e9, 2),
                "vs_limit": ratios(times, name, limit),
                "vs_baseline": ratios(times, name, baseline),
                "limit": limit,
                "baseline": baseline,
            }
        )
    rows += [{"shape": s.name, "pass": pass_name, "impl": n, "not_run": why} for n, why in failed.items()]
    run = {"shape": s.name, "pass": pass_name, "limit": limit, "baseline": baseline, "auto_picks": picked}
    others = [n for n in times if n.startswith("moekit-dropless/") and n != f"moekit-dropless/{picked}"]
    if f"moekit-dropless/{picked}" in times:
        run["others_vs_pick"] = {n.split("/")[1]: ratios(times, n, f"moekit-dropless/{picked}") for n in others}
    return rows, run


def fmt(ratio: dict[str, float] | None) -> str:
    return f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-"


def verdict(ratio: dict[str, float]) -> str:
    """Whether a per-round speed ratio says faster, slower, or neither."""
    if ratio["min"] > 1:
        return "faster in every round"
    return "slower in every round" if ratio["max"] < 1 else "faster in some rounds, slower in others"


def print_table(rows: list[dict], tera: bool) -> None:
    """The FLOP rate in TFLOP/s where ``tera`` (a GPU), else GFLOP/s."""
    header = (
        f"{'shape':<6}{'pass':<8}{'impl':<31}{'median ms':>10}{'min-max ms':>17}{'tokens/s':>10}"
        f"{'TFLOP/s' if tera else 'GFLOP/s':>9}{'x limit (min-max)':>20}{'x baseline (min-max)':>22}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['shape']:<6}{r['pass']:<8}{r['impl']:<31}", end="")
        if "not_run" in r:
            print(f"  not run: {r['not_run']}")
            continue
        ms, rate = r["ms"], r["gflops"] / (1e3 if tera else 1)
        print(
            f"{ms['median']:>10.2f}{ms['min']:>8.2f}-{ms['max']:<8.2f}{r['tokens_per_s']['median']:>10.0f}"
            f"{rate:>9.1f}{fmt(r['vs_limit']):>20}{fmt(r['vs_baseline']):>22}"
        )


def parse_target(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Target:
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return Target(torch.device(args.device), DTYPES[dtype])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every impl runs")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), help="weights and inputs (default: fp32 on cpu, bf16 on cuda)"
    )
    parser.add_argument(
        "--shapes", help=f"comma-separated shape names ({', '.join(SHAPES)}); default S1,S2 on cpu, G1,G2 on cuda"
    )
    parser.add_argument("--pass", dest="passes", default="fwd+bwd", help="fwd, fwd+bwd or both, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, one block of calls per impl each (>= 3)")
    parser.add_argument("--only", default="", help="comma-separated impl name prefixes to run (e.g. hf-,loop-)")
    parser.add_argument("--skip", default="", help="comma-separated impl name prefixes to leave out (e.g. hf-qwen3)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 resists a shared CPU best")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds: at least 3, for a spread")
    target = parse_target(parser, args)
    shapes = (args.shapes or ("G1,G2" if target.cuda else "S1,S2")).split(",")
    unknown = [n for n in shapes if n not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown shape {unknown} (choose from {', '.join(SHAPES)})")
    rows, runs, notes = [], [], []
    if args.threads:
        torch.set_num_threads(args.threads)
    only, skip = ([p for p in arg.split(",") if p] for arg in (args.only, args.skip))
    load = os.getloadavg()[0]
    for name in shapes:
        for pass_name in args.passes.split(","):
            try:
                times, failed, picked, shape_notes = time_shape(
                    SHAPES[name], pass_name == "fwd+bwd", args.rounds, only, skip, target
                )
            except Exception as e:  # building the impls failed: the other shapes and passes still run
                times, failed, picked, shape_notes = {}, {}, "-", [f"not run: {reason(e)}"]
            target.free_memory()  # this shape's weights and cached blocks gone before the next
            shape_rows, run = summarize(SHAPES[name], pass_name, times, failed, picked)
            rows += shape_rows
            runs.append(run)
            notes += [f"{name} {pass_name}: {n}" for n in shape_notes]
            print(f"# {name} {pass_name} done", file=sys.stderr, flush=True)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {target.describe()}, SwiGLU", end="")
    print(f", {args.rounds} rounds")
    load = [round(load, 2), round(os.getloadavg()[0], 2)]
    print(f"# load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, {os.cpu_count()} CPUs")
    print_table(rows, tera=target.cuda)
    for run in runs:
        line = f"# {run['shape']} {run['pass']}: limit {run['limit']}, baseline {run['baseline']}; "
        line += f"gemm='auto' picks {run['auto_picks']}"
        for backend, ratio in run.get("others_vs_pick", {}).items():
            line += f"; {backend} runs x{fmt(ratio)} its speed, {verdict(ratio)}"
        print(line)
    print("\n".join(f"# {n}" for n in notes))
    print(FOOTNOTE)
    if args.json:
        device = {"device": target.describe(), "dtype": str(target.dtype).removeprefix("torch.")}
        print(json.dumps({"cases": rows, "runs": runs, "notes": notes, "load_average": load, **device}))
    disagree = [r["impl"] for r in rows if r.get("not_run", "").startswith("disagrees")]
    return 1 if disagree else 0  # every other row was printed; a disagreement still fails the run


if __name__ == "__main__":
    raise SystemExit(main())
