"""A small HTTP server over one loaded run (stdlib only): ``POST /generate`` and ``GET /health``.

Requests are JSON: ``{"prompt": "..."}`` or ``{"prompts": [...]}`` plus optional ``max_new_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``. A reply is ``{"texts": [...], "tokens_per_s": x}``;
a malformed request gets 400 with ``{"error": "one line"}`` naming the field. Connections are
served on threads; generation itself runs one request at a time (one model, one expert cache), with
a request's prompts batched together.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from moekit.infer.generate import check_sampling, generate_texts
from moekit.run.load import LoadedRun

MAX_BODY = 1 << 20
DEFAULTS: dict[str, Any] = {"max_new_tokens": 64, "temperature": 0.8, "top_k": 50, "top_p": 1.0, "seed": None}
TYPES: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,),
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int, type(None)),
}


class BadRequest(ValueError):
    """A request the server refuses with 400; the message names the field."""


def parse_request(body: bytes) -> tuple[list[str], dict[str, Any]]:
    """Prompts and sampling options of a /generate body."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"body is not JSON: {err}") from None
    if not isinstance(request, dict):
        raise BadRequest("body must be a JSON object")
    unknown = set(request) - {"prompt", "prompts", *DEFAULTS}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    if ("prompt" in request) == ("prompts" in request):
        raise BadRequest("give exactly one of 'prompt' (a string) or 'prompts' (a list of strings)")
    prompts = [request["prompt"]] if "prompt" in request else request["prompts"]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise BadRequest("'prompt' must be a non-empty string, 'prompts' a non-empty list of them")
    options = {**DEFAULTS}
    for name, allowed in TYPES.items():
        if name in request:
            value = request[name]
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise BadRequest(f"'{name}'={value!r}: must be {' or '.join(t.__name__ for t in allowed)}")
            options[name] = value
    try:
        check_sampling(options["max_new_tokens"], options["temperature"], options["top_k"], options["top_p"])
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return prompts, options


def make_server(run: LoadedRun, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A server bound to (host, port); call ``serve_forever()`` (port 0 picks a free one)."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": f"no such path {self.path!r}: use GET /health or POST /generate"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/generate":
                self._reply(404, {"error": f"no such path {self.path!r}: use POST /generate"})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY:
                self._reply(400, {"error": f"Content-Length must be 1..{MAX_BODY} bytes"})
                return
            try:
                prompts, o = parse_request(self.rfile.read(length))
            except BadRequest as err:
                self._reply(400, {"error": str(err)})
                return
            with lock:
                start = time.perf_counter()
                texts = generate_texts(
                    run,
                    prompts,
                    o["max_new_tokens"],
                    o["temperature"],
                    o["top_k"] or None,
                    o["top_p"],
                    o["seed"],
                    batch_size=len(prompts),
                )
                seconds = time.perf_counter() - start
            self._reply(200, {"texts": texts, "tokens_per_s": len(prompts) * o["max_new_tokens"] / max(seconds, 1e-9)})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
            pass  # one line per request on stderr would drown the startup line

    return ThreadingHTTPServer((host, port), Handler)
