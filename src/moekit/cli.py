"""The ``moekit`` command line: train, generate, serve, plot, convert, export, upcycle."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
import typing
from pathlib import Path

from moekit import __version__

EXIT_FAILURE = 1  # the run failed (a dead or hung rank)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("NoneType", "none").replace("typing.", "").upper()


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--section.field`` flag per config field, with its one-line reason as help."""
    from moekit.runconfig import SECTIONS, field_help

    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}] {cls.__doc__.splitlines()[0]}")
        reasons = field_help(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if section == "moe" and f.name == "d_model":
                continue  # decided by model.d_model
            default = "" if f.default is dataclasses.MISSING else f" (base default {f.default})"
            if section == "moe" and f.name == "d_ff":
                default = " (default model.d_ff)"
            group.add_argument(
                f"--{section}.{f.name}",
                metavar=_type_name(hints[f.name]),
                default=argparse.SUPPRESS,
                help=reasons.get(f.name, "") + default,
            )


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported on one line that says where to look."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _device_name(text: str) -> str:
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N or auto)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from moekit.runconfig import preset_names

    parser = _Parser(
        prog="moekit",
        description="Train and serve Mixture-of-Experts language models with PyTorch.",
        epilog="Run 'moekit COMMAND --help' for a command's options. Start with: moekit train",
    )
    parser.add_argument("--version", action="version", version=f"moekit {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a GPT-style MoE language model",
        description="Train a GPT-style MoE language model. With no flags: the 'default' preset on this "
        "Python's standard library source, a few minutes on a laptop CPU. Every config field below can be "
        "overridden; the preset's value, where it sets one, replaces the base default shown.",
        epilog=f"presets: {', '.join(preset_names())} (or a path to a .toml file)",
    )
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
        "--device", type=_device_name, default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)"
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    launch = train.add_argument_group(
        "launching ranks",
        "Run under 'torchrun --nproc-per-node N -m moekit train ...', or let --nproc start torch's elastic "
        "launcher for you; size the layout with --parallel.dp/ep/tp/pp.",
    )
    launch.add_argument(
        "--nproc", type=_positive_int, help="ranks to start on this machine (through torch.distributed.run)"
    )
    launch.add_argument("--nnodes", default="1", help="machines, or MIN:MAX for an elastic job (default: 1)")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT every machine can reach (needed with --nnodes > 1)")
    launch.add_argument("--rdzv-id", default="moekit", help="job id shared by the machines (default: %(default)s)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restarts after a rank fails (default: 0)")
    add_config_flags(train)

    gen = commands.add_parser(
        "generate", help="generate text from a trained run", description="Generate text from a trained run."
    )
    gen.add_argument("run_dir", type=Path, help="a run directory written by moekit train")
    gen.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    gen.add_argument(
        "--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all (default: %(default)s)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    gen.add_argument("--device", type=_device_name, default="auto", help="cpu, cuda, cuda:N or auto")
    gen.add_argument("--prompts-file", type=Path, help="one prompt per line, generated in batches (replaces --prompt)")
    gen.add_argument("--batch-size", type=int, default=1, help="prompts generated together (default: %(default)s)")
    _add_offload_flags(gen)

    serve = commands.add_parser(
        "serve",
        help="serve a trained run over HTTP",
        description="Serve a trained run over HTTP: POST /generate (JSON), GET /health.",
    )
    serve.add_argument("run_dir", type=Path, help="a run directory written by moekit train")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 = any free)")
    serve.add_argument("--device", type=_device_name, default="auto", help="cpu, cuda, cuda:N or auto")
    _add_offload_flags(serve)

    plot = commands.add_parser(
        "plot", help="write PNG plots of a run's metrics", description="Write PNG plots of a run."
    )
    plot.add_argument("run_dir", type=Path, help="a run directory written by moekit train")
    plot.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/plots)")

    convert = commands.add_parser(
        "convert",
        help="convert a Hugging Face model directory into a moekit run",
        description="Convert a local Hugging Face directory (config.json, safetensors, tokenizer.json) of "
        "Mixtral, Qwen2-MoE, OLMoE, Llama, Mistral or Qwen2 into a moekit run directory.",
    )
    convert.add_argument("hf_dir", type=Path, help="a Hugging Face model directory")
    convert.add_argument("--out", type=Path, required=True, help="the run directory to write")

    export = commands.add_parser(
        "export", help="write a run's model in another format", description="Write a run's model in another format."
    )
    export.add_argument("run_dir", type=Path, help="a run directory")
    export.add_argument(
        "--format",
        choices=sorted(EXPORTERS),
        default="safetensors",
        help="safetensors: a run directory whose checkpoint is one model.safetensors, consolidated from any "
        "layout's shards one block at a time (default); hf: a Hugging Face directory (Mixtral or Qwen2-MoE)",
    )
    export.add_argument("--out", type=Path, required=True, help="the directory to write")

    plan = commands.add_parser(
        "plan",
        help="rank parallel layouts of a model on a cluster by predicted step time",
        description="The auto-parallel planner: enumerate dp x ep x tp x pp x micro-batches x all-to-all form x "
        "overlap, drop layouts that do not fit in memory, print the fastest by predicted step time. With --loads, "
        "re-score them with a run's measured expert loads, with and without load-aware placement.",
    )
    plan.add_argument("--model", required=True, help="model preset (mixtral-8x7b, deepseek-moe-16b) or a .toml file")
    plan.add_argument("--cluster", required=True, help="cluster preset (h100x8, h100-ib-32, ...) or a .toml file")
    plan.add_argument("--top", type=int, default=10, help="rows to print (default: %(default)s)")
    plan.add_argument("--loads", type=Path, metavar="RUN_DIR", help="re-score with this run's measured expert loads")
    plan.add_argument("--steps-left", type=int, default=1000, help="steps a re-placement can pay back over")

    up = commands.add_parser(
        "upcycle",
        help="turn a dense model into an MoE whose experts start as its MLPs",
        description="Sparse upcycling: every MLP of a dense model (a moekit run or a Hugging Face Llama, Mistral "
        "or Qwen2 directory) becomes an MoE layer computing the same function at step 0. "
        "Continue with: moekit train --init RUN_DIR",
    )
    up.add_argument("dense", type=Path, help="a dense moekit run directory or Hugging Face directory")
    up.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default: %(default)s)")
    up.add_argument("--top-k", type=int, default=2, help="experts each token picks (default: %(default)s)")
    up.add_argument("--split", type=int, default=1, help="cut each MLP into this many finer experts (default: 1)")
    up.add_argument("--noise", type=float, default=0.0, help="relative noise added to each expert (default: 0)")
    up.add_argument("--seed", type=int, default=0, help="seed of the noise (default: %(default)s)")
    up.add_argument("--out", type=Path, required=True, help="the run directory to write")
    return parser


def _add_offload_flags(parser: argparse.ArgumentParser) -> None:
    off = parser.add_argument_group("offloaded experts (models larger than memory)")
    off.add_argument(
        "--memory-budget", help="bytes for resident weights (e.g. 512MB): non-expert weights + an expert cache"
    )
    off.add_argument("--policy", default="lru", help="expert cache eviction: lru, lfu, fifo (default: %(default)s)")
    off.add_argument(
        "--prefetch", default="router", help="router (predict the next layer), all (ring), off (default: %(default)s)"
    )
    off.add_argument("--expert-format", default="fp", help="fp, int8 or int4 expert weights (default: %(default)s)")


def _load_for_inference(args: argparse.Namespace):
    """The run, its experts offloaded when --memory-budget is given."""
    from moekit.infer.offload import OffloadOptions, parse_bytes
    from moekit.run.load import load_run

    offload = None
    if args.memory_budget is not None:
        offload = OffloadOptions(parse_bytes(args.memory_budget), args.policy, args.prefetch, args.expert_format)
    return load_run(args.run_dir, _device(args.device), offload)


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={name}: no CUDA device is available here (use cpu or auto)")
    return name


def cmd_train(args: argparse.Namespace) -> int:
    from moekit import runconfig
    from moekit.infer.generate import generate_text
    from moekit.run.load import load_run
    from moekit.train.loop import train
    from moekit.train.plots import plot_run

    overrides = {k: v for k, v in vars(args).items() if "." in k}
    if args.data is not None:
        overrides["data.path"] = args.data
    if args.resume or args.init:
        if args.run_dir is None:
            raise ValueError("--resume and --init need --run-dir: the run to continue or to start")
        for batch_field in ("train.grad_accum", "train.batch_size") if args.resume else ():
            if batch_field in overrides:
                raise ValueError(
                    f"--{batch_field}: a resumed run keeps its checkpoint's global batch (each rank's grad_accum "
                    "follows the layout); start a new run from it with --init to change the batch"
                )
        source = args.init or args.run_dir
        cfg = runconfig.build(runconfig.apply_overrides(runconfig.read_tree(source / "config.json"), overrides))
    else:
        cfg = runconfig.resolve(args.preset, overrides)
    run_dir = args.run_dir or Path("runs") / f"{Path(args.preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.nproc is not None and "WORLD_SIZE" not in os.environ:
        return _launch(args, cfg, run_dir)
    result = train(
        cfg,
        run_dir,
        resume=args.resume,
        device=_device(args.device),
        progress=not args.quiet,
        init=args.init,
        fallback=args.fallback,
    )
    _leave_process_group()
    if result.interrupted:
        return EXIT_INTERRUPTED
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for the job
    plots = plot_run(run_dir)
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "-"
    lines = [f"run directory: {run_dir}", f"  final val loss {val} after {result.steps} steps"]
    lines.append(f"  checkpoint:  {result.checkpoint}")
    lines.append(f"  plots:       {', '.join(str(p) for p in plots)}")
    lines.append(f"  tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}")
    if cfg.train.sample_tokens:
        run = load_run(run_dir, _device(args.device))
        sample = generate_text(run, "\n", cfg.train.sample_tokens, seed=cfg.train.seed)
        (run_dir / "sample.txt").write_text(sample)
        lines.append(f"  sample:      {run_dir / 'sample.txt'}")
        lines.append("-" * 60 + "\n" + sample.strip("\n") + "\n" + "-" * 60)
    lines.append(f"generate more: moekit generate {run_dir} --prompt '...'")
    print("\n".join(lines))
    return 0


def _leave_process_group() -> None:
    """Tear down the ranks' process group before exit: left to interpreter shutdown, gloo's threads
    can abort a rank (``terminate called without an active exception``) after a finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _launch(args: argparse.Namespace, cfg, run_dir: Path) -> int:
    """Start the ranks through torch's elastic launcher, after checking the layout here."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from moekit.parallel.mesh import resolve_layout

    multi_node = args.nnodes != "1"
    if multi_node and not args.rdzv_endpoint:
        raise ValueError(f"--nnodes={args.nnodes}: needs --rdzv-endpoint HOST:PORT")
    if not multi_node:
        resolve_layout(cfg, args.nproc, args.nproc)
    rendezvous = (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
        if multi_node
        else ["--standalone"]
    )
    argv = list(args.argv)
    argv.remove("train")
    forwarded = _without_launch_flags(argv)
    if args.run_dir is None:
        forwarded += ["--run-dir", str(run_dir)]
    launcher = ["--nproc-per-node", str(args.nproc), "--nnodes", args.nnodes, "--max-restarts", str(args.max_restarts)]
    # Every rank's output goes to RUN_DIR/logs; the console shows rank 0 only.
    launcher += ["--log-dir", str(run_dir / "logs"), "--tee", "3", "--local-ranks-filter", "0"]
    try:
        torchrun([*launcher, *rendezvous, "-m", "moekit", "train", *forwarded])
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        logs = run_dir / "logs"
        print(
            f"moekit train: error: rank {rank} failed with exit code {failure.exitcode}; its error is printed "
            f"above and every rank's output is under {logs}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return 0


_LAUNCH_FLAGS = {"--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--max-restarts"}


def _without_launch_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    from moekit.infer.generate import check_sampling, generate_texts
    from moekit.infer.offload import format_bytes

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    prompts = [args.prompt]
    if args.prompts_file is not None:
        try:
            prompts = [line for line in args.prompts_file.read_text("utf-8").splitlines() if line]
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--prompts-file={args.prompts_file}: unreadable ({err})") from None
        if not prompts:
            raise ValueError(f"--prompts-file={args.prompts_file}: has no non-empty line")
    run = _load_for_inference(args)
    start = time.perf_counter()
    try:
        texts = generate_texts(
            run,
            prompts,
            args.max_new_tokens,
            args.temperature,
            args.top_k or None,
            args.top_p,
            args.seed,
            args.batch_size,
        )
    finally:
        if run.offloader is not None:
            run.offloader.close()
    seconds = time.perf_counter() - start
    print("\n".join(texts))
    report = f"{len(prompts) * args.max_new_tokens / seconds:.1f} tokens/s"
    if run.offloader is not None:
        stats = run.offloader.stats
        report += f", expert cache hit rate {stats.hit_rate:.1%}, read {format_bytes(stats.bytes_read)}"
        if args.prefetch == "router":
            report += (
                f", prefetch recall {stats.prediction_recall:.1%} precision {stats.prediction_precision:.1%}"
                f" ({stats.prefetch_reads} reads)"
            )
    print(report, file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from moekit.infer.serve import make_server

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port}: must be in 0..65535")
    run = _load_for_inference(args)
    try:
        server = make_server(run, args.host, args.port)
    except OSError as err:
        raise ValueError(f"--port={args.port}: cannot listen on {args.host} ({err.strerror})") from None
    host, port = server.server_address[:2]
    print(f"serving {args.run_dir} on http://{host}:{port} (POST /generate, GET /health); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        if run.offloader is not None:
            run.offloader.close()
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from moekit.train.plots import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from moekit.parallel import planner

    spec, cluster = planner.load_model(args.model), planner.load_cluster(args.cluster)
    if args.top <= 0:
        raise ValueError(f"--top={args.top}: must be > 0")
    rows = planner.plan(spec, cluster, args.top)
    print(f"{spec.name} on {cluster.name} ({cluster.world} devices): {len(rows)} fastest layouts that fit")
    if not rows:
        print("no layout fits in memory: use more devices or a smaller global batch")
        return 0
    print(planner.format_table(rows))
    if args.loads is not None:
        loads = _measured_loads(args.loads, spec.moe.num_experts)
        again = planner.rescore(spec, cluster, rows, loads, args.steps_left)
        print(f"\nre-scored with the expert loads of {args.loads} (plain EP -> load-aware placement):")
        for i, r in enumerate(again, 1):
            c = r.estimate.candidate
            print(
                f"{i:>3} dp={c.dp} ep={c.ep} tp={c.tp} pp={c.pp} mb={c.micro} {c.all_to_all}"
                f"{' overlap' if c.overlap else ''}: {r.estimate.step_s:.4f} s -> {r.placed.step_s:.4f} s; "
                f"re-placing costs {r.switch_s:.4f} s: {'switch' if r.switch else 'keep'}"
            )
    return 0


def _measured_loads(run_dir: Path, num_experts: int) -> list[list[float]]:
    """Per-layer expert shares averaged over a run's last 50 logged steps."""
    from moekit.train.metrics import read_metrics

    records = [r["expert_load"] for r in read_metrics(run_dir) if r.get("expert_load")][-50:]
    if not records:
        raise ValueError(f"--loads {run_dir}: its metrics.jsonl has no expert_load records")
    if any(len(layer) != num_experts for layer in records[-1]):
        raise ValueError(f"--loads {run_dir}: its layers do not have the model's {num_experts} experts")
    return [[sum(r[i][e] for r in records) / len(records) for e in range(num_experts)] for i in range(len(records[-1]))]


def _load_model(path: Path):
    """(model, tokenizer, run config) of a moekit run directory or of a Hugging Face directory."""
    from moekit import runconfig
    from moekit.config import DataConfig
    from moekit.convert import from_hf
    from moekit.run.load import load_run
    from moekit.tokenizer import load_tokenizer

    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json (neither a moekit run nor a Hugging Face directory)")
    if (path / "checkpoints").is_dir():
        run = load_run(path)
        return run.model, run.tokenizer, run.config
    model = from_hf(path)
    # The run trains on text encoded with this tokenizer (train --init), whatever data.tokenizer says.
    return model, load_tokenizer(path), runconfig.for_model(model.cfg, model.moe_cfg, DataConfig(tokenizer="bpe"))


def cmd_convert(args: argparse.Namespace) -> int:
    from moekit.run.checkpoint import save_weights_run

    if (args.hf_dir / "checkpoints").is_dir():
        raise ValueError(f"{args.hf_dir}: is a moekit run already (convert reads Hugging Face directories)")
    model, tokenizer, cfg = _load_model(args.hf_dir)
    save_weights_run(args.out, cfg.to_json(), model, tokenizer, f"converted from {args.hf_dir}")
    kind = f"{len(model.moe_layers())} MoE blocks" if model.moe_layers() else "dense"
    print(f"run directory: {args.out} ({model.num_params() / 1e6:.2f}M parameters, {kind})")
    print(f"generate: moekit generate {args.out} --prompt '...';  train: moekit train --init {args.out} --run-dir ...")
    return 0


def export_hf(args: argparse.Namespace) -> None:
    from moekit.convert import to_hf
    from moekit.run.load import load_run

    if (args.out / "config.json").exists():
        raise ValueError(f"--out {args.out}: already holds a config.json; choose an empty directory")
    run = load_run(args.run_dir)
    family = to_hf(run.model, args.out)
    print(f"{args.out}: {family.architecture} (load with transformers.AutoModelForCausalLM.from_pretrained)")
    if run.tokenizer.name == "bpe":  # a Hugging Face tokenizer already; byte and char ones have no such form
        run.tokenizer.save(args.out)
    else:
        print(f"tokenizer: moekit's {run.tokenizer.name} tokenizer has no Hugging Face form; not written")


def export_safetensors(args: argparse.Namespace) -> None:
    from moekit.run.export import export_run

    path = export_run(args.run_dir, args.out)
    print(f"{args.out}: {path / 'model.safetensors'} (moekit generate {args.out}; train --init {args.out})")


EXPORTERS = {"hf": export_hf, "safetensors": export_safetensors}


def cmd_export(args: argparse.Namespace) -> int:
    EXPORTERS[args.format](args)
    return 0


def cmd_upcycle(args: argparse.Namespace) -> int:
    from moekit.convert.upcycle import upcycle
    from moekit.run.checkpoint import save_weights_run
    from moekit.runconfig import for_model

    dense, tokenizer, cfg = _load_model(args.dense)
    model = upcycle(dense, args.experts, args.top_k, split=args.split, noise=args.noise, seed=args.seed)
    # Keep the dense run's data and training settings: continuing on the same text is the usual next step.
    up_cfg = dataclasses.replace(for_model(model.cfg, model.moe_cfg, cfg.data), train=cfg.train)
    save_weights_run(args.out, up_cfg.to_json(), model, tokenizer, f"upcycled from {args.dense}")
    total, active = model.num_params() / 1e6, model.num_active_params() / 1e6
    print(f"run directory: {args.out} ({total:.2f}M parameters, {active:.2f}M active per token)")
    print(f"continue: moekit train --init {args.out} --run-dir ...")
    return 0


COMMANDS = {
    "train": cmd_train,
    "generate": cmd_generate,
    "serve": cmd_serve,
    "plot": cmd_plot,
    "plan": cmd_plan,
    "convert": cmd_convert,
    "export": cmd_export,
    "upcycle": cmd_upcycle,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    from moekit.infer.expert_store import ExpertStoreError
    from moekit.parallel.runtime import RankFailure, exit_after_rank_failure
    from moekit.run.layout import CheckpointError
    from moekit.train.loop import TrainingError

    rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
    try:
        return COMMANDS[args.command](args)
    except RankFailure as err:
        print(f"moekit {args.command}{rank}: error: {err}", file=sys.stderr)
        exit_after_rank_failure(EXIT_FAILURE)
    except (ValueError, CheckpointError, ExpertStoreError, TrainingError, FileNotFoundError) as err:
        print(f"moekit {args.command}{rank}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"moekit {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
