"""In-process engine steps for benchmarks/serve.py: an engine whose sequences all decode, and one step
at 16 sequences against ``generate``'s decode step, by phase and by torch op (``--profile``)."""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from _spread import show, spread

from moekit.infer.generate import decode_step, left_pad, prefill
from moekit.serve.engine import Engine, EngineOptions
from moekit.serve.scheduler import SamplingParams, Seq


def decoding_engine(run, prompts: list[list[int]], max_tokens: int) -> Engine:
    """An in-process engine whose greedy sequences have all prefilled: each step from here decodes."""
    engine = Engine(run, EngineOptions(kv_budget=64 << 20))
    engine.waiting.extend(Seq(p, SamplingParams(max_tokens, 0.0), lambda e: None) for p in prompts)
    while engine.waiting or any(s.computed < len(s.prompt) for s in engine.running):
        engine.step()
    return engine


@torch.no_grad()
def step_ms(run, prompts: list[list[int]], steps: int, ops: dict | None = None) -> dict[str, float]:
    """ms of one step with every prompt decoding: ``generate``'s decode step (one static batch) and the
    engine's step with its phases; with ``ops``, each one's self CPU ms per step by torch op, added."""
    from torch.profiler import ProfilerActivity, profile

    ids, pad = left_pad(prompts)
    logits, cache = prefill(run.model, ids, pad)
    token = logits.argmax(-1, keepdim=True)
    engine = decoding_engine(run, prompts, steps + 1)
    before = dict(engine.seconds)
    out: dict[str, float] = {}
    calls = {
        "generate decode step": lambda: decode_step(run.model, token, cache).argmax(-1, keepdim=True),
        "engine step": engine.step,
    }
    for name, call in calls.items():
        with profile(activities=[ProfilerActivity.CPU]) if ops is not None else contextlib.nullcontext() as prof:
            t = time.perf_counter()
            for _ in range(steps):
                call()
            out[name] = (time.perf_counter() - t) / steps * 1e3
        if ops is not None:
            for e in prof.key_averages():
                table = ops.setdefault(name, {})
                table[e.key] = table.get(e.key, 0.0) + e.self_cpu_time_total / 1e3 / steps
    for phase in ("schedule", "forward", "emit"):
        out[f"  engine {phase}"] = (engine.seconds[phase] - before[phase]) / steps * 1e3
    return out


def profile_section(args: argparse.Namespace, run, prompts: list[str]) -> dict:
    """One step at 16 decoding sequences, in this process: engine against ``generate``, by phase and op."""
    encoded = [list(p.encode()) for p in prompts]
    rows: dict[str, list[float]] = {}
    ops: dict[str, dict[str, float]] = {}
    for r in range(args.repeats):
        for name, ms in step_ms(run, encoded, args.max_tokens, ops if r == 0 else None).items():
            rows.setdefault(name, []).append(ms)
    print(f"one step at 16 decoding sequences, ms ({args.max_tokens} steps per round, in this process)")
    for name, values in rows.items():
        print(f"  {name:<22} {show(values, '.2f')}")
    print("  self CPU ms per step by torch op (first round; the 8 costliest of either):")
    top = sorted({k for t in ops.values() for k in t}, key=lambda k: -max(t.get(k, 0.0) for t in ops.values()))[:8]
    print(f"    {'op':<52} " + " ".join(f"{name:>22}" for name in ops))
    for k in top:
        print(f"    {k[:52]:<52} " + " ".join(f"{t.get(k, 0.0):>22.2f}" for t in ops.values()))
    return {
        "steps": {k: spread(v, 2) for k, v in rows.items()},
        "ops_first_round": {n: {k: round(t.get(k, 0.0), 2) for k in top} for n, t in ops.items()},
    }
