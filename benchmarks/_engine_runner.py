"""One engine, one process: load a model, decode greedily at batch 1, prefill a long prompt; print JSON.

Run by ``benchmarks/engines.py`` with the Python of the engine's own environment (moekit's, or a peer's
virtual environment), so this file imports nothing but the standard library at the top and each
engine's package inside its function::

    python _engine_runner.py ENGINE MODEL --variant V --threads N --prompt IDS --new-tokens N --prefill N
        --launched-at UNIX_TIME

Each engine runs the same loop, its library's forward (what its own generate and server call): the
prompt's ids in one forward (the last position's logits alone), then one forward per new token, the
next token the argmax of the last logits (greedy), every step timed on its own. Figures: seconds from
launch to the model loaded and to the first new token, decode tokens/s over the new tokens after the
first, inter-token latency, prefill tokens/s of ``--prefill`` random ids in one forward (a fresh
cache), the greedy tokens, and the process's peak RSS (VmHWM: for llama.cpp it counts the pages of
its memory-mapped weights that were read).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _moekit(args: argparse.Namespace):
    import torch

    from moekit.infer.generate import decode_step, prefill
    from moekit.model_dir import load_for_inference

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.variant, torch.bfloat16)
    fmt, _, dense = args.variant.partition("+")  # int8+dense: the experts and every other linear weight
    fmt = fmt if fmt in ("int8", "int4") else "fp"
    if dense and (dense != "dense" or fmt == "fp"):
        raise SystemExit(f"--variant {args.variant}: +dense goes with int8 or int4")
    dense_format = fmt if dense else "fp"
    # laid out as `moekit generate` lays out a batch-1 decode (few_rows)
    loaded = load_for_inference(
        args.model, "cpu", None, dtype, expert_format=fmt, dense_format=dense_format, few_rows=True
    )
    model = loaded[0].model
    state: dict = {}

    def forward(ids: list[int], fresh: bool) -> list[float]:
        if fresh:
            logits, state["cache"] = prefill(model, torch.tensor([ids]))
        else:
            logits = decode_step(model, torch.tensor([ids]), state["cache"])
        return logits[0]

    return forward, lambda logits: int(logits.argmax())


def _transformers(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.variant]
    # its default experts implementation (grouped_mm) measured fastest here: 46 tokens/s against eager's 44
    # and batched_mm's 18 (bf16, one thread, d1024)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    state: dict = {}

    @torch.no_grad()
    def forward(ids: list[int], fresh: bool):
        if fresh:
            state["cache"] = DynamicCache(config=model.config)
        out = model(torch.tensor([ids]), past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    return forward, lambda logits: int(logits.argmax())


def _llama_cpp(args: argparse.Namespace):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=args.model,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.prefill + 64,
        n_batch=args.prefill,
        flash_attn=True,
        verbose=False,
    )
    vocab = llm.n_vocab()

    def forward(ids: list[int], fresh: bool):
        if fresh:
            llm.reset()
        llm.eval(ids)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    return forward, lambda logits: int(np.argmax(logits))


def _peak_rss_mb() -> float:
    """This process's VmHWM (``ru_maxrss`` would carry the parent's peak across ``exec``)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


ENGINES = {"moekit": _moekit, "transformers": _transformers, "llama.cpp": _llama_cpp}


def run(args: argparse.Namespace) -> dict:
    forward, argmax = ENGINES[args.engine](args)
    loaded = time.time()
    prompt = json.loads(args.prompt)
    tokens, step_s = [], []
    started = time.perf_counter()
    token = argmax(forward(prompt, fresh=True))
    first_token = time.time()
    prompt_s = time.perf_counter() - started
    tokens.append(token)
    for _ in range(args.new_tokens - 1):
        t = time.perf_counter()
        token = argmax(forward([token], fresh=False))
        step_s.append(time.perf_counter() - t)
        tokens.append(token)
    rng = random.Random(args.seed)
    long_prompt = [rng.randrange(1, args.vocab) for _ in range(args.prefill)]
    prefill_s = []
    for _ in range(2):  # the first pass also allocates the cache for this length
        t = time.perf_counter()
        forward(long_prompt, fresh=True)
        prefill_s.append(time.perf_counter() - t)
    return {
        "load_s": loaded - args.launched_at,
        "first_token_s": first_token - args.launched_at,
        "prompt_s": prompt_s,
        "decode_tok_s": len(step_s) / sum(step_s),
        "itl_ms_p50": statistics.median(step_s) * 1e3,
        "prefill_tok_s": args.prefill / min(prefill_s),
        "tokens": tokens,
        "peak_rss_mb": _peak_rss_mb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("model", help="a Hugging Face directory (moekit, transformers) or a GGUF file (llama.cpp)")
    parser.add_argument("--variant", required=True, help="fp32 | bf16 | int8+dense | ... (moekit), F16 | Q8_0 | ...")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--prompt", required=True, help="the prompt's token ids, as a JSON list")
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--prefill", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launched-at", type=float, required=True)
    print(json.dumps(run(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
