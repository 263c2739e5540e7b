"""What several commands share: exit codes, the one-line-error parser, flag types and flag groups."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

from moekit.errors import NO_VALUE, Namer, python_words

EXIT_FAILURE = 1  # the run failed (a dead or hung rank)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported on one line that says where to look."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def flag_words(parser: argparse.ArgumentParser) -> Namer:
    """How ``parser``'s command names a library option (``errors.OptionError``): by the flag that set it,
    found by its argparse dest, or by the dest an alias names (``parser.get_default("option_aliases")``:
    ``load_run(offload=...)`` is built from ``--memory-budget``): ``--flag=value``, or ``--flag`` alone
    for an option named without a value or a switch mentioned as set. Dotted config fields
    (``train.lr``), whose value may come from a file, and names no flag sets keep their Python words."""
    flags = {
        action.dest: action
        for action in parser._actions
        if "." not in action.dest and any(s.startswith("--") for s in action.option_strings)
    }
    aliases = parser.get_default("option_aliases") or {}

    def name(option: str, value: object) -> str:
        action = flags.get(aliases.get(option, option))
        if action is None:
            return python_words(option, value)
        flag = next(s for s in action.option_strings if s.startswith("--"))
        switch = action.nargs == 0 and value is True
        return flag if value is NO_VALUE or switch else f"{flag}={value}"

    return name


def device_name(text: str) -> str:
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N or auto)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype values and torch's names


def check_out_dir(path: Path | None, flag: str = "--out") -> None:
    """A directory to write into may not exist yet, but may not be a file."""
    if path is not None and path.exists() and not path.is_dir():
        raise ValueError(f"{flag}={path}: is a file, not a directory")


def dtype_name(text: str) -> str:
    if text in DTYPES:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a dtype (fp32, bf16 or fp16)")


def resolve_dtype(name: str | None):
    """A ``--dtype`` value as a torch dtype; None (the flag left out) stays None: the checkpoint's own."""
    import torch

    return None if name is None else getattr(torch, DTYPES[name])


def resolve_device(name: str) -> str:
    """``auto`` -> cuda when available, else cpu; a CUDA device that is not here is an error."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={name}: no CUDA device is available here (use cpu or auto)")
    return name


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("NoneType", "none").replace("typing.", "").upper()


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--section.field`` flag per config field, with its one-line reason (the field's metadata) as help."""
    from moekit.runconfig import SECTIONS

    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}] {cls.__doc__.splitlines()[0]}")
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
                help=f.metadata["help"] + default,
            )


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """A trained run to load, where, and its experts offloaded (models larger than memory)."""
    parser.add_argument(
        "run_dir",
        type=Path,
        help="a run directory written by moekit train, or a Hugging Face model directory, read in place: "
        "converted in memory, or with --memory-budget its experts read by byte range from its safetensors "
        "files; no copy of it is written. gpt-oss (experts interleaved in one tensor) and --expert-format "
        "int8/int4 need moekit convert first, which writes a full copy (as large as the checkpoint in its dtype)",
    )
    parser.add_argument("--device", type=device_name, default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="CPU threads for the model's ops (default: torch's, one per core). On a machine busy with other "
        "work, fewer threads than cores keep each step from waiting on a thread the OS has descheduled",
    )
    parser.add_argument(
        "--dtype", type=dtype_name, help="fp32, bf16 or fp16 weights and compute (default: the checkpoint's dtype)"
    )
    off = parser.add_argument_group("offloaded experts (models larger than memory)")
    off.add_argument(
        "--memory-budget", help="bytes for resident weights (e.g. 512MB): non-expert weights + an expert cache"
    )
    parser.set_defaults(option_aliases={"offload": "memory_budget"})  # load_run(offload=...) is built from it
    off.add_argument("--policy", default="lru", help="expert cache eviction: lru, lfu, fifo (default: %(default)s)")
    off.add_argument(
        "--prefetch",
        default="auto",
        help="router (predict the next layer), all (ring), off; auto: router on a CPU, off on a GPU (default: auto)",
    )
    off.add_argument(
        "--expert-format",
        default="fp",
        help="fp, int8 or int4 expert weights: with --memory-budget a quantized copy of the experts is written "
        "once beside the checkpoint and read from; without, the experts are quantized in memory at load "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dense-format",
        default="fp",
        help="fp, int8 or int4 for every other linear weight (attention's projections but MLA's, dense and shared "
        "FFNs, the output head, which int4 keeps in int8), quantized in memory at load, on a CPU; not with "
        "--memory-budget (default: %(default)s)",
    )


def load_for_inference(args: argparse.Namespace, few_rows: bool = False):
    """The run or Hugging Face directory of ``add_run_flags``, its experts offloaded when --memory-budget
    is given; a Hugging Face directory read in place says so (and that nothing is written) on stderr.
    ``few_rows``: decoding one row at a time (``model_dir.load_for_inference``)."""
    import sys

    import torch

    from moekit.experts.matmul import native_16bit
    from moekit.infer.offload import OffloadOptions
    from moekit.kernels import rows_build_failure
    from moekit.model_dir import load_for_inference as load
    from moekit.units import parse_bytes

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    offload = None
    if args.memory_budget is not None:
        budget = parse_bytes(args.memory_budget, "--memory-budget")
        offload = OffloadOptions(budget, args.policy, args.prefetch, args.expert_format)
    resident_format = args.expert_format if offload is None else "fp"
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    loaded, in_place = load(
        args.run_dir,
        device,
        offload,
        dtype,
        expert_format=resident_format,
        dense_format=args.dense_format,
        few_rows=few_rows,
    )
    if in_place is not None:
        print(in_place.describe(args.run_dir), file=sys.stderr)
    weight = loaded.model.embed.weight
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and (few_rows or not native_16bit(weight.dtype)):
        failure = rows_build_failure()  # where the row layout was asked for and moekit's kernels were not built
        if failure:
            print(f"note: decoding with torch's kernels, not moekit's row kernel: {failure}", file=sys.stderr)
    return loaded
