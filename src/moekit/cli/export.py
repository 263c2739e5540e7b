"""``moekit export``: a run's model as one safetensors file or as a Hugging Face directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli.common import check_out_dir, dtype_name, resolve_dtype


def add_parser(commands) -> None:
    export = commands.add_parser(
        "export", help="write a run's model in another format", description="Write a run's model in another format."
    )
    export.set_defaults(run=run)
    export.add_argument("run_dir", type=Path, help="a run directory")
    export.add_argument(
        "--format",
        choices=sorted(EXPORTERS),
        default="safetensors",
        help="safetensors: a run directory whose checkpoint is one model.safetensors, consolidated from any "
        "layout's shards one block at a time (default); hf: a Hugging Face directory "
        "(Mixtral, Qwen2-MoE, Qwen3-MoE or gpt-oss)",
    )
    export.add_argument("--out", type=Path, required=True, help="the directory to write")
    export.add_argument(
        "--dtype", type=dtype_name, help="hf: fp32, bf16 or fp16 weights (default: the run's own, e.g. bf16)"
    )


def _hf(args: argparse.Namespace) -> None:
    from moekit.convert import to_hf
    from moekit.convert.source import carry_chat_files
    from moekit.run.load import load_run

    if (args.out / "config.json").exists():
        raise ValueError(f"--out {args.out}: already holds a config.json; choose an empty directory")
    loaded = load_run(args.run_dir)
    family = to_hf(loaded.model, args.out, resolve_dtype(args.dtype))
    print(f"{args.out}: {family.architecture} (load with transformers.AutoModelForCausalLM.from_pretrained)")
    if loaded.tokenizer.name == "bpe":  # a Hugging Face tokenizer already; byte and char ones have no such form
        loaded.tokenizer.save(args.out)
        carry_chat_files(args.run_dir, args.out)
    else:
        print(f"tokenizer: moekit's {loaded.tokenizer.name} tokenizer has no Hugging Face form; not written")


def _safetensors(args: argparse.Namespace) -> None:
    from moekit.run.export import export_run

    if args.dtype is not None:
        raise ValueError(f"--dtype {args.dtype}: only with --format hf (safetensors keeps the run's own)")
    path = export_run(args.run_dir, args.out)
    print(f"{args.out}: {path / 'model.safetensors'} (moekit generate {args.out}; train --init {args.out})")


EXPORTERS = {"hf": _hf, "safetensors": _safetensors}


def run(args: argparse.Namespace) -> int:
    check_out_dir(args.out)
    EXPORTERS[args.format](args)
    return 0
