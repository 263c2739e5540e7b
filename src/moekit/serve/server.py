"""One process serving one run: the engine thread, the ASGI app, uvicorn on the event loop, and the
drain on SIGTERM (running requests finish, new ones get 503, then the process exits).
"""

from __future__ import annotations

import signal
import socket
import threading
from pathlib import Path

import uvicorn

from moekit.fileio import read_json_object
from moekit.hostmem import keep_freed_memory
from moekit.infer.generate import check_batch_independent
from moekit.run.load import LoadedRun
from moekit.serve.app import ServeState, build_app
from moekit.serve.chat import ChatTemplate
from moekit.serve.engine import Engine, EngineOptions
from moekit.serve.metrics import Metrics
from moekit.serve.protocol import Limits
from moekit.tokenizer import Tokenizer


def build_state(
    run: LoadedRun,
    run_dir: Path,
    engine_options: EngineOptions | None = None,
    limits: Limits | None = None,
    model_name: str | None = None,
    api_key: str | None = None,
) -> ServeState:
    """Engine (not started), chat format, metrics and limits of one served run."""
    # The engine packs every running request into one batch.
    check_batch_independent(run.config.moe, "the requests served beside it; serve a dropless run")
    template = ChatTemplate(run_dir)
    metrics = Metrics()
    engine = Engine(run, engine_options or EngineOptions(), metrics, end_tokens(run_dir, run.tokenizer, template))
    metrics.watch(engine)
    name = model_name or Path(run_dir).resolve().name
    return ServeState(engine, name, template, limits or Limits(), metrics, api_key)


def end_tokens(run_dir: Path, tokenizer: Tokenizer, template: ChatTemplate) -> frozenset[int]:
    """The ids that end a choice: ``generation_config.json``'s ``eos_token_id`` (one or a list, as a
    Hugging Face model gives them) and the chat format's end marker when it is one token."""
    ends: set[int] = set()
    if template.eos_token is not None:
        ids = tokenizer.encode(template.eos_token, add_special_tokens=False)
        ends.update(ids if len(ids) == 1 else ())  # an end marker of several tokens is no single token
    given = read_json_object(Path(run_dir) / "generation_config.json").get("eos_token_id")
    given = [given] if isinstance(given, int) else given if isinstance(given, list) else []
    ends.update(i for i in given if isinstance(i, int) and 0 <= i < tokenizer.vocab_size)
    return frozenset(ends)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains: /health says draining and new requests get 503 until the
    engine has nothing in flight; then it exits as on Ctrl-C. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining and self.state.engine.in_flight == (0, 0):
            self.should_exit = True
        return await super().on_tick(counter)


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: a free one), so the caller knows the port before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"port={port}: cannot listen on {host} ({err.strerror})") from None
    sock.listen(2048)
    return sock


def start_engine(engine: Engine) -> None:
    """Start the engine thread, with freed host memory kept when it runs on CPU.

    NOTE: a thread allocates from a glibc arena of its own, which hands freed blocks back to the OS;
    every step then faults their pages in again. On the serving benchmark's model at 16 sequences that
    was ~240 faults and ~7 ms of CPU in a ~48 ms step, a cost the same step on a main thread never pays.
    """
    if engine.device.type == "cpu":
        keep_freed_memory()
    engine.start()


def make_server(state: ServeState) -> DrainingServer:
    config = uvicorn.Config(build_app(state), log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    return DrainingServer(config, state)


def serve(state: ServeState, sock: socket.socket) -> None:
    """Serve until Ctrl-C or a drained SIGTERM (on the calling thread, the main one for signals)."""
    server = make_server(state)
    start_engine(state.engine)
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.stop()


def serve_in_thread(state: ServeState, sock: socket.socket) -> tuple[DrainingServer, threading.Thread]:
    """The same server on a daemon thread (no signal handling): set ``should_exit`` to stop it."""
    server = make_server(state)
    start_engine(state.engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread
