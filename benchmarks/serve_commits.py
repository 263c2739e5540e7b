"""``moekit serve`` from two source trees (two commits), taking turns on one machine: what a change did
to served throughput, apart from the run-to-run drift of the machine that moves a benchmark's
separate runs by 5-22%.

    git worktree add /tmp/before COMMIT
    python benchmarks/serve_commits.py MODEL_DIR /tmp/before/src src [--dtype bf16] [--rounds 4]
                                       [--clients 1 16 64] [--new-tokens 64] [--threads 2]
                                       [--prompt-chars 32 96] [--kv-budget 256MB] [--json]

Each round starts one server per tree (the order alternating), warms it with a short batch of each
size, then sends ``--clients`` greedy streaming clients (prompts from the corpus, the end token
ignored) and records output tokens/s; the table gives each tree's median (min-max) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import _serve_clients
from _provenance import source_commit
from _serve_clients import Server, add_prompt_chars, check_prompt_chars, served_rows
from _spread import show, spread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a run or Hugging Face directory")
    parser.add_argument("before", type=Path, help="the first tree's src directory")
    parser.add_argument("after", type=Path, help="the second tree's src directory")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="(default: bf16)")
    parser.add_argument("--rounds", type=int, default=4, help="servers per tree (default: 4)")
    parser.add_argument(
        "--clients", type=int, nargs="+", default=[1, 16, 64], help="concurrent streaming clients (default: 1 16 64)"
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request (default: 64)")
    parser.add_argument("--threads", type=int, default=2, help="each server's torch threads (default: 2)")
    parser.add_argument("--text", type=Path, help="corpus of prompts (default: serve.py's, tinyshakespeare)")
    add_prompt_chars(parser)
    parser.add_argument("--kv-budget", default="256MB", help="each server's --kv-budget (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    check_prompt_chars(parser, args.prompt_chars)
    for name in ("rounds", "new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.clients) < 1 or len(set(args.clients)) != len(args.clients):
        parser.error("--clients: distinct counts, each >= 1")
    if not args.model.is_dir():
        parser.error(f"{args.model}: no such model directory")
    if args.text is not None and not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for tree in trees.values():
        if not _imports_moekit_from(tree):
            parser.error(f"{tree}: moekit does not import from it (give a tree's src directory)")
    from serve import DEFAULT_TEXT, text_prompts  # torch with it: after the arguments are checked

    prompts = text_prompts(args.text or DEFAULT_TEXT, max(args.clients), 0, *args.prompt_chars)
    tok_s: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.clients} for name in trees}
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            _serve_clients.SRC = trees[name]
            flags = ("--threads", str(args.threads), "--dtype", args.dtype, "--kv-budget", args.kv_budget)
            server = Server(args.model, *flags)
            server.fields = {"ignore_eos": True}
            try:
                for n, row in served_rows(server, prompts, args.clients, args.new_tokens).items():
                    tok_s[name][n].append(row["tok_s"])
            finally:
                server.close()
            print(f"round {r + 1}/{args.rounds} {name}: done", flush=True)
    print(f"{args.model}, {args.dtype}, {args.threads} threads, output tokens/s over {args.rounds} rounds:")
    figures = {}
    for n in args.clients:
        before, after = spread(tok_s["before"][n]), spread(tok_s["after"][n])
        ratio = after["median"] / before["median"]
        shown = f"before {show(tok_s['before'][n], '.1f')}  after {show(tok_s['after'][n], '.1f')}"
        print(f"  {n:3d} clients  {shown}  {ratio:.3f}x")
        figures[n] = {"before": before, "after": after, "ratio": round(ratio, 3)}
    if args.json:
        commits = {name: source_commit(tree) for name, tree in trees.items()}
        src_changed = {name: _changed(tree) for name, tree in trees.items()}
        run = {"model": str(args.model), "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds}
        run |= {"new_tokens": args.new_tokens, "prompt_chars": args.prompt_chars, "kv_budget": args.kv_budget}
        run |= {"load_average": round(os.getloadavg()[0], 2)}
        print(json.dumps({"commits": commits, "src_changed": src_changed, **run, "clients": figures}))
    return 0


def _imports_moekit_from(tree: Path) -> bool:
    """Whether a Python given ``tree`` as its path imports moekit from there (not an installed copy)."""
    probe = [sys.executable, "-c", "import moekit; print(moekit.__file__)"]
    done = subprocess.run(probe, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return done.returncode == 0 and Path(done.stdout.strip()).resolve().is_relative_to(tree)


def _changed(tree: Path) -> bool | None:
    """Whether ``tree``'s files differ from its checkout's commit (None outside git)."""
    done = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=tree, capture_output=True)
    return None if done.returncode not in (0, 1) else done.returncode == 1


if __name__ == "__main__":
    raise SystemExit(main())
