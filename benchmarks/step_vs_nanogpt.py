"""Training-step time of moekit's dense and MoE presets against nanoGPT's model, side by side.

    python benchmarks/step_vs_nanogpt.py [--json] [--runs 3] [--block 50] [--rounds 3] [--threads 1]
                                        [--compile] [--profile]

The reference is a faithful reimplementation of nanoGPT's ``model.py`` below (nanoGPT is not an
installable package, so its own code does not run here): its module layout, ``bias=False``,
dropout 0 kept as modules, learned positions, tied embeddings, at the configuration of nanoGPT's
documented CPU run: 4 layers, 4 heads, d_model 128, context 64, batch 12, character vocabulary of
65. moekit runs ``shakespeare-dense`` and ``shakespeare-moe`` (MoE every other block).

All three train with the same optimizer code: moekit's ``build_optimizer`` (torch's fused AdamW,
weight decay on parameters of two or more dimensions only, nanoGPT's own decay groups) with the
``shakespeare-dense`` settings, which are nanoGPT's CPU run's (lr 1e-3, betas 0.9/0.99, decay 0.1,
clipping at 1.0). nanoGPT's ``configure_optimizers`` turns the fused kernel on for CUDA only, so its
own CPU run takes the slower foreach path; sharing the fused one gives the baseline the faster
optimizer and leaves the models as the only difference.

Each run builds the models afresh (seeded by the run's index) and times optimizer steps (forward,
backward, clipping, AdamW) on one random batch, in blocks of ``--block`` consecutive steps per model,
the models taking turns block by block for ``--rounds`` rounds (``_spread.alternate_blocks`` says why
blocks, not single steps). The table gives each model's ms per step as the median and min-max over
all its blocks (every round of every run), and each ratio over the per-round ratios of its blocks.

``--compile`` adds each model compiled the way it is meant to be: nanoGPT's whole model under
``torch.compile`` (as its ``train.py`` does), moekit's per block (``moekit.parallel.compile``, MoE
dispatch eager). Compilation happens in an untimed warm-up block. ``--profile`` prints where the MoE
preset's step spends its extra time: torch.profiler's self time per op and step for the dense and
the MoE preset over one block each, sorted by the difference.

The process keeps freed host memory as ``moekit train`` does on CPU (``moekit.hostmem``); being
process-wide, that serves nanoGPT's step too. ``--glibc-defaults`` runs with glibc's own settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _spread import alternate_blocks, show, spread  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.config import TrainConfig  # noqa: E402
from moekit.hostmem import keep_freed_memory  # noqa: E402
from moekit.model import Transformer  # noqa: E402
from moekit.parallel.compile import apply_compile  # noqa: E402
from moekit.train.optim import build_optimizer  # noqa: E402

VOCAB, CONTEXT, BATCH = 65, 64, 12
NANOGPT = "nanoGPT model (reimpl.)"
PRESETS = ("shakespeare-dense", "shakespeare-moe")
DENSE, MOE = (f"moekit {p}" for p in PRESETS)
WARMUP = 10  # untimed steps per model first (compilation happens in them)
COMPILED = " compiled"


class NanoAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.resid_dropout = nn.Dropout(0.0)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.attn = NanoAttention(d, heads)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False), nn.Dropout(0.0)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT`` (model.py) reimplemented op for op, at its CPU run's size; returns the loss."""

    def __init__(self, d: int = 128, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(CONTEXT, d)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(NanoBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)


def make_step(model: nn.Module, loss: Callable[[], torch.Tensor], cfg: TrainConfig) -> Callable[[], None]:
    """One optimizer step of ``model`` on ``loss()``, with the optimizer and clipping moekit trains with."""
    opt = build_optimizer(model.named_parameters(), cfg)

    def step() -> None:
        loss().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_steps(seed: int, compile: bool) -> dict[str, Callable[[], None]]:
    """Fresh models seeded by ``seed``, each with its step on the same random batch (and compiled twins)."""
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    steps = {}
    for suffix in ("", COMPILED) if compile else ("",):
        nano = NanoGPT()
        forward = torch.compile(nano) if suffix else nano
        steps[NANOGPT + suffix] = make_step(nano, lambda f=forward: f(x, y), runconfig.resolve(PRESETS[0], {}).train)
        for preset in PRESETS:
            cfg = runconfig.resolve(preset, {"model.vocab_size": str(VOCAB)})
            model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None)
            if suffix:
                apply_compile(list(model.blocks))
            steps[f"moekit {preset}{suffix}"] = make_step(model, lambda m=model: m(x, y).loss, cfg.train)
    return steps


def one_run(seed: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """ms per step of each model in each of ``args.rounds`` block-alternating rounds (after a warm-up)."""
    steps = build_steps(seed, args.compile)
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    return alternate_blocks(steps, args.block, args.rounds)


def profile_extra(block: int, top: int = 15) -> None:
    """Self CPU ms per step of each op, dense vs MoE preset (eager), sorted by what MoE adds."""
    from torch.profiler import profile

    steps = build_steps(0, compile=False)
    per_op: dict[str, dict[str, float]] = {}
    for name in (DENSE, MOE):
        for _ in range(WARMUP):
            steps[name]()
        with profile() as prof:
            for _ in range(block):
                steps[name]()
        for event in prof.key_averages():
            per_op.setdefault(event.key, {})[name] = event.self_cpu_time_total / 1e3 / block
    rows = sorted(per_op.items(), key=lambda kv: kv[1].get(MOE, 0) - kv[1].get(DENSE, 0), reverse=True)
    total = {name: sum(v.get(name, 0) for v in per_op.values()) for name in (DENSE, MOE)}
    print(f"torch.profiler, self CPU ms per step over {block} steps (profiler overhead included), by what MoE adds:")
    print(f"{'op':<58}{'dense':>9}{'MoE':>9}{'MoE-dense':>11}")
    for op, v in rows[:top]:
        d, m = v.get(DENSE, 0.0), v.get(MOE, 0.0)
        print(f"{op[:57]:<58}{d:>9.2f}{m:>9.2f}{m - d:>+11.2f}")
    print(f"{'all ops':<58}{total[DENSE]:>9.2f}{total[MOE]:>9.2f}{total[MOE] - total[DENSE]:>+11.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs, each with fresh models (default: %(default)s)")
    parser.add_argument(
        "--block", type=int, default=50, help="consecutive steps per model and turn (default: %(default)s)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns of every model per run (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="also time each model compiled")
    parser.add_argument("--profile", action="store_true", help="print the profiler's per-op breakdown, dense vs MoE")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    parser.add_argument(
        "--glibc-defaults", action="store_true", help="do not keep freed memory (glibc's trim and mmap thresholds)"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.block < 1:
        parser.error("--runs, --block and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    kept = not args.glibc_defaults and keep_freed_memory()
    runs = [one_run(seed, args) for seed in range(args.runs)]
    names = list(runs[0])
    ms = {name: [block for r in runs for block in r[name]] for name in names}
    ratio = {name: _ratios(runs, name, NANOGPT + _suffix(name)) for name in names}
    print("nanoGPT's model reimplemented here, not nanoGPT's code; one optimizer implementation for all")
    print(f"{'model':<37}{'ms/step median (min .. max)':>30}{'vs nanoGPT median (min .. max)':>33}")
    print("-" * 100)
    for name in names:
        print(f"{name:<37}{show(ms[name], '.2f'):>30}{show(ratio[name], '.3f'):>33}")
    moe_vs_dense = {s or "eager": _ratios(runs, MOE + s, DENSE + s) for s in ("", COMPILED)[: 1 + args.compile]}
    for kind, values in moe_vs_dense.items():
        print(f"MoE preset / dense preset, {kind.strip()}: {show(values, '.3f')}")
    allocator = "freed memory kept" if kept else "glibc defaults"
    print(
        f"(torch threads: {torch.get_num_threads()}; {allocator}; {args.runs} runs of {args.rounds} rounds of "
        f"{args.block}-step blocks per model, models taking turns block by block; spread over blocks; vs nanoGPT: same "
        "compile mode)"
    )
    if args.profile:
        profile_extra(args.block)
    if args.json:
        figures = {name: {"ms": spread(ms[name], 3), "vs_nanogpt": spread(ratio[name], 3)} for name in names}
        extra = {f"moe_vs_dense_{k.strip()}": spread(v, 3) for k, v in moe_vs_dense.items()}
        print(json.dumps({"runs": args.runs, "rounds": args.rounds, "block": args.block, **figures, **extra}))
    return 0


def _suffix(name: str) -> str:
    return COMPILED if name.endswith(COMPILED) else ""


def _ratios(runs: list[dict[str, list[float]]], name: str, reference: str) -> list[float]:
    """Per round of every run: the block time of ``name`` over that of ``reference`` in the same round."""
    return [a / b for r in runs for a, b in zip(r[name], r[reference], strict=True)]


if __name__ == "__main__":
    raise SystemExit(main())
