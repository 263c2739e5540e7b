"""``moekit upcycle``: a dense model into an MoE whose experts start as its MLPs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def add_parser(commands) -> None:
    up = commands.add_parser(
        "upcycle",
        help="turn a dense model into an MoE whose experts start as its MLPs",
        description="Sparse upcycling: every MLP of a dense model (a moekit run or a Hugging Face Llama, Mistral "
        "or Qwen2 directory) becomes an MoE layer computing the same function at step 0. "
        "Continue with: moekit train --init RUN_DIR",
    )
    up.set_defaults(run=run)
    up.add_argument("dense", type=Path, help="a dense moekit run directory or Hugging Face directory")
    up.add_argument(
        "--experts",
        dest="num_experts",
        type=int,
        default=8,
        metavar="N",
        help="experts per MoE layer (default: %(default)s)",
    )
    up.add_argument("--top-k", type=int, default=2, help="experts each token picks (default: %(default)s)")
    up.add_argument("--split", type=int, default=1, help="cut each MLP into this many finer experts (default: 1)")
    up.add_argument("--noise", type=float, default=0.0, help="relative noise added to each expert (default: 0)")
    up.add_argument("--seed", type=int, default=0, help="seed of the noise (default: %(default)s)")
    up.add_argument("--out", dest="run_dir", type=Path, required=True, help="the run directory to write")


def run(args: argparse.Namespace) -> int:
    from moekit.convert.source import carry_chat_files, load_model_source
    from moekit.convert.upcycle import upcycle
    from moekit.run.checkpoint import save_weights_run
    from moekit.runconfig import for_model

    dense, tokenizer, cfg = load_model_source(args.dense)
    model = upcycle(dense, args.num_experts, args.top_k, split=args.split, noise=args.noise, seed=args.seed)
    # Keep the dense run's data and training settings: continuing on the same text is the usual next step.
    up_cfg = dataclasses.replace(for_model(model.cfg, model.moe_cfg, cfg.data), train=cfg.train)
    save_weights_run(args.run_dir, up_cfg.to_json(), model, tokenizer, f"upcycled from {args.dense}")
    carry_chat_files(args.dense, args.run_dir)
    total, active = model.num_params() / 1e6, model.num_active_params() / 1e6
    print(f"run directory: {args.run_dir} ({total:.2f}M parameters, {active:.2f}M active per token)")
    print(f"continue: moekit train --init {args.run_dir} --run-dir ...")
    return 0
