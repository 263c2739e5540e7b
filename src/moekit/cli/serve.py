"""``moekit serve``: a trained run over HTTP."""

from __future__ import annotations

import argparse

from moekit.cli.common import add_run_flags, load_for_inference


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a trained run over HTTP",
        description="Serve a trained run over HTTP: POST /generate (JSON), GET /health.",
    )
    serve.set_defaults(run=run)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 = any free)")
    add_run_flags(serve)


def run(args: argparse.Namespace) -> int:
    from moekit.infer.serve import make_server

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port}: must be in 0..65535")
    loaded = load_for_inference(args)
    try:
        server = make_server(loaded, args.host, args.port)
    except OSError as err:
        raise ValueError(f"--port={args.port}: cannot listen on {args.host} ({err.strerror})") from None
    host, port = server.server_address[:2]
    print(f"serving {args.run_dir} on http://{host}:{port} (POST /generate, GET /health); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        if loaded.offloader is not None:
            loaded.offloader.close()
    return 0
