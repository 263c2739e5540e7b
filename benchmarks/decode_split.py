"""Where a batch-1 decode step's time goes on a CPU: its weights' products against everything else.

Loads a model as ``moekit generate`` does (``--layout rows``: bf16 weights kept plain for the row kernel
where it runs; ``--layout packed``: prepacked for oneDNN, as a server holds them) and times decode
steps two ways, taking turns in blocks: as they run, and with every product replayed from its first
output (the same ops and Python around it, no weight read). The difference is what the products cost;
the weights they read per step (attention's projections, the two routed experts of each layer picked
that step, the head) over that time is the bandwidth they reach, beside the same products alone (each
weight streamed from memory in turn, as ``cpu_matmul.py`` times them). A third kind of block runs the
step through the model's forward instead of ``decode_step``'s one-token path (``infer/token_step.py``):
what that path saves; a fourth runs the one-token path under ``no_grad`` instead of ``decode_step``'s
inference mode: what that mode saves. The products are those of the one-token path's ops: the row
layout's C calls (a block's attention half and MoE layer, or every block, in one call:
``token_step.C_CALLS``) are off in those blocks, and a fifth kind times the step with them, as ``moekit
generate`` runs it; a sixth with a call per block half where every block could take one call together
(``token_step.ONE_CALL`` off).

    python benchmarks/decode_split.py MODEL_DIR [--layout rows|packed] [--threads 2] [--steps 40]
        [--rounds 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _provenance import source_commit
from _spread import alternate_blocks, show, spread

import moekit.infer.resident_experts as resident
import moekit.infer.token_step as ops
from moekit.experts.matmul import single_token_kernels
from moekit.infer.generate import decode_step, prefill
from moekit.infer.token_step import takes, token_step
from moekit.model_dir import load_for_inference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a run or Hugging Face directory")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per block (default: 40)")
    parser.add_argument("--rounds", type=int, default=4, help="blocks of each kind (default: 4)")
    parser.add_argument(
        "--layout", choices=("rows", "packed"), default="rows", help="rows: as moekit generate (default); packed"
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    run, _ = load_for_inference(args.model, few_rows=args.layout == "rows")
    if 8 + 4 * args.steps * args.rounds + 1 > run.config.model.context_length:
        parser.error(
            f"--steps x --rounds x 4 decode steps pass the model's {run.config.model.context_length} positions"
        )
    model = run.model
    rows = any(isinstance(m, resident.RowExperts | resident.RowLinear) for m in model.modules())
    hooked = "plain_linear" if rows else "packed_linear"  # the product every weight goes through
    real = getattr(resident, hooked)
    logits, cache = prefill(model, torch.randint(0, run.config.model.vocab_size, (1, 8)))
    token = [logits.argmax(-1, keepdim=True)]
    weights: dict[int, torch.Tensor] = {}  # weight -> its first output
    read: list[int] = [0]  # bytes of the weights read by the steps of a "real" block
    counting = [True]  # whether the products read now are counted (the same call in every kind of block)

    def key(args: tuple, kwargs: dict) -> int:
        """The weight of a product's call: a packed one is the same object each time, a plain one a new view."""
        w = args[0] if args else next(iter(kwargs.values()))
        return id(w) if w.is_mkldnn else w.data_ptr()

    def counted(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = real(x, *args, **kwargs)
        weights.setdefault(key(args, kwargs), y)
        read[0] += y.shape[-1] * x.shape[-1] * x.element_size() if counting[0] else 0
        return y

    def replayed(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = weights.get(key(args, kwargs))
        return real(x, *args, **kwargs) if y is None else y.view(*x.shape[:-1], y.shape[-1])

    def use(product) -> None:
        setattr(resident, hooked, product)

    def step(product, c_calls: bool = False, one_call: bool = True) -> None:
        use(product)
        counting[0] = True
        ops.C_CALLS, ops.ONE_CALL = c_calls, one_call
        token[0] = decode_step(model, token[0], cache).argmax(-1, keepdim=True)
        ops.C_CALLS = ops.ONE_CALL = True

    @torch.no_grad()
    def forward() -> None:
        use(counted)
        counting[0] = False
        with single_token_kernels(1):
            token[0] = model(token[0], cache=cache).logits[:, -1].argmax(-1, keepdim=True)

    @torch.no_grad()
    def grad_mode() -> None:  # decode_step's one-token path, not in inference mode
        use(counted)
        counting[0] = False
        ops.C_CALLS = False
        with single_token_kernels(1):
            assert takes(model, token[0]), "a model the one-token path takes"
            token[0] = token_step(model, token[0], cache).clone().argmax(-1, keepdim=True)
        ops.C_CALLS = True

    step(counted)  # every weight's first output, for the replay
    read[0] = 0
    kinds = {"real": lambda: step(counted), "replayed": lambda: step(replayed), "forward": forward}
    kinds["no_grad"] = grad_mode
    kinds["c_calls"] = lambda: step(real, c_calls=True)
    kinds["block_calls"] = lambda: step(real, c_calls=True, one_call=False)
    ms = alternate_blocks(kinds, args.steps, args.rounds)
    use(real)
    gb_per_step = read[0] / (args.steps * args.rounds) / 1e9
    products = [a - b for a, b in zip(ms["real"], ms["replayed"], strict=True)]
    rates = [gb_per_step / (p / 1e3) for p in products]
    alone = _alone_rate(model, real, rows, args.rounds)
    print(
        f"{args.model}, {args.threads} threads, batch-1 decode, {'rows' if rows else 'packed'} layout,"
        f" ms per step over {args.rounds} blocks of {args.steps}:"
    )
    print(f"  step                        {show(ms['real'], '.2f')}")
    print(f"  without the weight products {show(ms['replayed'], '.2f')}")
    print(f"  the products                {show(products, '.2f')}: {gb_per_step * 1e3:.0f} MB a step")
    print(f"  their bandwidth, GB/s       {show(rates, '.1f')} (the same weights alone: {show(alone, '.1f')})")
    print(f"  through the forward         {show(ms['forward'], '.2f')}")
    print(f"  under no_grad               {show(ms['no_grad'], '.2f')} (not inference mode)")
    print(f"  with the C calls            {show(ms['c_calls'], '.2f')} (as moekit generate steps)")
    print(f"  with a C call per half      {show(ms['block_calls'], '.2f')} (not every block in one)")
    if args.json:
        figures = {"step_ms": ms["real"], "replayed_ms": ms["replayed"], "products_ms": products}
        figures["forward_ms"], figures["no_grad_ms"] = ms["forward"], ms["no_grad"]
        figures["c_calls_ms"], figures["block_calls_ms"] = ms["c_calls"], ms["block_calls"]
        out = {k: spread(v, 3) for k, v in figures.items()} | {"mb_per_step": round(gb_per_step * 1e3, 1)}
        out |= {"gb_s": spread(rates, 2), "gb_s_alone": spread(alone, 2), "threads": args.threads}
        out |= {"layout": "rows" if rows else "packed"}
        print(json.dumps(out | {"commit": source_commit()}))
    return 0


def _alone_rate(model: torch.nn.Module, product, rows: bool, rounds: int) -> list[float]:
    """GB/s of one row through every weight of the model's products in turn (more bytes than any cache):
    the plain ones the row layout keeps (each expert's apart), or the prepacked ones."""
    if rows:
        kept = [m for m in model.modules() if isinstance(m, resident.RowExperts | resident.RowLinear)]
        weights = [
            w
            for m in kept
            for name, b in m.named_buffers(recurse=False)
            if name != "bias"
            for w in b.view(-1, *b.shape[-2:])
        ]
    else:
        weights = [b for name, b in model.named_buffers() if "packed" in name and b.dim() == 2]
    if not weights:
        return [0.0]
    x = {w.size(1): torch.randn(1, w.size(1), dtype=model.embed.weight.dtype) for w in weights}
    rates = []
    for _ in range(rounds):
        total, started = 0, time.perf_counter()
        for w in weights:
            y = product(x[w.size(1)], w)
            total += y.shape[-1] * w.size(1) * y.element_size()
        rates.append(total / (time.perf_counter() - started) / 1e9)
    return rates


if __name__ == "__main__":
    raise SystemExit(main())
