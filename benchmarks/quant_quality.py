"""Quantized weights on a trained model: what int8 / int4 cost in quality.

Trains the ``shakespeare-moe`` preset with ``moekit train`` (once per seed; runs are kept under
--cache-dir), then loads each run with its experts offloaded as fp, int8 and int4 (what ``moekit
generate --memory-budget ... --expert-format`` runs), and resident with every other linear weight
quantized too (``--expert-format F --dense-format F``: attention, the head in int8 under int4), and
compares each with the resident fp32 model on the validation split (the tail of the corpus, never
trained on):
  val loss      teacher-forced cross-entropy over every non-overlapping context window of the split
  top-1         share of those positions whose most likely token is the resident model's
  rerouted      share of those tokens that any MoE layer sends to other experts than the resident model
  |dlogit|      mean and largest logit difference from the resident model over those positions (the
                largest comes after a token was rerouted: an expert choice the rounding flipped)
  greedy        generating --new-tokens greedily from --prompts prompts cut from the split: share of
                the new tokens equal to the resident model's, and the first position that differs
Spread: median and min-max over seeds (loss, logits) and over seeds x prompts (greedy).

    python benchmarks/quant_quality.py [--json] [--seeds 1 2 3] [--steps 1000] [--variants ...] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

import moekit
from moekit.infer.generate import generate
from moekit.infer.offload import OffloadOptions
from moekit.layer import MoE
from moekit.model import Transformer
from moekit.model_dir import load_for_inference
from moekit.routing import RouterOutput
from moekit.run.layout import latest_checkpoint
from moekit.run.load import LoadedRun, load_run
from moekit.run.manifest import load_manifest
from moekit.train.data import prepare_corpus
from moekit.units import format_bytes, parse_bytes

sys.path.insert(0, str(Path(__file__).parent))
from offload import COMPUTE_NOTE, TEXTS  # noqa: E402

PRESET = "shakespeare-moe"
FORMATS = ("fp", "int8", "int4")  # offloaded experts
DENSE = ("int8", "int4")  # resident, experts and dense weights in one format
VARIANTS = (*FORMATS, *(f"{fmt}+dense" for fmt in DENSE))


def trained_run(cache_dir: Path, data: Path, steps: int, seed: int, threads: int | None) -> Path:
    """The run directory of ``PRESET`` trained for ``steps`` at ``seed``: trained (or finished) by the CLI."""
    run_dir = cache_dir / f"{PRESET}-{steps}steps-seed{seed}"
    latest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if latest is not None and load_manifest(latest)["step"] >= steps:
        return run_dir
    command = [sys.executable, "-m", "moekit", "train", "--preset", PRESET, "--data", str(data)]
    command += ["--run-dir", str(run_dir), "--train.steps", str(steps), "--train.seed", str(seed), "--quiet"]
    command += ["--resume"] if latest is not None else []
    src = str(Path(moekit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"# training seed {seed}: {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, env=env, stdout=sys.stderr)
    return run_dir


def val_windows(run: LoadedRun, run_dir: Path, data: Path) -> tuple[Tensor, Tensor]:
    """Inputs and targets [N, C]: the validation split cut into non-overlapping context windows."""
    ctx = run.config.model.context_length
    data_cfg = dataclasses.replace(run.config.data, path=str(data))
    val = torch.from_numpy(np.asarray(prepare_corpus(data_cfg, ctx, tokenizer_dir=run_dir).val, dtype=np.int64))
    n = (len(val) - 1) // ctx
    return val[: n * ctx].view(n, ctx), val[1 : n * ctx + 1].view(n, ctx)


@torch.no_grad()
def teacher_forced(model: Transformer, x_NC: Tensor, y_NC: Tensor, batch: int) -> tuple[float, Tensor, Tensor]:
    """Mean cross-entropy (the model's own ``lm_loss``), the logits [N, C, V] and each token's experts
    [N * C, MoE layers * K] (sorted within a layer), recorded from the routers' outputs."""
    picks: list[Tensor] = []

    def record(router: torch.nn.Module, inputs: tuple, out: RouterOutput) -> None:
        order = out.token_idx.argsort(stable=True)  # assignments token by token
        picks.append(out.expert_idx[order].view(out.num_tokens, -1).sort(dim=1).values)

    routers = [block.ffn.router for block in model.blocks if isinstance(block.ffn, MoE)]
    hooks = [router.register_forward_hook(record) for router in routers]
    total, logits = 0.0, []
    try:
        for i in range(0, len(x_NC), batch):
            out = model(x_NC[i : i + batch], y_NC[i : i + batch])
            total += out.lm_loss.item() * y_NC[i : i + batch].numel()
            logits.append(out.logits.float())
    finally:
        for hook in hooks:
            hook.remove()
    assert len(picks) == len(logits) * len(routers), "a router ran outside its layer (prefetch must be off)"
    layers = len(routers)
    experts = torch.cat([torch.cat(picks[i : i + layers], dim=1) for i in range(0, len(picks), layers)])
    return total / y_NC.numel(), torch.cat(logits), experts


def greedy_match(new_PN: Tensor, ref_PN: Tensor) -> list[dict]:
    """Per prompt: share of new tokens equal to the reference's, and the first position that differs."""
    rows = []
    for new, ref in zip(new_PN, ref_PN, strict=True):
        differ = (new != ref).nonzero()
        rows.append(
            dict(same=(new == ref).float().mean().item(), first_diff=differ[0, 0].item() if len(differ) else None)
        )
    return rows


def evaluate_seed(run_dir: Path, args: argparse.Namespace) -> dict:
    """Each of ``args.variants`` of one trained run against its resident fp32 model."""
    resident = load_run(run_dir)
    x_NC, y_NC = val_windows(resident, run_dir, args.data)
    step = len(x_NC) // args.prompts
    prompts_PL = torch.stack([x_NC[i * step, : args.prompt_len] for i in range(args.prompts)])
    ref_loss, ref_logits, ref_experts = teacher_forced(resident.model, x_NC, y_NC, args.batch)
    ref_new = generate(resident.model, prompts_PL, args.new_tokens, temperature=0)[:, args.prompt_len :]
    out = dict(run_dir=str(run_dir), val_tokens=y_NC.numel(), resident_val_loss=ref_loss, formats={})
    for variant in args.variants:
        fmt = variant.removesuffix("+dense")
        if variant in FORMATS:
            # NOTE: prefetch only reads ahead (outputs are the same); off, each router runs once per layer
            options = OffloadOptions(memory_budget=args.budget, expert_format=fmt, prefetch="off")
            run = load_run(run_dir, offload=options)
        else:
            run = load_for_inference(run_dir, expert_format=fmt, dense_format=fmt)[0]
        loss, logits, experts = teacher_forced(run.model, x_NC, y_NC, args.batch)
        new = generate(run.model, prompts_PL, args.new_tokens, temperature=0)[:, args.prompt_len :]
        if run.offloader is not None:
            store = run.offloader.store
            run.offloader.close()
            expert_bytes = len(store.pieces) * store.bytes_per_expert
        else:
            expert_bytes = sum(b.nbytes for moe in run.model.moe_layers() for b in moe.experts.buffers())
        out["formats"][variant] = dict(
            expert_bytes=expert_bytes,
            val_loss=loss,
            val_loss_delta=loss - ref_loss,
            top1_same=(logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            rerouted=(experts != ref_experts).any(dim=1).float().mean().item(),
            mean_logit_diff=(logits - ref_logits).abs().mean().item(),
            max_logit_diff=(logits - ref_logits).abs().max().item(),
            greedy=greedy_match(new, ref_new),
        )
        print(f"# seed run {run_dir.name} {variant}: val loss {loss:.4f}", file=sys.stderr, flush=True)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def summarise(seeds: dict[int, dict], new_tokens: int, variants: list[str]) -> dict[str, dict]:
    """Per variant: median and min-max over seeds, greedy figures over seeds x prompts."""
    summary = {}
    for variant in variants:
        per_seed = [s["formats"][variant] for s in seeds.values()]
        greedy = [g for f in per_seed for g in f["greedy"]]
        summary[variant] = dict(
            expert_bytes=per_seed[0]["expert_bytes"],
            val_loss=spread([f["val_loss"] for f in per_seed]),
            val_loss_delta=spread([f["val_loss_delta"] for f in per_seed]),
            top1_same=spread([f["top1_same"] for f in per_seed]),
            rerouted=spread([f["rerouted"] for f in per_seed]),
            mean_logit_diff=spread([f["mean_logit_diff"] for f in per_seed]),
            max_logit_diff=spread([f["max_logit_diff"] for f in per_seed]),
            greedy_same=spread([g["same"] for g in greedy]),
            first_diff=spread([new_tokens if g["first_diff"] is None else g["first_diff"] for g in greedy]),
            prompts_identical=sum(g["first_diff"] is None for g in greedy),
            prompts=len(greedy),
        )
    return summary


def fmt_spread(s: dict[str, float], f: str, scale: float = 1.0) -> str:
    return f"{s['median'] * scale:{f}} [{s['min'] * scale:{f}}, {s['max'] * scale:{f}}]"


def table(r: dict) -> str:
    first = next(iter(r["seeds"].values()))
    summary = r["summary"]
    rows = [  # label, figure, format
        ("val loss", "val_loss", ".4f"),
        ("val loss - resident's", "val_loss_delta", "+.5f"),
        ("top-1 = resident's", "top1_same", ".2%"),
        ("tokens rerouted", "rerouted", ".2%"),
        ("mean |dlogit|", "mean_logit_diff", ".4f"),
        ("max |dlogit|", "max_logit_diff", ".3f"),
        ("greedy tokens same", "greedy_same", ".0%"),
        ("first differing token", "first_diff", ".0f"),
    ]
    lines = [
        f"{PRESET} trained {r['steps']} steps, seeds {' '.join(map(str, r['seeds']))}; resident fp32 val loss "
        + ", ".join(f"{s['resident_val_loss']:.4f}" for s in r["seeds"].values()),
        f"held-out: {first['val_tokens']:,} tokens of the validation split; greedy: {r['prompts']} prompts of "
        f"{r['prompt_len']} tokens x {r['new_tokens']} new tokens; experts offloaded at a {format_bytes(r['budget'])} "
        "budget, or resident with the dense weights quantized too (+dense)",
        "each cell: median [min, max] over seeds (greedy rows: over seeds x prompts), against the resident fp32 model",
        f"{'weights':24}" + "".join(f"{variant:>30}" for variant in summary),
        f"{'expert bytes':24}" + "".join(f"{format_bytes(s['expert_bytes']):>30}" for s in summary.values()),
    ]
    for label, key, f in rows:
        lines.append(f"{label:24}" + "".join(f"{fmt_spread(s[key], f):>30}" for s in summary.values()))
    same = [f"{s['prompts_identical']}/{s['prompts']}" for s in summary.values()]
    lines.append(f"{'prompts all same':24}" + "".join(f"{x:>30}" for x in same))
    lines.append(f"first differing token: {r['new_tokens']} = none. {COMPUTE_NOTE}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    text = next((p for p in TEXTS if p.is_file()), TEXTS[0])
    parser.add_argument("--data", type=Path, default=text, help="training and validation text (tinyshakespeare)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/moekit-quant-bench"), help="trained runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one trained model per seed")
    parser.add_argument("--steps", type=int, default=1000, help="training steps (the preset's schedule: 2000)")
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="(default: all: %(default)s)"
    )
    parser.add_argument("--budget", default="4MB", help="memory budget of the offloaded runs (no effect on outputs)")
    parser.add_argument("--prompts", type=int, default=16, help="greedy prompts per seed")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=100, help="greedy tokens generated per prompt")
    parser.add_argument("--batch", type=int, default=64, help="windows per teacher-forced forward")
    parser.add_argument("--threads", type=int, help="torch CPU threads, here and in training (default: torch's)")
    args = parser.parse_args()
    if not args.data.is_file():
        parser.error(f"--data: no such file: {args.data}")
    args.budget = parse_bytes(args.budget, "--budget")
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = {seed: trained_run(args.cache_dir, args.data, args.steps, seed, args.threads) for seed in args.seeds}
    seeds = {seed: evaluate_seed(run_dir, args) for seed, run_dir in runs.items()}
    result = dict(
        steps=args.steps,
        budget=args.budget,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        seeds=seeds,
        summary=summarise(seeds, args.new_tokens, args.variants),
    )
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
