"""``moekit train``: parse, resolve the config, train (or launch the ranks that do), then report."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from moekit.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    add_config_flags,
    device_name,
    positive_int,
    resolve_device,
)


def add_parser(commands) -> None:
    from moekit.runconfig import preset_names

    train = commands.add_parser(
        "train",
        help="train a GPT-style MoE language model",
        description="Train a GPT-style MoE language model. With no flags: the 'default' preset on this "
        "Python's standard library source, a few minutes on a laptop CPU. Every config field below can be "
        "overridden; the preset's value, where it sets one, replaces the base default shown.",
        epilog=f"presets: {', '.join(preset_names())} (or a path to a .toml file)",
    )
    train.set_defaults(run=run)
    train.add_argument("--preset", default="default", help="config preset (default: %(default)s)")
    train.add_argument("--data", help="text file, directory or glob (default: Python's stdlib source)")
    train.add_argument("--run-dir", type=Path, help="where the run is written (default: runs/PRESET-TIME)")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its latest checkpoint, at any layout (implied on an elastic restart)",
    )
    train.add_argument(
        "--fallback",
        action="store_true",
        help="when resuming, if the latest checkpoint is missing or corrupt, use the newest intact one before it",
    )
    train.add_argument(
        "--init",
        type=Path,
        metavar="RUN_DIR",
        help="start from this run's weights, config and tokenizer (a converted or upcycled model) with a fresh "
        "optimizer; --preset is then not used, flags override the run's config",
    )
    train.add_argument(
        "--device", type=device_name, default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)"
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    launch = train.add_argument_group(
        "launching ranks",
        "Run under 'torchrun --nproc-per-node N -m moekit train ...', or let --nproc start torch's elastic "
        "launcher for you; size the layout with --parallel.dp/ep/tp/pp.",
    )
    launch.add_argument(
        "--nproc", type=positive_int, help="ranks to start on this machine (through torch.distributed.run)"
    )
    launch.add_argument("--nnodes", default="1", help="machines, or MIN:MAX for an elastic job (default: 1)")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT every machine can reach (needed with --nnodes > 1)")
    launch.add_argument("--rdzv-id", default="moekit", help="job id shared by the machines (default: %(default)s)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restarts after a rank fails (default: 0)")
    add_config_flags(train)


def _config(args: argparse.Namespace):
    """The run's config: a preset with flags over it, or (--resume, --init) the run's own with flags."""
    from moekit import runconfig

    overrides = {k: v for k, v in vars(args).items() if "." in k}
    if args.data is not None:
        overrides["data.path"] = args.data
    if "model.vocab_size" in overrides:  # train() sets it; a value typed here would be dropped unread
        raise ValueError(
            "--model.vocab_size: a run embeds its tokenizer's vocabulary (a resumed or --init run its own): "
            "choose it with --data.tokenizer and --data.bpe_vocab_size"
        )
    if not (args.resume or args.init):
        return runconfig.resolve(args.preset, overrides)
    if args.run_dir is None:
        raise ValueError("--resume and --init need --run-dir: the run to continue or to start")
    if args.resume and "train.grad_accum" in overrides:  # what else a resume keeps: train/resume.py
        raise ValueError(
            "--train.grad_accum: a resumed run keeps its checkpoint's global batch (each rank's grad_accum "
            "follows the layout); start a new run from it with --init to change the batch"
        )
    source = args.init or args.run_dir
    return runconfig.build(runconfig.apply_overrides(runconfig.read_tree(source / "config.json"), overrides))


def run(args: argparse.Namespace) -> int:
    from moekit.parallel.runtime import global_rank
    from moekit.train.loop import train

    launcher_flags = {"--nnodes": args.nnodes != "1", "--rdzv-endpoint": args.rdzv_endpoint is not None}
    launcher_flags |= {"--rdzv-id": args.rdzv_id != "moekit", "--max-restarts": args.max_restarts != 0}
    given = [flag for flag, set_ in launcher_flags.items() if set_]
    if given and args.nproc is None and "WORLD_SIZE" not in os.environ:  # they would be dropped unread
        raise ValueError(f"{given[0]}: a flag of the launcher, which --nproc N (ranks on this machine) starts")
    cfg = _config(args)
    run_dir = args.run_dir or Path("runs") / f"{Path(args.preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.nproc is not None and "WORLD_SIZE" not in os.environ:
        return _launch(args, cfg, run_dir)
    result = train(
        cfg,
        run_dir,
        resume=args.resume,
        device=resolve_device(args.device),
        progress=not args.quiet,
        init=args.init,
        fallback=args.fallback,
    )
    _leave_process_group()
    if result.interrupted:
        if global_rank() == 0:
            print(f"continue with: moekit train --resume --run-dir {run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if global_rank() == 0:  # rank 0 reports for the job
        _report(cfg, run_dir, result, resolve_device(args.device))
    return 0


def _report(cfg, run_dir: Path, result, device: str) -> None:
    """Plots, where to look, and a short sample of the trained model."""
    from moekit.infer.generate import generate_text
    from moekit.run.load import load_run
    from moekit.train.plots import plot_run

    plots = plot_run(run_dir)
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "-"
    lines = [f"run directory: {run_dir}", f"  final val loss {val} after {result.steps} steps"]
    lines.append(f"  checkpoint:  {result.checkpoint}")
    lines.append(f"  plots:       {', '.join(str(p) for p in plots)}")
    lines.append(f"  tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}")
    if cfg.train.sample_tokens:
        sample = generate_text(load_run(run_dir, device), "\n", cfg.train.sample_tokens, seed=cfg.train.seed)
        (run_dir / "sample.txt").write_text(sample)
        lines.append(f"  sample:      {run_dir / 'sample.txt'}")
        lines.append("-" * 60 + "\n" + sample.strip("\n") + "\n" + "-" * 60)
    lines.append(f"generate more: moekit generate {run_dir} --prompt '...'")
    print("\n".join(lines))


def _leave_process_group() -> None:
    """Tear down the ranks' process group before exit: left to interpreter shutdown, gloo's threads
    can abort a rank (``terminate called without an active exception``) after a finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _launch(args: argparse.Namespace, cfg, run_dir: Path) -> int:
    """Start the ranks through torch's elastic launcher, after checking the layout here."""
    from moekit.parallel.launch import Launch, launch_training, without_launch_flags
    from moekit.parallel.mesh import resolve_layout

    launch = Launch(args.nproc, args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.max_restarts)
    if not launch.multi_node:
        resolve_layout(cfg, args.nproc, args.nproc)
    argv = list(args.argv)
    argv.remove("train")
    forwarded = without_launch_flags(argv)
    if args.run_dir is None:
        forwarded += ["--run-dir", str(run_dir)]
    failed = launch_training(launch, forwarded, run_dir)
    if failed is None:
        return 0
    rank, code = failed
    print(
        f"moekit train: error: rank {rank} failed with exit code {code}; its error is printed "
        f"above and every rank's output is under {run_dir / 'logs'}",
        file=sys.stderr,
    )
    return EXIT_FAILURE
