"""A batch-1 decode's weight layouts side by side in one process: what ``moekit generate`` picks and why.

Three ways to hold and multiply a bf16 model's weights for one sequence: prepacked for oneDNN (a
server's layout, and ``moekit generate``'s where the row kernel cannot be built; on a CPU without
native bf16 kernels the weights stay as loaded, multiplied by torch's bf16 kernels), kept plain and
multiplied by moekit's row kernel (``moekit.kernels``, what ``moekit generate`` loads at
``--batch-size 1``; the build this CPU runs is printed), and kept plain with ATen's GEMV doing the one
row (the plain layout's own share of the difference, the kernel's being the rest). ``--fp32`` adds the
model in fp32, prepacked: what a bf16 checkpoint must beat to be worth its dtype. Each layout prefills
the same prompt, then decodes the same token stream (random ids fed in, not each layout's own picks, so
each does the same work), a block of ``--steps`` untimed first, then blocks of ``--steps`` taking turns
(``_spread.alternate_blocks``); then the prompt is prefilled again, taking turns. Prints ms per decode
step and prompt tokens/s, median (min .. max) over the blocks.

    python benchmarks/decode_layouts.py MODEL_DIR [--threads 2] [--prompt 512] [--steps 50] [--rounds 6]
        [--fp32] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _provenance import source_commit
from _spread import alternate_blocks, show, spread

import moekit.infer.resident_experts as resident
from moekit.experts.matmul import plain_linear
from moekit.infer.generate import decode_step, prefill
from moekit.kernels import rows_available, rows_isa, rows_unavailable_reason
from moekit.model_dir import load_for_inference


def aten_gemv(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """One row by ATen's GEMV (a decode step runs with oneDNN off), more as the row layout does."""
    return torch.mm(x_MK, w_NK.t()) if x_MK.shape[0] == 1 else plain_linear(x_MK, w_NK)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a run or Hugging Face directory of a bf16 model")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default: 512)")
    parser.add_argument("--steps", type=int, default=50, help="decode steps per block (default: 50)")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each layout (default: 6)")
    parser.add_argument("--fp32", action="store_true", help="also decode the model in fp32, prepacked")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    if not rows_available():
        parser.error(f"the row kernel does not run here: {rows_unavailable_reason()}")
    torch.set_num_threads(args.threads)
    packed = load_for_inference(args.model, dtype=torch.bfloat16)[0]
    rows = load_for_inference(args.model, dtype=torch.bfloat16, few_rows=True)[0].model
    if args.prompt + args.steps * (args.rounds + 1) + 1 > packed.config.model.context_length:
        parser.error("--prompt + --steps x (--rounds + 1) pass the model's context")
    layouts = {"packed": (packed.model, plain_linear), "rows kernel": (rows, plain_linear)}
    layouts["rows ATen GEMV"] = (rows, aten_gemv)
    if args.fp32:
        layouts["fp32 packed"] = (load_for_inference(args.model, dtype=torch.float32)[0].model, plain_linear)
    vocab = packed.config.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    stream = torch.randint(0, vocab, (args.steps * (args.rounds + 1), 1, 1), generator=gen)
    caches: dict = {}  # layout -> its KV cache

    def use(name: str) -> torch.nn.Module:
        model, product = layouts[name]
        resident.plain_linear = product  # what the row layout's experts and linears multiply by
        return model

    def decoding(name: str):
        def step() -> None:
            cache = caches[name]
            decode_step(use(name), stream[cache.length - args.prompt], cache)

        return step

    try:
        for name in layouts:
            caches[name] = prefill(use(name), ids)[1]
            for _ in range(args.steps):
                decoding(name)()
        decode_ms = alternate_blocks({name: decoding(name) for name in layouts}, args.steps, args.rounds)
        prompt_s = alternate_blocks({name: lambda n=name: prefill(use(n), ids) for name in layouts}, 1, args.rounds)
    finally:
        resident.plain_linear = plain_linear
    prompt_tok_s = {name: [args.prompt / (ms / 1e3) for ms in v] for name, v in prompt_s.items()}
    print(
        f"{args.model}, {args.threads} threads, bf16 (the row kernel's {rows_isa()} build), "
        f"a {args.prompt}-token prompt, {args.rounds} rounds:"
    )
    for name in layouts:
        decode, prompt = show(decode_ms[name], ".2f"), show(prompt_tok_s[name], ".0f")
        print(f"  {name:15} decode step ms {decode}  prompt tokens/s {prompt}")
    if args.json:
        figures = {
            name: {"decode_ms": spread(decode_ms[name], 3), "prompt_tok_s": spread(prompt_tok_s[name], 1)}
            for name in layouts
        }
        print(
            json.dumps(
                {
                    "layouts": figures,
                    "threads": args.threads,
                    "prompt": args.prompt,
                    "isa": rows_isa(),
                    "commit": source_commit(),
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
