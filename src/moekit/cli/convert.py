"""``moekit convert``: a Hugging Face model directory into a moekit run."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert a Hugging Face model directory into a moekit run",
        description="Convert a local Hugging Face directory (config.json, safetensors, tokenizer.json) of "
        "Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, gpt-oss, Llama, Mistral or Qwen2 into a moekit run directory.",
    )
    convert.set_defaults(run=run)
    convert.add_argument("hf_dir", type=Path, help="a Hugging Face model directory")
    convert.add_argument("--out", dest="run_dir", type=Path, required=True, help="the run directory to write")


def run(args: argparse.Namespace) -> int:
    from moekit.convert.source import load_model_source
    from moekit.run.checkpoint import save_weights_run

    if (args.hf_dir / "checkpoints").is_dir():
        raise ValueError(f"{args.hf_dir}: is a moekit run already (convert reads Hugging Face directories)")
    model, tokenizer, cfg = load_model_source(args.hf_dir)
    out = args.run_dir
    save_weights_run(out, cfg.to_json(), model, tokenizer, f"converted from {args.hf_dir}")
    kind = f"{len(model.moe_layers())} MoE blocks" if model.moe_layers() else "dense"
    print(f"run directory: {out} ({model.num_params() / 1e6:.2f}M parameters, {kind})")
    print(f"generate: moekit generate {out} --prompt '...';  train: moekit train --init {out} --run-dir ...")
    return 0
