"""Training-step time of moekit's dense and MoE presets against nanoGPT's model, side by side.

    python benchmarks/step_vs_nanogpt.py [--json] [--runs 5] [--rounds 40] [--threads 2]

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

Each run builds the three models afresh (seeded by the run's index) and times one optimizer step
each (forward, backward, clipping, AdamW), interleaved round by round on one random batch; a run's
figure is its median after 10 warm-up rounds, its ratio that median over nanoGPT's. The table gives
the median and min-max over runs.

The process keeps freed host memory as ``moekit train`` does on CPU (``moekit.hostmem``); being
process-wide, that serves nanoGPT's step too. ``--glibc-defaults`` runs with glibc's own settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _spread import show, spread  # noqa: E402

from moekit import runconfig  # noqa: E402
from moekit.config import TrainConfig  # noqa: E402
from moekit.hostmem import keep_freed_memory  # noqa: E402
from moekit.model import Transformer  # noqa: E402
from moekit.train.optim import build_optimizer  # noqa: E402

VOCAB, CONTEXT, BATCH = 65, 64, 12
NANOGPT = "nanoGPT model (reimpl.)"
PRESETS = ("shakespeare-dense", "shakespeare-moe")
WARMUP = 10


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
    opt = build_optimizer(model.parameters(), cfg)

    def step() -> None:
        loss().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_steps(seed: int) -> dict[str, Callable[[], None]]:
    """Fresh models seeded by ``seed``, each with its step on the same random batch."""
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    nano = NanoGPT()
    steps = {NANOGPT: make_step(nano, lambda: nano(x, y), runconfig.resolve(PRESETS[0], {}).train)}
    for preset in PRESETS:
        cfg = runconfig.resolve(preset, {"model.vocab_size": str(VOCAB)})
        model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None)
        steps[f"moekit {preset}"] = make_step(model, lambda m=model: m(x, y).loss, cfg.train)
    return steps


def one_run(seed: int, rounds: int) -> dict[str, float]:
    """Median ms per step of each model over ``rounds`` interleaved rounds (after the warm-up)."""
    steps = build_steps(seed)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds + WARMUP):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t[WARMUP:]) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs, each with fresh models (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per run (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    parser.add_argument(
        "--glibc-defaults", action="store_true", help="do not keep freed memory (glibc's trim and mmap thresholds)"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1:
        parser.error("--runs and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    kept = not args.glibc_defaults and keep_freed_memory()
    runs = [one_run(seed, args.rounds) for seed in range(args.runs)]
    ms = {name: [r[name] for r in runs] for name in runs[0]}
    ratio = {name: [r[name] / r[NANOGPT] for r in runs] for name in runs[0]}
    print("nanoGPT's model reimplemented here, not nanoGPT's code; one optimizer implementation for all")
    print(f"{'model':<28}{'ms/step median (min .. max)':>30}{'vs nanoGPT median (min .. max)':>33}")
    print("-" * 91)
    for name in ms:
        print(f"{name:<28}{show(ms[name], '.2f'):>30}{show(ratio[name], '.3f'):>33}")
    allocator = "freed memory kept" if kept else "glibc defaults"
    print(
        f"(torch threads: {torch.get_num_threads()}; {allocator}; {args.runs} runs of {args.rounds} "
        "interleaved rounds, each run's median)"
    )
    if args.json:
        figures = {name: {"ms": spread(ms[name], 3), "vs_nanogpt": spread(ratio[name], 3)} for name in ms}
        print(json.dumps({"runs": args.runs, "rounds": args.rounds, **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
