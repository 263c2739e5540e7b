"""MoE layer throughput: moekit against transformers' MoE blocks, a per-expert loop and two limits.

    python benchmarks/moe_layer.py [--json] [--threads 1] [--shapes S1,S2] [--pass fwd+bwd] [--rounds 5]
                                   [--only PREFIXES] [--skip PREFIXES]

Legend: T tokens, D model dim, F expert hidden dim, E experts, K picks per token.

Every implementation computes the same function from the same weights (router softmax over E,
top-K, the K weights renormalised to sum to 1, SwiGLU experts); the untimed warm-up call of each is
checked against moekit-dropless first (outputs and input gradients, max error relative to the
largest value <= ``TOLERANCE``). They are timed in one process, interleaved round by round (the
order rotates each round); each row gives the median and min-max over the rounds, ratios are taken
within each round. An impl over ``SLOW`` x moekit's warm-up time is timed in the first
``SLOW_ROUNDS`` rounds only. On a shared CPU use ``--threads 1``: with two threads every op ends in
an OpenMP barrier that waits for a descheduled thread, and the timings measure the neighbours.

- moekit-dropless: ``moekit.MoE`` with ``gemm="auto"``, and ``/<backend>`` with each grouped GEMM
  forced; a line per run gives the other backend's speed relative to the one ``auto`` picks.
- moekit-capacity: capacity factor 1.25 (drops over-capacity tokens: not checked, drops printed).
- loop-linear: transformers' Mixtral block before version 5, a Python loop over experts held as
  separate ``nn.Linear`` modules (w1, w3, w2); loop-linear-fused: gate and up in one ``nn.Linear``.
- hf-<family>/<mode>: transformers' own ``MixtralSparseMoeBlock`` and ``Qwen3MoeSparseMoeBlock``
  (``norm_topk_prob``) built from a local config, under each experts implementation that runs on
  the device (``eager``: a loop over stacked ``[E, ...]`` weights indexed per expert;
  ``grouped_mm``; ``batched_mm`` when its per-assignment weight copies fit in memory). The fastest
  is the baseline of the ``x baseline`` column.
- limit: the same expert FLOPs on perfectly balanced tokens, no router and no gather: one
  ``torch.bmm`` per weight, gate/up fused, or ``torch._grouped_mm``; the fastest form counts.
- dense-gemm: one ``[T*K, D] @ [D, 3F]`` matmul, the experts' FLOPs in one GEMM: the machine's
  dense GEMM rate at this size, to read each row's GFLOP/s against.

GFLOP/s counts the dropless expert FLOPs, 6*T*K*D*F per forward and three times that per
forward+backward (router, gather and combine left out).

Where the differences come from (CPU, fp32):
- moekit, loop-linear and hf-*/grouped_mm run the same GEMMs, one per expert and weight: on CPU
  torch._grouped_mm is itself a loop of matmuls (per_expert_mm a Python one), and a loop's own cost
  is small beside the GEMMs, so they meet. Where a loop leads in forward it is cache locality: it
  runs SwiGLU and the second GEMM on one expert's rows, moekit on all T*K rows at once.
- hf-*/eager index the stacked [E, ...] weights per expert: the backward of each index is a
  zero-filled gradient as large as all E experts' weights, summed E times per step, so its cost
  grows with E and the size of every expert. Forward-only it is the plain loop.
- On a GPU (not measured here) a gain would come from launches and host syncs, not FLOPs: one
  grouped-GEMM kernel per weight (bf16, compute capability 9.0+) instead of E small matmuls, each
  behind a per-expert `where` whose output size the host must wait for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit import MoE, MoEConfig
from moekit.config import GEMM_BACKENDS
from moekit.dispatch import LocalDispatcher
from moekit.experts.gemm import resolve_backend

TOLERANCE = 1e-4  # max |a - b| / max |b|, fp32: GEMM blocking and summation order differ by impl
SLOW, SLOW_ROUNDS = 10, 3  # impls over SLOW x moekit's warm-up time are timed in SLOW_ROUNDS rounds only
GPU_ONLY_MODES = ("deepgemm", "sonicmoe")  # transformers experts implementations needing CUDA kernels
FOOTNOTE = __doc__[__doc__.index("Where the differences") :].rstrip()


@dataclass(frozen=True)
class Shape:
    name: str
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    tokens: int

    def expert_flops(self, backward: bool) -> float:
        return 6 * self.tokens * self.top_k * self.d_model * self.d_ff * (3 if backward else 1)


SHAPES = {
    "S1": Shape("S1", 512, 1024, 8, 2, 4096),
    "S2": Shape("S2", 1024, 1408, 64, 4, 2048),
}


@dataclass
class Case:
    run: Callable[[], Tensor]  # one forward; returns the output
    leaves: list[Tensor]  # tensors whose .grad is reset before each call
    checked: bool = True  # computes moekit-dropless's function on the shared input


# ---------------------------------------------------------------------------------------------
# The implementations, all built from one moekit layer's weights.


class PerExpertLoop(nn.Module):
    """transformers' Mixtral block before v5: experts as separate ``nn.Linear`` modules, one loop."""

    def __init__(self, moe: MoE, fused: bool) -> None:
        super().__init__()
        self.top_k, self.fused = moe.cfg.top_k, fused
        self.gate = linear(moe.router.gate.weight.t())
        self.experts = nn.ModuleList()
        for w_in, w_out in zip(moe.experts.w_in, moe.experts.w_out, strict=True):
            first = [w_in] if fused else w_in.chunk(2, dim=1)  # [gate | up], or w1 (gate) and w3 (up)
            self.experts.append(nn.ModuleList([*map(linear, first), linear(w_out)]))

    def expert(self, e: int, x_RD: Tensor) -> Tensor:
        *first, down = self.experts[e]
        gate, up = first[0](x_RD).chunk(2, dim=-1) if self.fused else (first[0](x_RD), first[1](x_RD))
        return down(F.silu(gate) * up)

    def forward(self, x_TD: Tensor) -> Tensor:
        probs = F.softmax(self.gate(x_TD), dim=1, dtype=torch.float)
        weights_TK, experts_TK = torch.topk(probs, self.top_k, dim=-1)
        weights_TK = (weights_TK / weights_TK.sum(dim=-1, keepdim=True)).to(x_TD.dtype)
        out = torch.zeros_like(x_TD)
        mask_EKT = F.one_hot(experts_TK, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in torch.greater(mask_EKT.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
            pick, tokens = torch.where(mask_EKT[e])
            out.index_add_(0, tokens, self.expert(e, x_TD[tokens]) * weights_TK[tokens, pick, None])
        return out


def linear(w_IO: Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` holding a copy of ``w_IO`` (moekit's [in, out] layout)."""
    layer = nn.Linear(*w_IO.shape, bias=False)
    layer.weight.data.copy_(w_IO.detach().t())
    return layer


def transformers_blocks(s: Shape, moe: MoE) -> tuple[dict[str, tuple[nn.Module, str]], list[str]]:
    """``hf-<family>/<mode>``: (block, experts implementation) for each mode that runs here; and notes.

    Mixtral and Qwen3-MoE share one copy of the weights in transformers' own layout
    (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``).
    """
    try:
        from transformers import MixtralConfig, Qwen3MoeConfig
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as e:
        return {}, [f"transformers blocks left out: {e}"]
    dims = dict(hidden_size=s.d_model, num_experts_per_tok=s.top_k, hidden_act="silu")
    blocks = {
        "mixtral": MixtralSparseMoeBlock(
            MixtralConfig(**dims, intermediate_size=s.d_ff, num_local_experts=s.num_experts, router_jitter_noise=0.0)
        ),
        "qwen3_moe": Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(**dims, moe_intermediate_size=s.d_ff, num_experts=s.num_experts, norm_topk_prob=True)
        ),
    }
    shared = {
        "weight": nn.Parameter(moe.router.gate.weight.detach().clone()),
        "gate_up_proj": nn.Parameter(moe.experts.w_in.detach().transpose(1, 2).contiguous()),
        "down_proj": nn.Parameter(moe.experts.w_out.detach().transpose(1, 2).contiguous()),
    }
    for block in blocks.values():
        block.gate.weight = shared["weight"]
        block.experts.gate_up_proj, block.experts.down_proj = shared["gate_up_proj"], shared["down_proj"]
    notes, modes = [], ["eager", *ALL_EXPERTS_FUNCTIONS]
    batched_bytes = s.tokens * s.top_k * 3 * s.d_model * s.d_ff * 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for mode in [m for m in modes if m in GPU_ONLY_MODES]:
        notes.append(f"hf-*/{mode} left out: CUDA kernels only")
    if "batched_mm" in modes and batched_bytes > memory / 4:
        modes.remove("batched_mm")
        notes.append(f"hf-*/batched_mm left out: it copies the weights per assignment, {batched_bytes / 2**30:.0f} GiB")
    runnable = [m for m in modes if m not in GPU_ONLY_MODES]
    return {f"hf-{f}/{m}": (block, m) for f, block in blocks.items() for m in runnable}, notes


def limit_forms(s: Shape) -> dict[str, Case]:
    """The balanced, routing-free expert FFN in each dense form; each returns the output."""
    per_expert = s.tokens * s.top_k // s.num_experts
    x = torch.randn(s.num_experts, per_expert, s.d_model, requires_grad=True)
    w1, w3 = (torch.randn(s.num_experts, s.d_model, s.d_ff, requires_grad=True) for _ in range(2))
    w13 = torch.cat([w1, w3], dim=-1).detach().requires_grad_()
    w2 = torch.randn(s.num_experts, s.d_ff, s.d_model, requires_grad=True)
    x_flat = x.detach().reshape(-1, s.d_model).requires_grad_()
    offsets = torch.arange(1, s.num_experts + 1, dtype=torch.int32) * per_expert

    def bmm3():
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)

    def bmm2():
        gate, up = torch.bmm(x, w13).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, w2)

    def grouped():
        gate, up = torch._grouped_mm(x_flat, w13, offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2, offs=offsets)

    forms = {"limit-bmm": Case(bmm3, [x, w1, w3, w2], False), "limit-bmm-fused": Case(bmm2, [x, w13, w2], False)}
    if hasattr(torch, "_grouped_mm"):
        forms["limit-grouped_mm"] = Case(grouped, [x_flat, w13, w2], False)
    return forms


def dense_gemm(s: Shape) -> Case:
    """One matmul with the experts' FLOPs: [T*K, D] @ [D, 3F] (2 * T*K * D * 3F = 6*T*K*D*F)."""
    x = torch.randn(s.tokens * s.top_k, s.d_model, requires_grad=True)
    w = torch.randn(s.d_model, 3 * s.d_ff, requires_grad=True)
    return Case(lambda: x @ w, [x, w], False)


def make_cases(s: Shape) -> tuple[dict[str, Case], MoE, Tensor, list[str]]:
    """Every impl over one input ``x [T, D]``; also the moekit layer and notes on what was left out."""
    moe = MoE(MoEConfig(d_model=s.d_model, d_ff=s.d_ff, num_experts=s.num_experts, top_k=s.top_k))
    dropless, capacity = moe.dispatcher, LocalDispatcher(s.num_experts, capacity_factor=1.25)
    x = torch.randn(s.tokens, s.d_model, requires_grad=True)

    def moekit(backend: str, dispatcher: LocalDispatcher = dropless, checked: bool = True) -> Case:
        def run() -> Tensor:
            moe.experts.gemm, moe.dispatcher = backend, dispatcher
            return moe(x)

        return Case(run, [x, *moe.parameters()], checked)

    cases = {"moekit-dropless": moekit("auto")}
    cases |= {f"moekit-dropless/{b}": moekit(b) for b in GEMM_BACKENDS if b != "auto"}
    cases["moekit-capacity"] = moekit("auto", capacity, checked=False)
    for name, fused in (("loop-linear", False), ("loop-linear-fused", True)):
        loop = PerExpertLoop(moe, fused)
        cases[name] = Case(lambda m=loop: m(x), [x, *loop.parameters()])
    blocks, notes = transformers_blocks(s, moe)
    for name, (block, mode) in blocks.items():
        cases[name] = Case(lambda b=block, m=mode: run_hf(b, m, x), [x, *block.parameters()])
    cases |= limit_forms(s)
    cases["dense-gemm"] = dense_gemm(s)
    with torch.no_grad():
        moe.dispatcher = capacity
        dropped = moe(x, return_stats=True)[1].num_dropped
    notes.append(f"moekit-capacity drops {dropped} of {s.tokens * s.top_k} assignments")
    return cases, moe, x, notes


def run_hf(block: nn.Module, mode: str, x_TD: Tensor) -> Tensor:
    block.experts.config._experts_implementation = mode
    return block(x_TD.unsqueeze(0)).squeeze(0)


# ---------------------------------------------------------------------------------------------
# Timing and the agreement check.


def call(case: Case, backward: bool, grads: dict[torch.Size, Tensor]) -> tuple[float, Tensor, Tensor | None]:
    """One timed call from unset gradients, as after ``zero_grad(set_to_none=True)``: seconds, output
    and the first leaf's gradient (the shared input's, for checked cases).

    The output gradient is a fixed random tensor per output shape (made on the untimed first call).
    Gradients are dropped afterwards, so that only one impl's are held at a time.
    """
    start = time.perf_counter()
    if backward:
        y = case.run()
        if y.shape not in grads:
            grads[y.shape] = torch.randn(y.shape)
        y.backward(grads[y.shape])
    else:
        with torch.no_grad():
            y = case.run()
    elapsed, dx = time.perf_counter() - start, case.leaves[0].grad
    for leaf in case.leaves:
        leaf.grad = None
    return elapsed, y.detach(), dx


def relative_error(got: list[Tensor], want: list[Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True))


def wanted(name: str, only: list[str], skip: list[str]) -> bool:
    """``--only`` and ``--skip`` take name prefixes."""
    return any(name.startswith(p) for p in only or [""]) and not any(name.startswith(p) for p in skip)


def time_shape(
    s: Shape, backward: bool, rounds: int, only: list[str], skip: list[str]
) -> tuple[dict[str, list[float]], str, list[str]]:
    """Seconds of each timed round per impl (after an untimed round that checks agreement), the
    backend ``gemm="auto"`` picks for this shape and pass, and notes."""
    torch.manual_seed(0)
    cases, moe, x, notes = make_cases(s)
    cases = {k: v for k, v in cases.items() if k == "moekit-dropless" or wanted(k, only, skip)}
    assert next(iter(cases)) == "moekit-dropless", "the reference runs first"
    grads: dict[torch.Size, Tensor] = {}
    warmup, errors, want = {}, {}, []
    for name, case in cases.items():  # an untimed warm-up call of each, checked against the first
        warmup[name], y, dx = call(case, backward, grads)
        got = [y, dx] if backward else [y]
        if name == "moekit-dropless":
            want = got
        elif case.checked:
            errors[name] = relative_error(got, want)
    if errors:
        worst = max(errors, key=errors.__getitem__)
        if errors[worst] > TOLERANCE:
            raise SystemExit(f"{s.name}: {worst} disagrees with moekit-dropless: relative error {errors[worst]:.1e}")
        notes.append(f"{len(errors)} impls agree with moekit-dropless; worst {worst}, {errors[worst]:.1e}")
    slow = {n for n, t in warmup.items() if t > SLOW * warmup["moekit-dropless"]}
    notes += [f"{n}: timed in the first {SLOW_ROUNDS} rounds only, over {SLOW}x moekit's time" for n in sorted(slow)]
    names, times = list(cases), {name: [] for name in cases}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            if name not in slow or round_ < SLOW_ROUNDS:
                times[name].append(call(cases[name], backward, grads)[0])
        print(f"# {s.name} round {round_ + 1} of {rounds}", file=sys.stderr, flush=True)
    with torch.set_grad_enabled(backward):
        picked = resolve_backend("auto", x, moe.experts.w_in)
    return times, picked, notes


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
    return spread([a / b for a, b in pairs])


def spread(values: list[float], digits: int = 3) -> dict[str, float]:
    stats = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return {k: round(v, digits) for k, v in stats.items()}


def summarize(s: Shape, pass_name: str, times: dict[str, list[float]], picked: str) -> tuple[list[dict], dict]:
    """Table rows; and the run's references, with what ``auto`` picked beside the fastest backend."""
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
                "ms": spread([x * 1e3 for x in t], 2),
                "tokens_per_s": spread([s.tokens / x for x in t], 1),
                "gflops": round(flops / median / 1e9, 2),
                "vs_limit": ratios(times, name, limit),
                "vs_baseline": ratios(times, name, baseline),
                "limit": limit,
                "baseline": baseline,
            }
        )
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


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'shape':<6}{'pass':<8}{'impl':<31}{'median ms':>10}{'min-max ms':>17}{'tokens/s':>10}"
        f"{'GFLOP/s':>9}{'x limit (min-max)':>20}{'x baseline (min-max)':>22}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ms, base = r["ms"], r["vs_baseline"]
        print(
            f"{r['shape']:<6}{r['pass']:<8}{r['impl']:<31}{ms['median']:>10.1f}{ms['min']:>8.1f}-{ms['max']:<8.1f}"
            f"{r['tokens_per_s']['median']:>10.0f}{r['gflops']:>9.1f}{fmt(r['vs_limit']):>20}{fmt(base):>22}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="S1,S2", help="comma-separated shape names (S1, S2)")
    parser.add_argument("--pass", dest="passes", default="fwd+bwd", help="fwd, fwd+bwd or both, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, one call per impl each (>= 3)")
    parser.add_argument("--only", default="", help="comma-separated impl name prefixes to run (e.g. hf-,loop-)")
    parser.add_argument("--skip", default="", help="comma-separated impl name prefixes to leave out (e.g. hf-qwen3)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 resists a shared CPU best")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds: at least 3, for a spread")
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown shape {unknown} (choose from {', '.join(SHAPES)})")
    rows, runs, notes = [], [], []
    if args.threads:
        torch.set_num_threads(args.threads)
    only, skip = ([p for p in arg.split(",") if p] for arg in (args.only, args.skip))
    load = os.getloadavg()[0]
    for name in args.shapes.split(","):
        for pass_name in args.passes.split(","):
            times, picked, shape_notes = time_shape(SHAPES[name], pass_name == "fwd+bwd", args.rounds, only, skip)
            shape_rows, run = summarize(SHAPES[name], pass_name, times, picked)
            rows += shape_rows
            runs.append(run)
            notes += [f"{name} {pass_name}: {n}" for n in shape_notes]
            print(f"# {name} {pass_name} done", file=sys.stderr, flush=True)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, SwiGLU, {args.rounds} rounds")
    load = [round(load, 2), round(os.getloadavg()[0], 2)]
    print(f"# load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, {os.cpu_count()} CPUs")
    print_table(rows)
    for run in runs:
        line = f"# {run['shape']} {run['pass']}: limit {run['limit']}, baseline {run['baseline']}; "
        line += f"gemm='auto' picks {run['auto_picks']}"
        for backend, ratio in run.get("others_vs_pick", {}).items():
            line += f"; {backend} runs x{fmt(ratio)} its speed, {verdict(ratio)}"
        print(line)
    print("\n".join(f"# {n}" for n in notes))
    print(FOOTNOTE)
    if args.json:
        print(json.dumps({"cases": rows, "runs": runs, "notes": notes, "load_average": load}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
