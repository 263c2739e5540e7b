"""``moekit serve`` from two source trees (two commits), taking turns on one machine: what a change did
to served throughput, apart from the run-to-run drift of the machine that moves a benchmark's
separate runs by 5-20%.

    git worktree add /tmp/before COMMIT
    python benchmarks/serve_commits.py MODEL_DIR /tmp/before/src src [--dtype bf16] [--rounds 4]
                                       [--clients 1 16 64] [--new-tokens 64] [--threads 2] [--json]

Each round starts one server per tree (the order alternating), warms it with a short batch of each
size, then sends ``--clients`` greedy streaming clients (prompts from the corpus, the end token
ignored) and records output tokens/s; the table gives each tree's median (min-max) and the ratio.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _serve_clients
from _provenance import source_commit
from _serve_clients import Server, clients
from _spread import show, spread
from serve import DEFAULT_TEXT, text_prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a run or Hugging Face directory")
    parser.add_argument("before", type=Path, help="the first tree's src directory")
    parser.add_argument("after", type=Path, help="the second tree's src directory")
    parser.add_argument("--dtype", default="bf16", help="the servers' --dtype (default: bf16)")
    parser.add_argument("--rounds", type=int, default=4, help="servers per tree (default: 4)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64], help="(default: 1 16 64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request (default: 64)")
    parser.add_argument("--threads", type=int, default=2, help="each server's torch threads (default: 2)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="corpus of prompts")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    for tree in (args.before, args.after):
        if not (tree / "moekit" / "__init__.py").is_file():
            parser.error(f"{tree}: no moekit package in it (give a tree's src directory)")
    prompts = text_prompts(args.text, max(args.clients), seed=0)
    trees = {"before": args.before, "after": args.after}
    tok_s: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.clients} for name in trees}
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            _serve_clients.SRC = trees[name]
            server = Server(args.model, "--threads", str(args.threads), "--dtype", args.dtype)
            server.fields = {"ignore_eos": True}
            try:
                for n in args.clients:
                    clients(server, prompts[:n], 8, [0.0] * n)
                for n in args.clients:
                    records, wall = clients(server, prompts[:n], args.new_tokens, [0.0] * n)
                    tok_s[name][n].append(sum(rec[2] for rec in records) / wall)
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
        print(json.dumps({"commits": commits, "dtype": args.dtype, "rounds": args.rounds, "clients": figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
