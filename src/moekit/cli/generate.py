"""``moekit generate``: text from a trained run or a Hugging Face directory, its experts resident or offloaded."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moekit.cli.common import add_run_flags, load_for_inference


def add_parser(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate text from a trained run or a Hugging Face directory",
        description="Generate text from a trained run or a Hugging Face directory (read in place, no copy written).",
    )
    gen.set_defaults(run=run)
    gen.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    gen.add_argument(
        "--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all (default: %(default)s)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    gen.add_argument("--prompts-file", type=Path, help="one prompt per line, generated in batches (replaces --prompt)")
    gen.add_argument("--batch-size", type=int, default=1, help="prompts generated together (default: %(default)s)")
    add_run_flags(gen)


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is None:
        return [args.prompt]
    try:
        prompts = [line for line in args.prompts_file.read_text("utf-8").splitlines() if line]
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompts-file={args.prompts_file}: unreadable ({err})") from None
    if not prompts:
        raise ValueError(f"--prompts-file={args.prompts_file}: has no non-empty line")
    return prompts


def run(args: argparse.Namespace) -> int:
    from moekit.hostmem import peak_rss
    from moekit.infer.generate import check_sampling, generate_texts
    from moekit.kernels import FEW_ROWS
    from moekit.units import format_bytes

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    prompts = _prompts(args)
    runtime = peak_rss()  # the interpreter and the libraries, before the model
    few_rows = args.batch_size <= FEW_ROWS
    loaded = load_for_inference(args, few_rows=few_rows)
    start = time.perf_counter()
    try:
        texts = generate_texts(
            loaded,
            prompts,
            args.max_new_tokens,
            args.temperature,
            args.top_k or None,
            args.top_p,
            args.seed,
            args.batch_size,
        )
    finally:
        if loaded.offloader is not None:
            loaded.offloader.close()
    seconds = time.perf_counter() - start
    print("\n".join(texts))
    report = f"{len(prompts) * args.max_new_tokens / seconds:.3g} tokens/s"  # 3 digits: offloaded runs can be < 0.1
    if loaded.offloader is not None:
        stats = loaded.offloader.stats
        report += f", expert cache hit rate {stats.hit_rate:.1%}, read {format_bytes(stats.bytes_read)}"
        if loaded.offloader.prefetch == "router":
            report += (
                f", prefetch recall {stats.prediction_recall:.1%} precision {stats.prediction_precision:.1%}"
                f" ({stats.prefetch_reads} reads)"
            )
    print(report, file=sys.stderr)
    if loaded.offloader is not None:
        print(_memory_report(loaded, args.memory_budget, runtime), file=sys.stderr)
    return 0


def _memory_report(loaded, budget: str, runtime: int) -> str:
    """What ``--memory-budget`` holds, and what the process held at its peak beside it."""
    from moekit.hostmem import peak_rss
    from moekit.infer.offload import model_bytes
    from moekit.units import format_bytes, parse_bytes

    cache, reordered = loaded.offloader.cache, loaded.offloader.reordered_bytes
    resident = model_bytes(loaded.model)
    slots = f"{cache.num_slots} expert slot{'s' * (cache.num_slots != 1)} of {format_bytes(cache.slot_bytes)}"
    copies = f" + their experts reordered for the kernel, {format_bytes(reordered)}" if reordered else ""
    return (
        f"memory: --memory-budget {format_bytes(parse_bytes(budget, '--memory-budget'))} holds the resident "
        f"weights, {format_bytes(resident + cache.capacity_bytes + reordered)}: non-expert "
        f"{format_bytes(resident)} + {slots}{copies}; "
        f"peak RSS {format_bytes(peak_rss())}, which also holds activations, the KV cache and the runtime "
        f"({format_bytes(runtime)} before the model loaded)"
    )
