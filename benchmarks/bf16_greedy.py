"""bf16 inference on CPU against fp32: the same greedy tokens from the shakespeare presets' trained runs?

    python benchmarks/bf16_greedy.py [--json] [--steps 1000] [--tokens 100] [--prompts 3] [--runs RUN ...]

Trains each preset (shakespeare-moe, shakespeare-dense) for --steps on tinyshakespeare through the real
CLI (or takes --runs), loads the run twice, in fp32 and in bf16 (``load_run(dtype=...)``, what
``moekit generate --dtype bf16`` does), and decodes --tokens greedy tokens from --prompts prompts taken
from the corpus with each. Per prompt: the tokens equal before the first divergence, and at it the
fp32 model's top-2 logit margin beside the bf16 model's error on those two logits: a divergence is a
near-tie when the margin is smaller than that error (bf16 keeps 8 significant bits). Also the largest
logit error over the steps before it. Prints a table; with ``--json`` one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from moekit.infer.generate import generate
from moekit.run.load import load_run

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"
PRESETS = ("shakespeare-moe", "shakespeare-dense")


def train(preset: str, steps: int, data: Path, run_dir: Path) -> Path:
    argv = [sys.executable, "-m", "moekit", "train", "--preset", preset, "--data", str(data), "--quiet"]
    argv += ["--run-dir", str(run_dir), "--train.steps", str(steps), "--train.ckpt_every", str(steps)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def greedy_with_logits(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """``generate``'s greedy tokens and the logits [V] (as fp32) each was picked from."""
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: logits.append(out.logits[0, -1].float()))
    try:
        out = generate(model, prompt, n, temperature=0)
    finally:
        hook.remove()
    return out[0, prompt.shape[1] :].tolist(), logits


def compare(run: Path, prompts: list[str], tokens: int) -> list[dict]:
    full, half = load_run(run, dtype=torch.float32), load_run(run, dtype=torch.bfloat16)
    assert half.model.embed.weight.dtype == torch.bfloat16
    rows = []
    for text in prompts:
        prompt = torch.tensor([full.tokenizer.encode(text)])
        ref, ref_logits = greedy_with_logits(full.model, prompt, tokens)
        got, got_logits = greedy_with_logits(half.model, prompt, tokens)
        same = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), tokens)
        errors = [(r - g).abs().max().item() for r, g in zip(ref_logits[:same], got_logits[:same], strict=True)]
        row = {"prompt": text, "equal": same, "tokens": tokens, "max_logit_error": max(errors, default=0.0)}
        if same < tokens:
            top2 = ref_logits[same].topk(2)
            pair = top2.indices
            row |= {
                "fp32_margin": (top2.values[0] - top2.values[1]).item(),
                "bf16_error": (ref_logits[same][pair] - got_logits[same][pair]).abs().max().item(),
                "bf16_margin": (got_logits[same][pair[0]] - got_logits[same][pair[1]]).item(),
            }
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--steps", type=int, default=1000, help="training steps per preset")
    parser.add_argument("--tokens", type=int, default=100, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per run, from the corpus")
    parser.add_argument("--runs", type=Path, nargs="+", help="trained runs to compare (instead of training)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [line for line in args.data.read_text().splitlines() if len(line) > 30]
    prompts = [lines[i * len(lines) // args.prompts] for i in range(args.prompts)]
    results = {}
    with tempfile.TemporaryDirectory() as root:
        runs = args.runs or [train(p, args.steps, args.data, Path(root) / p) for p in PRESETS]
        for run in runs:
            results[run.name] = compare(run, prompts, args.tokens)
    print(f"greedy tokens, bf16 against fp32 (CPU); {args.tokens} per prompt; margins and errors in logits")
    head = f"{'run':<18} {'prompt':<24} {'equal':>6} {'max err before':>14}"
    print(f"{head} {'fp32 margin':>11} {'bf16 err':>8}  verdict")
    for name, rows in results.items():
        for r in rows:
            if r["equal"] == r["tokens"]:
                tail, verdict = f"{'':>11} {'':>8}", "identical"
            else:
                tie = r["fp32_margin"] <= r["bf16_error"]
                tail = f"{r['fp32_margin']:>11.4f} {r['bf16_error']:>8.4f}"
                verdict = "near-tie (margin <= bf16 error)" if tie else "NOT explained by the margin"
            head = f"{name:<18} {r['prompt'][:24]!s:<24} {r['equal']:>6} {r['max_logit_error']:>14.4f}"
            print(f"{head} {tail}  {verdict}")
    if args.json:
        trained = None if args.runs else args.steps  # given runs were trained elsewhere
        json.dump({"steps": trained, "tokens": args.tokens, "runs": results}, sys.stdout)
        print()


if __name__ == "__main__":
    main()
