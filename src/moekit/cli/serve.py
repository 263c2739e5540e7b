"""``moekit serve``: a trained run behind an OpenAI-compatible HTTP API with continuous batching."""

from __future__ import annotations

import argparse
import os

from moekit.cli.common import add_run_flags, load_for_inference, positive_int

API_KEY_VARIABLE = "MOEKIT_API_KEY"
# NOTE: the engine thread's OpenMP workers spin 10,000 rounds between parallel regions, not libgomp's
# 300,000: long enough for a decode step's back-to-back ops, short enough to leave the cores to the
# threads that parse requests and stream tokens. With the default, a client flooding 750 KB bodies
# stretched other clients' streams to 0.6 s between tokens (tests/e2e/test_cli_serve_abuse.py); the
# served tokens/s were the same within the machine's noise (d1024 bf16, 1 and 16 clients).
ENVIRONMENT = {"GOMP_SPINCOUNT": "10000"}

DESCRIPTION = """\
Serve a trained run over HTTP with OpenAI's API: POST /v1/completions and /v1/chat/completions
(streaming with "stream": true), GET /v1/models, GET /health (ready / busy / draining) and
GET /metrics (Prometheus). Requests are batched continuously: waiting ones join the running batch
at every decode step, long prompts are prefilled in chunks, and the KV cache is paged under
--kv-budget. SIGTERM drains: requests under way finish, new ones get 503, then the process exits 0;
requests still running after --drain-timeout, or at a second SIGTERM, each get an error and the exit
status is 1. The port refuses connections until the model is loaded. OpenMP's workers spin briefly
between parallel regions (GOMP_SPINCOUNT=10000 unless set), leaving the cores to the threads that
parse requests and stream tokens."""


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve a trained run over an OpenAI-compatible HTTP API", description=DESCRIPTION
    )
    serve.set_defaults(run=run, environment=ENVIRONMENT)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 = any free)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_VARIABLE} if set, which keeps "
        "the key out of the process list; else none)",
    )
    serve.add_argument("--model-name", help="the model id clients name (default: the run directory's name)")
    batching = serve.add_argument_group("batching and limits")
    batching.add_argument("--kv-budget", default="256MB", help="bytes of the paged KV cache (default: %(default)s)")
    batching.add_argument("--block-size", type=positive_int, default=16, help="positions per KV block (default: 16)")
    batching.add_argument("--max-running", type=positive_int, default=64, help="sequences decoding together (64)")
    batching.add_argument(
        "--prefill-chunk", type=positive_int, default=128, help="prompt tokens per sequence per step (default: 128)"
    )
    batching.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=1024,
        help="prompt tokens of all sequences per step, on top of one decode per running sequence (default: 1024)",
    )
    batching.add_argument("--max-queue", type=positive_int, default=256, help="choices waiting; more get 429 (256)")
    batching.add_argument("--max-body", default="1MB", help="request body size; larger get 413 (default: 1MB)")
    batching.add_argument("--max-choices", type=positive_int, default=16, help="prompts x n per request (16)")
    batching.add_argument(
        "--max-tokens", type=positive_int, help="cap on a request's max_tokens (default: the model's context)"
    )
    batching.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default: 600)")
    conns = serve.add_argument_group("connections and shutdown")
    conns.add_argument(
        "--max-connections",
        type=positive_int,
        default=512,
        help="open connections; one more closes the one waiting longest without a request, or is answered 503 "
        "(default: 512; the open-file limit is raised to hold them)",
    )
    seconds = {
        "--timeout-idle": (5.0, "a connection may wait for a request"),
        "--timeout-header": (10.0, "from a request's first byte to the end of its headers (then 408)"),
        "--timeout-body": (30.0, "from a request's headers to the end of its body (then 408)"),
        "--drain-timeout": (
            25.0,
            "SIGTERM waits for requests under way before cutting them short, inside "
            "Kubernetes' default grace period of 30 s",
        ),
    }
    for flag, (default, what) in seconds.items():
        conns.add_argument(flag, type=float, default=default, help=f"seconds {what} (default: {default:g})")
    add_run_flags(serve)


def run(args: argparse.Namespace) -> int:
    import logging

    from moekit.serve.connections import ConnectionLimits
    from moekit.serve.engine import EngineOptions
    from moekit.serve.protocol import Limits
    from moekit.serve.server import bind, build_state, on_a_passing_thread, reserve_files, serve
    from moekit.units import parse_bytes

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port}: must be in 0..65535")
    for flag in ("timeout", "timeout_idle", "timeout_header", "timeout_body", "drain_timeout"):
        if not getattr(args, flag) > 0:  # False for NaN
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be > 0")
    connections = ConnectionLimits(args.max_connections, args.timeout_idle, args.timeout_header, args.timeout_body)
    reserve_files(args.max_connections)
    logging.basicConfig(level=logging.WARNING, format="moekit serve: %(levelname)s: %(message)s")
    engine = EngineOptions(
        kv_budget=parse_bytes(args.kv_budget, "--kv-budget"),
        block_size=args.block_size,
        max_running=args.max_running,
        prefill_chunk=args.prefill_chunk,
        prefill_tokens=args.prefill_tokens,
        max_queue=args.max_queue,
    )
    limits = Limits(parse_bytes(args.max_body, "--max-body"), args.max_choices, args.max_tokens, args.timeout)
    sock = bind(args.host, args.port)
    loaded = on_a_passing_thread(lambda: load_for_inference(args))
    try:
        state = on_a_passing_thread(
            lambda: build_state(loaded, args.run_dir, engine, limits, args.model_name, args.api_key)
        )
        host, port = sock.getsockname()[:2]
        line = f"serving {args.run_dir} as {state.model_name!r} on http://{host}:{port}/v1; Ctrl-C stops"
        return serve(state, sock, connections, args.drain_timeout, ready=lambda: print(line, flush=True))
    finally:
        sock.close()
        if loaded.offloader is not None:
            loaded.offloader.close()
