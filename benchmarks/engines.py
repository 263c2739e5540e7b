"""moekit beside the engines a user would run instead, on the same real-size MoE and the same machine.

    python benchmarks/engines.py --setup                   # once: the peers' environments (vLLM, llama.cpp)
    python benchmarks/engines.py [--models d1024 d2048] [--threads 2] [--rounds 3] [--new-tokens 64]
                                 [--sections decode serve] [--variants ...] [--clients 1 16 64] [--json]

Models (Hugging Face directories built by transformers from a local config, random weights, bf16, with a
byte-level BPE tokenizer of 8,192 words trained with ``tokenizers`` on tinyshakespeare; made once under
``--work``):
  d1024  Mixtral layout: 8 layers, d 1024, 8 experts of width 2048, top-2, 16 heads / 4 KV heads (440M)
  d2048  the same with d 2048, 16 experts of width 1792 (1.5B)

Sections, every engine in a process of its own and the engines taking turns each round (the order
rotating), with the machine's load average printed:
  decode  ``_engine_runner.py`` per engine and variant: load and first-token time, batch-1 decode
          tokens/s and inter-token latency (greedy, a 32-token prompt from the corpus), prefill tokens/s
          of 512 tokens, peak RSS, and the first position where the greedy tokens leave transformers'
          fp32 tokens. moekit: fp32, bf16, fp16, int8 and int4 experts, and int8+dense / int4+dense (every
          other linear weight quantized too, ``--dense-format``); transformers: fp32, bf16 (its
          forward with a DynamicCache, the loop ``generate`` runs); llama.cpp (llama-cpp-python, files
          from llama.cpp's converter and quantizer): F16, BF16, Q8_0, Q4_K_M.
  serve   ``moekit serve`` and vLLM's CPU build (``vllm.entrypoints.openai.api_server``, with its CPU
          guide's settings: cores bound, tcmalloc and Intel OpenMP preloaded), one server at a time,
          fp32 and bf16, greedy streaming clients (``--clients``) on loopback sending prompts from the
          corpus (``--prompt-chars`` long) for ``--new-tokens`` tokens each: output tokens/s, time to
          first token p50, start-up seconds and the server's peak RSS (VmHWM summed over its
          processes); each engine's KV cache ``KV_CACHE_GIB``.

The peers live in virtual environments of their own under ``--work`` (``--setup``; see ``_peers.py``),
never in moekit's; an engine whose environment is missing is skipped with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import _peers
from _provenance import source_commit
from _serve_clients import SRC, Server, add_prompt_chars, check_prompt_chars, served_rows
from _spread import show, spread
from serve import DEFAULT_TEXT, text_prompts

RUNNER = Path(__file__).resolve().parent / "_engine_runner.py"
MODELS = {
    "d1024": {"hidden_size": 1024, "intermediate_size": 2048, "num_local_experts": 8},
    "d2048": {"hidden_size": 2048, "intermediate_size": 1792, "num_local_experts": 16},
}
SHARED = {"num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "num_experts_per_tok": 2}
VOCAB = 8192
VARIANTS = {  # moekit's int8 / int4: its experts' format, the rest bf16; +dense: every other linear weight too (the
    # head int8 under int4), as llama.cpp's Q8_0 / Q4_K_M quantize every matrix (Q4_K_M's output head: 6 bits)
    "moekit": ["fp32", "bf16", "fp16", "int8", "int4", "int8+dense", "int4+dense"],
    "transformers": ["fp32", "bf16"],
    "llama.cpp": ["F16", "BF16", "Q8_0", "Q4_K_M"],
}
SERVED = ("fp32", "bf16")


def build_model(work: Path, name: str, text: Path) -> Path:
    """The model directory (config, bf16 safetensors, tokenizer), made once."""
    out = work / "models" / name
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    corpus = text.read_text("utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([corpus[i : i + 10_000] for i in range(0, len(corpus), 10_000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    cfg = MixtralConfig(
        vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        **SHARED, **MODELS[name],
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    model.save_pretrained(out)
    return out


def decode_prompt(model_dir: Path, text: Path, length: int = 32) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text.read_text("utf-8")[10_000:12_000]).ids
    return ids[:length]


def run_engine(args, engine: str, variant: str, model_dir: Path, prompt: list[int]) -> dict | None:
    """One runner process; None where the engine's environment is missing."""
    if engine == "llama.cpp":
        if not _peers.installed(args.work, "llama"):
            return None
        python, model = _peers.python(args.work, "llama"), _peers.gguf(args.work, model_dir, variant, args.threads)
    else:
        python, model = Path(sys.executable), model_dir
    argv = [str(python), str(RUNNER), engine, str(model), "--variant", variant, "--threads", str(args.threads)]
    argv += ["--prompt", json.dumps(prompt), "--new-tokens", str(args.new_tokens), "--prefill", str(args.prefill)]
    argv += ["--vocab", str(VOCAB), "--launched-at", str(time.time())]
    env = {**os.environ, "PYTHONPATH": str(SRC)} if engine == "moekit" else dict(os.environ)
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_section(args, model_dir: Path, prompt: list[int]) -> dict:
    pairs = [(e, v) for e in args.engines if e in VARIANTS for v in VARIANTS[e] if v in (args.variants or [v])]
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        print(f"[decode] round {r + 1}/{args.rounds}, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
        for engine, variant in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            got = run_engine(args, engine, variant, model_dir, prompt)
            if got is not None:
                results.setdefault(f"{engine} {variant}", []).append(got)
    reference = results.get("transformers fp32", [{}])[0].get("tokens")
    summary = {}
    for name, runs in results.items():
        row = {k: spread([run[k] for run in runs]) for k in runs[0] if k != "tokens"}
        if reference:
            row["first_divergence"] = [first_difference(run["tokens"], reference) for run in runs]
        summary[name] = row
    return summary


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where ``tokens`` leave ``reference``; None where every position agrees."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), None)


KV_CACHE_GIB = 2  # each server's KV cache: vLLM's VLLM_CPU_KVCACHE_SPACE, moekit's --kv-budget


class VllmServer:
    """vLLM's CPU build serving ``model_dir`` on loopback; the request fields it needs (its model's name,
    and no stop at the end token, so every request decodes its ``max_tokens``)."""

    def __init__(self, work: Path, model_dir: Path, dtype: str, threads: int, port: int = 8391) -> None:
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "LD_PRELOAD": _peers.vllm_preload(work),
        }
        argv = [str(_peers.python(work, "vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        argv += ["--port", str(port), "--dtype", {"fp32": "float32", "bf16": "bfloat16"}[dtype]]
        argv += ["--max-model-len", "1024", "--served-model-name", "m"]
        started = time.perf_counter()
        self.log = work / f"vllm-{model_dir.name}-{dtype}.log"  # its settings (max_num_seqs, ...) are logged there
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.host, self.port = "127.0.0.1", port
        self.fields = {"model": "m", "ignore_eos": True}
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.proc.returncode} before serving (see {self.log})")
                if time.perf_counter() - started > 900:
                    raise RuntimeError(f"vLLM did not serve within 900 s (see {self.log})")
                try:
                    urllib.request.urlopen(f"http://{self.host}:{port}/v1/models", timeout=2)
                    break
                except OSError:
                    time.sleep(1)
        except BaseException:  # Ctrl-C included: its own session does not get the terminal's signal
            self.close()
            raise
        self.startup_s = time.perf_counter() - started

    def close(self) -> None:
        """Stop the server and every process it started (its engine core, its workers), and wait until
        they are gone: one left spinning would slow the engine measured next. SIGTERM, then after 60 s
        SIGKILL; an error if any is still there 30 s later."""
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        started = time.perf_counter()
        while _group_alive(self.proc.pid):
            waited = time.perf_counter() - started
            if waited > 90:
                raise RuntimeError(f"vLLM's processes (group {self.proc.pid}) outlived SIGKILL")
            if waited > 60:
                _signal_group(self.proc.pid, signal.SIGKILL)
            time.sleep(0.5)


def _signal_group(pgid: int, sig: int) -> None:
    """``sig`` to every process of group ``pgid``, if any is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (not yet reaped zombies aside)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a process and its descendants, in MB (read before they exit)."""
    total, pending = 0, [pid]
    while pending:
        p = pending.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
            pending += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def start_server(args, engine: str, dtype: str, model_dir: Path):
    if engine == "vllm":
        return VllmServer(args.work, model_dir, dtype, args.threads)
    started = time.perf_counter()
    server = Server(model_dir, "--threads", str(args.threads), "--dtype", dtype, "--kv-budget", f"{KV_CACHE_GIB}GiB")
    server.startup_s = time.perf_counter() - started
    server.fields = {"ignore_eos": True}  # as vLLM's: every request decodes its max_tokens
    return server


def serve_section(args, model_dir: Path) -> dict:
    engines = [e for e in ("moekit", "vllm") if e in args.engines]
    if "vllm" in engines and not _peers.installed(args.work, "vllm"):
        print("[serve] vLLM's environment is missing (--setup): moekit alone", file=sys.stderr)
        engines.remove("vllm")
    prompts = text_prompts(args.text, max(args.clients), 0, *args.prompt_chars)
    results: dict[str, list] = {}
    pairs = [(e, d) for e in engines for d in SERVED]
    for r in range(args.rounds):
        for engine, dtype in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            print(f"[serve] round {r + 1} {engine} {dtype}, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
            server = start_server(args, engine, dtype, model_dir)
            try:
                for n, row in served_rows(server, prompts, args.clients, args.new_tokens).items():
                    results.setdefault(f"{engine} {dtype} x{n}", []).append(row)
                rss = peak_rss_mb(server.proc.pid)
                results.setdefault(f"{engine} {dtype} startup", []).append({"s": server.startup_s, "rss_mb": rss})
            finally:
                server.close()
    return {name: {k: spread([row[k] for row in rows]) for k in rows[0]} for name, rows in results.items()}


def print_tables(report: dict) -> None:
    for model, sections in report["models"].items():
        for name, rows in sections.get("decode", {}).items():
            cells = "  ".join(
                f"{key} {show([v['median'], v['min'], v['max']], '.1f')}"
                for key, v in rows.items()
                if key in ("decode_tok_s", "itl_ms_p50", "prefill_tok_s", "first_token_s", "peak_rss_mb")
            )
            print(f"{model}  {name:22s} {cells}  diverges at {rows.get('first_divergence')}")
        for name, rows in sections.get("serve", {}).items():
            cells = "  ".join(f"{k} {show([v['median'], v['min'], v['max']], '.2f')}" for k, v in rows.items())
            print(f"{model}  {name:22s} {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="install the peers' environments under --work and exit")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path.home() / ".cache" / "moekit-engines",
        help="the peers' environments, the models and GGUF files, the peers' logs (default: %(default)s)",
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="corpus of prompts and the tokenizer")
    parser.add_argument("--models", nargs="+", default=["d1024"], choices=sorted(MODELS), help="(default: d1024)")
    parser.add_argument(
        "--engines", nargs="+", default=["moekit", "transformers", "llama.cpp", "vllm"], help="(default: all)"
    )
    parser.add_argument(
        "--sections", nargs="+", default=["decode", "serve"], choices=["decode", "serve"], help="(default: both)"
    )
    parser.add_argument(
        "--variants", nargs="+", help="decode only these variants, of whichever engine has them (default: all)"
    )
    parser.add_argument("--threads", type=int, default=2, help="compute threads of every engine (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the engines taking turns (default: 3)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request (default: 64)")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill figure (default: 512)")
    parser.add_argument(
        "--clients", type=int, nargs="+", default=[1, 16, 64], help="streaming clients (default: 1 16 64)"
    )
    add_prompt_chars(parser)
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    check_prompt_chars(parser, args.prompt_chars)
    if args.setup:
        _peers.setup(args.work, ["vllm", "llama"])
        return 0
    report: dict = {"threads": args.threads, "versions": _peers.VERSIONS, "commit": source_commit()}
    report |= {"prompt_chars": args.prompt_chars}
    report |= {"load_average": [], "models": {}}
    for name in args.models:
        model_dir = build_model(args.work, name, args.text)
        sections: dict = {}
        if "decode" in args.sections:
            sections["decode"] = decode_section(args, model_dir, decode_prompt(model_dir, args.text))
        if "serve" in args.sections:
            sections["serve"] = serve_section(args, model_dir)
        report["models"][name] = sections
        report["load_average"].append(os.getloadavg()[0])
    print_tables(report)
    print(f"load average after each model: {', '.join(f'{x:.2f}' for x in report['load_average'])}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
