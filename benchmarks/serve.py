"""Serving many clients: ``moekit serve`` (continuous batching, paged KV cache) against its baselines.

Builds (once, cached under /tmp) a byte-level MoE model with random weights, and takes prompts from
real text (tinyshakespeare). Sections, each over --repeats rounds (median and min-max):
  decode      ms per decoded token at batch 1: the engine's step, ``generate``, and transformers'
              ``generate`` on the same model exported with ``moekit.convert.hf.to_hf`` (greedy)
  batching    16 prompts x --max-tokens: one static batch (``generate`` with batch 16), one request
              at a time (``generate`` with batch 1, 16 times), and 16 concurrent streaming clients of
              a ``moekit serve`` process on loopback; tokens/s of each
  arrival     a 16th request arriving while 15 others decode: its time to first token against its
              own prefill (alone, batch 1) plus two decode steps of the 15 (their inter-token median)
  poisson     --requests streaming clients arriving as a Poisson process at each --rates: throughput,
              TTFT and ITL p50 / p99, for the resident model and with experts offloaded (--budget)
  offload     benchmarks/offload.py's model (experts >= 4x --offload-budget), cold: its static batch 16
              (``generate``, LRU + prefetch, what offload.py reports) against 16 streaming clients of a
              fresh ``moekit serve --memory-budget`` (default flags, and the whole prefill in one step)
  profile     (--profile) one step at 16 decoding sequences: the engine's step against ``generate``'s
              decode step at batch 16, by phase and by torch op; the server's engine thread by phase
              and by CPU state (on a CPU, or ready and waiting for one), with the CPU the server, the
              clients and the machine's other processes used, comes with ``batching`` (/metrics, /proc)
The server is a real subprocess (the CLI); clients are threads of this process reading the SSE stream
with ``http.client``; the baselines run here while the server idles.

Torch runs on --threads threads (default 1) here and in the server: on a shared machine two spinning
threads per process slow every step several times over.

    python benchmarks/serve.py [--json] [--repeats 3] [--max-tokens 32] [--rates 2 4 8] [--budget 60MB] [--threads 1]
                               [--sections decode batching poisson offload] [--profile] [--variant NAME=FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import torch
from _engine_steps import decoding_engine, profile_section
from _serve_clients import THREAD_STATES, Server, clients, engine_seconds, latency, stream
from _spread import show, spread

from moekit import runconfig
from moekit.infer.generate import generate, left_pad
from moekit.infer.offload import OffloadOptions
from moekit.model import Transformer
from moekit.run.checkpoint import save_checkpoint
from moekit.run.load import load_run
from moekit.tokenizer import ByteTokenizer
from moekit.units import parse_bytes

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"
OVERRIDES = {
    "model.d_model": "256",
    "model.n_layers": "4",
    "model.n_heads": "4",
    "model.d_ff": "512",
    "model.context_length": "512",
    "model.tie_embeddings": "false",
    "moe.num_experts": "16",
    "moe.top_k": "2",
}


def build_run(root: Path) -> Path:
    run_dir = root / "run"
    if not (run_dir / "config.json").is_file():
        cfg = runconfig.resolve("tiny", OVERRIDES)
        torch.manual_seed(0)
        model = Transformer(cfg.model, cfg.moe)
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(cfg.to_json())
        ByteTokenizer().save(run_dir)
        save_checkpoint(run_dir, 1, model, {}, keep=1)
    return run_dir


def text_prompts(path: Path, n: int, seed: int, lo: int = 32, hi: int = 96) -> list[str]:
    """``n`` slices of the corpus, ``lo``..``hi`` characters, cut at random places."""
    text = path.read_text("utf-8")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start, size = rng.randrange(len(text) - hi), rng.randint(lo, hi)
        out.append(text[start : start + size])
    return out


@torch.no_grad()
def decode_ms(run, hf, prompt: list[int], tokens: int) -> dict[str, float]:
    """ms per decoded token at batch 1 (prefill excluded) of the engine step, generate and transformers."""
    ids = torch.tensor([prompt])
    out: dict[str, float] = {}
    engine = decoding_engine(run, [prompt], tokens + 1)
    t = time.perf_counter()
    while engine.running:
        engine.step()
    out["engine step"] = (time.perf_counter() - t) / tokens * 1e3
    for name, call in (
        ("generate", lambda n: generate(run.model, ids, n, 0.0)),
        ("transformers", lambda n: hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)),
    ):
        t = time.perf_counter()
        call(1)
        one = time.perf_counter() - t
        t = time.perf_counter()
        call(tokens + 1)
        out[name] = (time.perf_counter() - t - one) / tokens * 1e3
    return out


def static_and_sequential(run, prompts: list[str], max_tokens: int) -> dict[str, float]:
    """tokens/s of one batch of all prompts, and of one prompt at a time (both ``generate``, greedy)."""
    encoded = [list(p.encode()) for p in prompts]
    ids, pad = left_pad(encoded)
    t = time.perf_counter()
    generate(run.model, ids, max_tokens, 0.0, left_pad_B=pad)
    static = len(prompts) * max_tokens / (time.perf_counter() - t)
    t = time.perf_counter()
    for e in encoded:
        generate(run.model, torch.tensor([e]), max_tokens, 0.0)
    return {"static batch": static, "one at a time": len(prompts) * max_tokens / (time.perf_counter() - t)}


def arrival(server: Server, run, prompts: list[str], max_tokens: int) -> dict[str, float]:
    """TTFT of a 16th request once 15 are decoding, against its prefill alone + two decode steps."""
    records: list = []
    first: list = []
    threads = [
        threading.Thread(target=stream, args=(server, p, max_tokens, i, records, 0.0, first))
        for i, p in enumerate(prompts[:15])
    ]
    for t in threads:
        t.start()
    while len(first) < 15:  # every one of the 15 is decoding
        time.sleep(0.005)
    late: list = []
    stream(server, prompts[15], 8, 15, late)
    for t in threads:
        t.join()
    itl = [b - a for _, times, _ in records for a, b in zip(times, times[1:], strict=False)]
    ids = torch.tensor([list(prompts[15].encode())])
    with torch.no_grad():
        t = time.perf_counter()
        run.model(ids)
        prefill = time.perf_counter() - t
    ttft = late[0][1][0] - late[0][0]
    return {
        "ttft": ttft,
        "bound": prefill + 2 * statistics.median(itl),
        "prefill": prefill,
        "step": statistics.median(itl),
    }


def poisson(server: Server, prompts: list[str], rate: float, max_tokens: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    t0, starts, at = time.perf_counter() + 0.2, [], 0.0
    for _ in prompts:
        at += rng.expovariate(rate)
        starts.append(t0 + at)
    records, _ = clients(server, prompts, max_tokens, starts)
    wall = max(times[-1] for _, times, _ in records) - t0
    return {"tokens_per_s": len(prompts) * max_tokens / wall, **latency(records)}


def offloaded(args: argparse.Namespace) -> dict[str, list[float]]:
    """tokens/s of offload.py's static batch 16 (cold, LRU + prefetch) and of 16 streaming clients of a
    fresh server at the same budget (cold too: its expert cache starts empty, reads bypass the page
    cache), round by round."""
    import offload  # benchmarks/offload.py: its model, prompts and timing

    run_dir = offload.build_run(args.offload_cache / "run")
    ids, pad = offload.prompts(args.text, 16)
    texts = [bytes(row[p:].tolist()).decode() for row, p in zip(ids, pad.tolist(), strict=True)]
    assert all(list(t.encode()) == row[p:].tolist() for t, row, p in zip(texts, ids, pad.tolist(), strict=True))
    n, budget = args.offload_tokens, args.offload_budget
    whole = ("--prefill-chunk", "512", "--prefill-tokens", "512")
    servers = {"16 streams (serve)": (), "16 streams, prefill in one step": whole}
    out: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        opts = OffloadOptions(parse_bytes(budget, "--offload-budget"), "lru", "router", drop_pages=True)
        run = load_run(run_dir, offload=opts)
        run.offloader.store.drop_page_cache()
        _, seconds = offload.timed(run.model, args.text, 16, n)
        run.offloader.close()
        out.setdefault("static batch 16 (offload.py)", []).append(16 * n / seconds)
        for label, flags in servers.items():
            server = Server(run_dir, "--memory-budget", budget, *flags)
            try:
                _, wall = clients(server, texts, n, [0.0] * 16)
            finally:
                server.close()
            out.setdefault(label, []).append(16 * n / wall)
    return out


SECTIONS = ("decode", "batching", "poisson", "offload")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=24, help="requests per Poisson run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in the server")
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0], help="Poisson arrival rates /s")
    parser.add_argument("--budget", default="60MB", help="--memory-budget of the offloaded server")
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, default=list(SECTIONS), help="what runs (all)")
    parser.add_argument("--profile", action="store_true", help="also: one step at 16 sequences, by phase and op")
    parser.add_argument("--offload-budget", default="512MB", help="memory budget of the offload section")
    parser.add_argument("--offload-tokens", type=int, default=8, help="tokens per prompt there (offload.py's)")
    parser.add_argument("--offload-cache", type=Path, default=Path("/tmp/moekit-offload-bench"))
    variant = "batching: one more server with extra flags of moekit serve, its rounds in turn with the default's"
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS", help=variant)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/moekit-bench-serve"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server subprocesses' torch threads
    run_dir = build_run(args.cache)
    run = load_run(run_dir)
    prompts = text_prompts(args.text, 16, seed=0)
    figures: dict = {"threads": torch.get_num_threads(), "max_tokens": args.max_tokens}
    if args.profile:
        figures["step_ms_16"] = profile_section(args, run, prompts)
    if "decode" in args.sections:
        figures["decode_ms_per_token_batch1"] = decode_section(args, run, prompts)
    if "batching" in args.sections:
        figures.update(batching_section(args, run, run_dir, prompts))
    if "poisson" in args.sections:
        figures["poisson"] = poisson_section(args, run_dir)
    if "offload" in args.sections:
        table = offloaded(args)
        static = table["static batch 16 (offload.py)"]
        print(
            f"\noffloaded at --memory-budget {args.offload_budget} (offload.py's model), 16 prompts x "
            f"{args.offload_tokens} tokens, cold, tokens/s (serve / static per round)"
        )
        figures["offload_tokens_per_s"] = {k: spread(v, 2) for k, v in table.items()}
        figures["offload_serve_over_static"] = {}
        for name, values in table.items():
            ratio = [a / b for a, b in zip(values, static, strict=True)]
            extra = f"   = {show(ratio, '.2f')}x static" if values is not static else ""
            if values is not static:
                figures["offload_serve_over_static"][name] = spread(ratio, 2)
            print(f"  {name:<32} {show(values, '.1f')}{extra}")
    if args.json:
        print(json.dumps(figures))
    return 0


def decode_section(args: argparse.Namespace, run, prompts: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    from moekit.convert.hf import to_hf

    to_hf(run.model, args.cache / "hf")
    hf = AutoModelForCausalLM.from_pretrained(args.cache / "hf", dtype=torch.float32).eval()
    decode: dict[str, list[float]] = {}
    for r in range(args.repeats):  # interleaved round by round
        for name, ms in decode_ms(run, hf, list(prompts[r % len(prompts)].encode()), args.max_tokens).items():
            decode.setdefault(name, []).append(ms)
    print(f"\ndecode at batch 1, ms/token ({args.max_tokens} tokens after the prompt, greedy)")
    for name, values in decode.items():
        print(f"  {name:<14} {show(values, '.3f')}")
    return {k: spread(v) for k, v in decode.items()}


def batching_section(args: argparse.Namespace, run, run_dir: Path, prompts: list[str]) -> dict:
    """16 streams against the static batch and one at a time; the server's engine thread by phase; the
    late arrival's TTFT. Each --variant is one more server (extra flags), its rounds taken in turn with
    the default server's; its figures carry its name."""
    batching: dict[str, list[float]] = {}
    phases: dict[str, dict[str, list[float]]] = {}
    arrivals: dict[str, list[dict]] = {}
    flags = {"serve": [], **{name: extra.split() for name, extra in (v.split("=", 1) for v in args.variant)}}
    servers: dict[str, Server] = {}
    try:
        for name, extra in flags.items():
            servers[name] = Server(run_dir, *extra)
        for _ in range(args.repeats):
            for label, tps in static_and_sequential(run, prompts, args.max_tokens).items():
                batching.setdefault(label, []).append(tps)
            for name, server in servers.items():
                before = engine_seconds(server)
                _, wall = clients(server, prompts, args.max_tokens, [0.0] * 16)
                after = engine_seconds(server)
                batching.setdefault(f"16 streams ({name})", []).append(16 * args.max_tokens / wall)
                steps = after["steps"] - before["steps"]
                states = [k for k in ("schedule", "forward", "emit", "idle", *THREAD_STATES.values()) if k in after]
                per_step = {p: (after[p] - before[p]) / steps * 1e3 for p in states}
                if "machine cpu" in after:  # the CPU that neither the server nor its clients used
                    kinds = ("machine cpu", "server cpu", "client cpu")
                    used = {k: (after[k] - before[k]) / steps * 1e3 for k in kinds}
                    machine = used.pop("machine cpu")
                    per_step.update(used, **{"others' cpu": machine - sum(used.values())})
                per_step["load average"] = os.getloadavg()[0]
                for key, value in {"steps": steps, **per_step, "wall / step": wall / steps * 1e3}.items():
                    phases.setdefault(name, {}).setdefault(key, []).append(value)
                arrivals.setdefault(name, []).append(arrival(server, run, prompts, args.max_tokens))
    finally:
        for server in servers.values():
            server.close()
    figures: dict = {"batching_tokens_per_s": {k: spread(v, 1) for k, v in batching.items()}}
    baselines = [k for k in batching if not k.startswith("16 streams")]
    print(f"\n16 prompts x {args.max_tokens} tokens, tokens/s (streams / baseline per round)")
    for k in baselines:
        print(f"  {k:<20} {show(batching[k], '.1f')}")
    for name, extra in flags.items():
        tps, suffix = batching[f"16 streams ({name})"], "" if name == "serve" else f" ({name})"
        ratio = {k: [s / b for s, b in zip(tps, batching[k], strict=True)] for k in baselines}
        figures[f"serve_over{suffix}"] = {k: spread(v, 2) for k, v in ratio.items()}
        print(f"  16 streams{suffix}{''.join(' ' + f for f in extra)}: {show(tps, '.1f')}")
        for k, v in ratio.items():
            print(f"    = {show(v, '.2f')}x {k}")
        figures[f"serve_engine_ms_per_step{suffix}"] = {k: spread(v, 2) for k, v in phases[name].items()}
        print("    the server's engine thread, ms per step (steps: a count), by phase and by CPU state; the CPU")
        print("    of the server, of the clients and of other processes; the 1-minute load average after each round")
        for phase, values in phases[name].items():
            print(f"      {phase:<15} {show(values, '.2f')}")
        figures[f"arrival{suffix}"] = {k: spread([a[k] for a in arrivals[name]]) for k in arrivals[name][0]}
        print("    a request arriving while 15 decode: TTFT vs its prefill alone + 2 decode steps (s)")
        for key in ("ttft", "bound", "prefill", "step"):
            print(f"      {key:<8} {show([a[key] for a in arrivals[name]], '.4f')}")
    return figures


def poisson_section(args: argparse.Namespace, run_dir: Path) -> list[dict]:
    tables = {}
    for label, flags in (("resident", ()), (f"offl {args.budget}", ("--memory-budget", args.budget))):
        server = Server(run_dir, *flags)
        try:
            tables[label] = {
                rate: [
                    poisson(server, text_prompts(args.text, args.requests, seed=r + 1), rate, args.max_tokens, r)
                    for r in range(args.repeats)
                ]
                for rate in args.rates
            }
        finally:
            server.close()
    print(f"\nPoisson arrivals, {args.requests} requests x {args.max_tokens} tokens (ms; median and min-max)")
    heads = ("tokens/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    print(f"  {'model':<10} {'rate/s':>6} " + " ".join(f"{h:>24}" for h in heads))
    out = []
    for label, table in tables.items():
        for rate, runs in table.items():
            row = {k: [r[k] for r in runs] for k in runs[0]}
            ms = {k: [v * 1e3 for v in row[k]] for k in row if k != "tokens_per_s"}
            cells = [show(row["tokens_per_s"], ".1f")] + [show(ms[k], ".1f") for k in ms]
            print(f"  {label:<10} {rate:>6.1f} " + " ".join(f"{c:>24}" for c in cells))
            out.append({"model": label, "rate": rate, **{k: spread(v, 4) for k, v in row.items()}})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
