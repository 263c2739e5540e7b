"""MoE layer throughput against the balanced-GEMM limit and a per-expert Python loop.

    python benchmarks/moe_layer.py [--json] [--repeats 5] [--shapes S1,S2] [--pass fwd+bwd]

Impls, timed side by side in one process, interleaved round by round; medians reported:
- limit: the same expert FLOPs on perfectly balanced tokens with no routing, as one torch.bmm per
  weight (w1, w3, w2 separate, or gate/up fused) or torch._grouped_mm; the fastest form counts.
- moekit-dropless: moekit.MoE, dropless, default grouped GEMM for the device (gemm="auto"); and
  moekit-dropless/<backend>: the same with each grouped GEMM forced, so that what "auto" picks
  stays checked by measurement.
- moekit-capacity: moekit.MoE with capacity_factor 1.25.
- loop: a per-expert Python loop over the selected tokens with stacked [E, ...] weights indexed
  per expert, as the Hugging Face Mixtral block (transformers 5) does it.
``ratio_to_limit`` is tokens/s over the limit's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moekit import MoE, MoEConfig
from moekit.config import GEMM_BACKENDS


@dataclass(frozen=True)
class Shape:
    name: str
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    tokens: int


SHAPES = {
    "S1": Shape("S1", 512, 1024, 8, 2, 4096),
    "S2": Shape("S2", 1024, 1408, 64, 4, 2048),
}


Case = tuple[Callable[[], torch.Tensor], list[torch.Tensor]]  # (run forward, leaves whose .grad to reset)


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

    forms = {"limit-bmm": (bmm3, [x, w1, w3, w2]), "limit-bmm-fused": (bmm2, [x, w13, w2])}
    if hasattr(torch, "_grouped_mm"):
        forms["limit-grouped_mm"] = (grouped, [x_flat, w13, w2])
    return forms


def hf_style_loop(moe: MoE) -> Callable[[torch.Tensor], torch.Tensor]:
    """The Mixtral block's per-expert loop over moekit's router and stacked weights."""
    experts = moe.experts

    def forward(x_TD: torch.Tensor) -> torch.Tensor:
        routing = moe.router(x_TD)
        out = torch.zeros_like(x_TD)
        for e in range(experts.num_experts):
            picked = (routing.expert_idx == e).nonzero().squeeze(1)
            if picked.numel() == 0:
                continue
            tokens = routing.token_idx[picked]
            gate, up = (x_TD[tokens] @ experts.w_in[e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ experts.w_out[e]
            out.index_add_(0, tokens, y * routing.weights[picked, None])
        return out

    return forward


def make_cases(s: Shape) -> dict[str, Case]:
    cfg = dict(d_model=s.d_model, d_ff=s.d_ff, num_experts=s.num_experts, top_k=s.top_k)
    dropless = MoE(MoEConfig(**cfg))
    capacity = MoE(MoEConfig(**cfg, capacity_factor=1.25))
    capacity.load_state_dict(dropless.state_dict())
    x = torch.randn(s.tokens, s.d_model, requires_grad=True)
    loop = hf_style_loop(dropless)
    cases = dict(limit_forms(s))
    cases["moekit-dropless"] = (lambda: dropless(x), [x, *dropless.parameters()])
    for backend in (b for b in GEMM_BACKENDS if b != "auto"):
        other = MoE(MoEConfig(**cfg, gemm=backend))
        other.load_state_dict(dropless.state_dict())
        cases[f"moekit-dropless/{backend}"] = (lambda m=other: m(x), [x, *other.parameters()])
    cases["moekit-capacity"] = (lambda: capacity(x), [x, *capacity.parameters()])
    cases["loop"] = (lambda: loop(x), [x, *dropless.parameters()])
    return cases


def time_once(case: Case, backward: bool) -> float:
    """One timed call; gradients start unset, as after ``optimizer.zero_grad(set_to_none=True)``."""
    fn, leaves = case
    for leaf in leaves:
        leaf.grad = None
    start = time.perf_counter()
    if backward:
        y = fn()
        y.backward(torch.ones_like(y))
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - start


def run_shape(s: Shape, passes: list[str], repeats: int, warmup: int, skip: set[str]) -> list[dict]:
    torch.manual_seed(0)
    cases = {k: v for k, v in make_cases(s).items() if k not in skip}
    rows = []
    for pass_name in passes:
        backward = pass_name == "fwd+bwd"
        times: dict[str, list[float]] = {name: [] for name in cases}
        for round_ in range(warmup + repeats):
            for name, case in cases.items():
                elapsed = time_once(case, backward)
                if round_ >= warmup:
                    times[name].append(elapsed)
        medians = {name: statistics.median(t) for name, t in times.items()}
        limit_name = min((n for n in medians if n.startswith("limit")), key=medians.__getitem__)
        for name, median in medians.items():
            rows.append(
                {
                    "shape": s.name,
                    "impl": name,
                    "pass": pass_name,
                    "median_ms": round(median * 1e3, 2),
                    "tokens_per_s": round(s.tokens / median, 1),
                    "ratio_to_limit": round(medians[limit_name] / median, 3),
                    "limit_form": limit_name,
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'shape':<6}{'pass':<9}{'impl':<30}{'median ms':>11}{'tokens/s':>12}{'vs limit':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['shape']:<6}{r['pass']:<9}{r['impl']:<30}{r['median_ms']:>11.1f}{r['tokens_per_s']:>12.0f}{r['ratio_to_limit']:>10.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="S1,S2", help="comma-separated shape names (S1, S2)")
    parser.add_argument("--pass", dest="passes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per impl (median taken)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per impl first")
    parser.add_argument("--skip", default="", help="comma-separated impls to leave out (e.g. loop)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = parser.parse_args(argv)
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown shape {name!r} (choose from {', '.join(SHAPES)})")
        rows += run_shape(
            SHAPES[name], args.passes.split(","), args.repeats, args.warmup, set(filter(None, args.skip.split(",")))
        )
        print(f"# {name} done", file=sys.stderr, flush=True)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, SwiGLU")
    print_table(rows)
    if args.json:
        print(json.dumps({"cases": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
