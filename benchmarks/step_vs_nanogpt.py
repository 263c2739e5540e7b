"""Training-step time of moekit's dense and MoE presets against nanoGPT's model, side by side.

    python benchmarks/step_vs_nanogpt.py [--json] [--rounds 120]

The reference is nanoGPT's ``model.py`` as its CPU run uses it (``bias=False``, dropout 0 kept as
modules, learned positions, tied embeddings, AdamW with decay groups and no fused kernel, which
nanoGPT enables on CUDA only), at the configuration of its documented CPU run: 4 layers, 4 heads,
d_model 128, context 64, batch 12, character vocabulary of 65. moekit runs ``shakespeare-dense`` and
``shakespeare-moe`` (MoE every other block). One optimizer step each (forward, backward, clipping,
AdamW), interleaved round by round on the same batch; medians after 10 warm-up rounds.

The process keeps freed host memory as ``moekit train`` does on CPU (``moekit.hostmem``); being
process-wide, that serves nanoGPT's step too. ``--glibc-defaults`` runs with glibc's own settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from moekit import runconfig
from moekit.hostmem import keep_freed_memory
from moekit.model import Transformer
from moekit.train.optim import build_optimizer

VOCAB, CONTEXT, BATCH = 65, 64, 12


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
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def nanogpt_step(x: torch.Tensor, y: torch.Tensor):
    model = NanoGPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))

    def step() -> None:
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def moekit_step(preset: str, x: torch.Tensor, y: torch.Tensor):
    cfg = runconfig.resolve(preset, {"model.vocab_size": str(VOCAB)})
    model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None)
    opt = build_optimizer(model.parameters(), cfg.train)

    def step() -> None:
        model(x, y).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=120, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    parser.add_argument(
        "--glibc-defaults", action="store_true", help="do not keep freed memory (glibc's trim and mmap thresholds)"
    )
    args = parser.parse_args(argv)
    kept = not args.glibc_defaults and keep_freed_memory()
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    steps = {
        "nanoGPT": nanogpt_step(x, y),
        "moekit shakespeare-dense": moekit_step("shakespeare-dense", x, y),
        "moekit shakespeare-moe": moekit_step("shakespeare-moe", x, y),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds + 10):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    ms = {name: statistics.median(t[10:]) * 1e3 for name, t in times.items()}
    print(f"{'model':<28}{'ms/step':>10}{'vs nanoGPT':>12}")
    for name, value in ms.items():
        print(f"{name:<28}{value:>10.2f}{value / ms['nanoGPT']:>11.2f}x")
    allocator = "freed memory kept" if kept else "glibc defaults"
    print(f"(torch threads: {torch.get_num_threads()}; {allocator}; medians of {args.rounds} interleaved rounds)")
    if args.json:
        print(json.dumps({name: round(value, 3) for name, value in ms.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
