"""One process serving one run: the engine thread, the ASGI app, uvicorn on the event loop with the
guarded connections of ``connections``, and the drain on SIGTERM.

SIGTERM drains: /health says draining and new requests get 503 while every request already begun
(its headers read) is answered in full, or refused with 503 if its body comes after the signal; then
the process exits 0. Requests still running ``drain_timeout`` seconds after it, or at a second
SIGTERM or Ctrl-C, are cut short: each is answered with an error at once (a 503, or an error event
then ``[DONE]`` in its stream), the engine gives up its step between two layers, and the exit status
is 1 (130 for Ctrl-C).
"""

from __future__ import annotations

import gc
import logging
import math
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import uvicorn

from moekit.errors import OptionError
from moekit.fileio import read_json_object
from moekit.hostmem import keep_freed_memory
from moekit.infer.generate import check_batch_independent
from moekit.run.load import LoadedRun
from moekit.serve.app import ServeState, build_app
from moekit.serve.chat import ChatTemplate
from moekit.serve.connections import ConnectionLimits, protocol_class
from moekit.serve.engine import Engine, EngineOptions
from moekit.serve.metrics import Metrics
from moekit.serve.protocol import Limits
from moekit.tokenizer import Tokenizer

logger = logging.getLogger("moekit.serve")
CUT_GRACE = 2.0  # seconds requests cut short have to send their error before the server closes anyway
ENGINE_JOIN = 5.0  # seconds the exit waits for an engine thread stuck in one layer
SPARE_FILES = 64  # open files beside the connections: the model's, logs, the engine's
# Connections waiting to be accepted, and as many as asyncio accepts at once, before the cap closes the
# extra ones: the open-file limit holds the cap, one such burst and the spare files.
BACKLOG = 128
T = TypeVar("T")


def on_a_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own that ends with it: its result, or its exception raised here.

    NOTE: the model loads (and the engine's KV pool is allocated) this way so that the engine thread
    is the only one with OpenMP workers. libgomp keeps a team of workers for each thread that ran a
    parallel region, until that thread ends; once it manages more threads than there are CPUs, every
    team's workers stop spinning between regions and each region pays a futex wake-up. Loaded on the
    main thread, a d1024 bf16 model's engine step took 15 ms instead of 9 on 2 cores (its small bmm
    and softmax 8-13x slower), and ``moekit serve`` ran at 0.6x ``moekit generate``'s tokens/s.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="moekit-load") as pool:  # its thread ends as it closes
        return pool.submit(fn).result()


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
    """uvicorn, with the drain and the cut of the module docstring."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServeState,
        drain_timeout: float = math.inf,
        ready: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.ready = ready  # called once the socket listens
        self.deadline: float | None = None  # when the drain gives up (set by SIGTERM)
        self.cut_at: float | None = None  # when requests under way were cut short
        self.cut = False  # some request was

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.ready is not None:
            self.ready()

    def handle_exit(self, sig: int, frame) -> None:
        # NOTE: a signal handler, run between two bytecodes of the event loop: it only sets flags.
        if sig == signal.SIGTERM and self.deadline is None:
            self.state.draining = True
            self.deadline = time.monotonic() + self.drain_timeout
            return
        self.state.draining = True
        self.deadline = -math.inf  # cut now
        if sig == signal.SIGINT:
            if self.cut_at is not None:
                self.force_exit = True  # a second Ctrl-C: out without waiting
            self._captured_signals.append(sig)  # raised again on the way out: 130

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None and not self.should_exit:
            busy = bool(self.server_state.tasks) or self.state.engine.in_flight != (0, 0)
            if not busy:
                self.should_exit = True
            elif self.cut_at is None and time.monotonic() >= self.deadline:
                self._cut_requests()
            elif self.cut_at is not None and time.monotonic() - self.cut_at > CUT_GRACE:
                self.should_exit = True
        return await super().on_tick(counter)

    def _cut_requests(self) -> None:
        self.cut_at, self.cut = time.monotonic(), True
        running, waiting = self.state.engine.in_flight
        logger.warning("stopping with %d choices running and %d waiting: each request gets an error", running, waiting)
        self.state.engine.stop(abort=True, timeout=0)  # it ends its step between two layers
        self.state.stop_requests()  # answered now, even while the engine is still in its step


def bind(host: str, port: int) -> socket.socket:
    """A bound socket (port 0: a free one): the port is taken, so a busy one fails before the model
    loads, but refuses connections until the server listens on it, once the model is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OptionError("port", f"cannot listen on {host} ({err.strerror})", port) from None
    return sock


def reserve_files(connections: int) -> None:
    """Raise the open-file limit to hold ``connections``, a burst of new ones and the process's own files,
    as far as the hard limit allows: past it accept() fails and no one can connect."""
    need = connections + BACKLOG + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(
                f"--max-connections={connections}: the open-file limit is {hard} (ulimit -Hn); "
                f"give at most {hard - BACKLOG - SPARE_FILES}"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def start_engine(engine: Engine, freeze: bool = False) -> None:
    """Start the engine thread, with freed host memory kept when it runs on CPU.

    NOTE: a thread allocates from a glibc arena of its own, which hands freed blocks back to the OS;
    every step then faults their pages in again. On the serving benchmark's model at 16 sequences that
    was ~240 faults and ~7 ms of CPU in a ~48 ms step, a cost the same step on a main thread never pays.
    With it, a served step on the test's model faults in a few pages at most (tests/unit/test_serve_server.py).

    ``freeze`` (a process that serves until it exits, ``serve``; not servers started and stopped within
    one, ``serve_in_thread``): every object alive now (the model's modules and tensors, the libraries'
    objects) is moved out of Python's cyclic collector for good, as long-running servers do (vLLM among
    them); collections of what is made later still run. A full collection walks every tracked object:
    with d1024's bf16 model loaded, 180 thousand of them, 85-91 ms each time one lands in a step (ad hoc),
    under 0.1 ms once they are frozen. The collection before the freeze costs start-up about 0.1 s.
    """
    if engine.device.type == "cpu":
        keep_freed_memory()
    if freeze:
        gc.collect()
        gc.freeze()
    engine.start()


def make_server(
    state: ServeState,
    connections: ConnectionLimits | None = None,
    drain_timeout: float = math.inf,
    ready: Callable[[], None] | None = None,
) -> DrainingServer:
    limits = connections or ConnectionLimits()
    count = lambda status: state.metrics.requests.labels(str(status)).inc()  # noqa: E731
    # NOTE: not uvicorn's limit_concurrency: it answers requests 503 while too many connections are
    # open, idle ones included, which is what an idle flood wants; the guarded protocol caps them instead.
    config = uvicorn.Config(
        build_app(state),
        http=protocol_class(limits, count),
        timeout_keep_alive=limits.idle,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        backlog=BACKLOG,
    )
    return DrainingServer(config, state, drain_timeout, ready)


def serve(
    state: ServeState,
    sock: socket.socket,
    connections: ConnectionLimits | None = None,
    drain_timeout: float = 25.0,
    ready: Callable[[], None] | None = None,
) -> int:
    """Serve until Ctrl-C or SIGTERM (on the calling thread, the main one for signals; ``ready``
    called once the socket listens): the exit status, 1 if a request was cut short or the engine failed."""
    server = make_server(state, connections, drain_timeout, ready)
    start_engine(state.engine, freeze=True)
    try:
        server.run(sockets=[sock])
    finally:
        stopped = state.engine.stop(abort=True, timeout=ENGINE_JOIN)  # idle after a drain: at once
        state.workers.close()
        if not stopped:
            logger.error("the engine thread is still in a model step after %g s: exiting without it", ENGINE_JOIN)
    return 1 if server.cut or not stopped or state.engine.failure is not None else 0


def serve_in_thread(state: ServeState, sock: socket.socket, **kwargs) -> tuple[DrainingServer, threading.Thread]:
    """The same server on a daemon thread (no signal handling), listening when this returns: set
    ``should_exit`` to stop it."""
    listening = threading.Event()
    server = make_server(state, ready=listening.set, **kwargs)
    start_engine(state.engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if not listening.wait(60):
        raise RuntimeError("the server did not start listening within 60 s")
    return server, thread
