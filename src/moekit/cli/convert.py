"""``moekit convert``: a Hugging Face model directory into a moekit run."""

from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli.common import dtype_name, resolve_dtype


def add_parser(commands) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert a Hugging Face model directory into a moekit run",
        description="Convert a local Hugging Face directory (config.json, safetensors, tokenizer.json) of "
        "Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, gpt-oss, Llama, Mistral or Qwen2 into a moekit run directory. The "
        "run holds a copy of the weights, one model.safetensors of (parameters x bytes per weight of --dtype), "
        "streamed one tensor at a time: memory holds about one tensor (one expert), whatever the model's size.",
    )
    convert.set_defaults(run=run)
    convert.add_argument("hf_dir", type=Path, help="a Hugging Face model directory")
    convert.add_argument("--out", dest="run_dir", type=Path, required=True, help="the run directory to write")
    convert.add_argument(
        "--dtype", type=dtype_name, help="fp32, bf16 or fp16 weights (default: the checkpoint's own, e.g. bf16)"
    )


def run(args: argparse.Namespace) -> int:
    from moekit.convert.source import carry_chat_files, hf_source
    from moekit.run.checkpoint import save_weights_run

    if (args.hf_dir / "checkpoints").is_dir():
        raise ValueError(f"{args.hf_dir}: is a moekit run already (convert reads Hugging Face directories)")
    checkpoint, tokenizer, cfg = hf_source(args.hf_dir, resolve_dtype(args.dtype))
    out = args.run_dir
    path = save_weights_run(out, cfg.to_json(), checkpoint.write, tokenizer, f"converted from {args.hf_dir}")
    carry_chat_files(args.hf_dir, out)
    kind = f"{len(checkpoint.model_cfg.moe_layers())} MoE blocks" if checkpoint.model_cfg.moe_layers() else "dense"
    size = (path / "model.safetensors").stat().st_size
    dtype = str(checkpoint.dtype).removeprefix("torch.")
    params = f"{checkpoint.num_params / 1e6:.2f}M parameters"
    if checkpoint.skipped:
        first = checkpoint.skipped[0]
        print(f"left out {len(checkpoint.skipped)} multi-token-prediction tensors ({first}, ...): moekit has no MTP")
    print(f"run directory: {out} ({params}, {kind}, {dtype}, {size / 1e9:.2f} GB)")
    print(f"generate: moekit generate {out} --prompt '...';  train: moekit train --init {out} --run-dir ...")
    return 0
