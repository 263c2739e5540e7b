"""The OpenAI-compatible HTTP API on Starlette: it checks requests, queues their choices on the engine
and forwards the engine's events (whole, or streamed as server-sent events). It never runs the model,
and leaves per-request CPU work (parsing, tokenising, rendering a whole answer) to ``Workers``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
(``ready``: nothing in flight, ``busy``: requests in flight, ``draining``: shutting down, 503),
``GET /metrics`` (Prometheus). With an API key, ``/v1/*`` needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moekit.serve.chat import ChatTemplate
from moekit.serve.engine import Engine, Finish, QueueFull
from moekit.serve.errors import ApiError
from moekit.serve.metrics import Metrics
from moekit.serve.protocol import Limits, Request, parse_request, read_json
from moekit.serve.responses import ChoiceState, Shaper, sse, usage
from moekit.serve.scheduler import Seq
from moekit.serve.workers import Workers

FAILURES = {"timeout": 504, "error": 500, "cancelled": 503}
STOPPED = object()  # put in a request's queue when the server stops under it: it is answered at once
CLIENT_GONE = "499"  # the status counted for a client that hung up before its answer (nginx's)
logger = logging.getLogger("moekit.serve")


@dataclass
class ServeState:
    """What the routes share: the engine, the run's chat format, limits and the drain flag."""

    engine: Engine
    model_name: str
    template: ChatTemplate
    limits: Limits
    metrics: Metrics
    api_key: str | None = None
    draining: bool = False
    workers: Workers = field(default_factory=Workers)
    queues: set[asyncio.Queue] = field(default_factory=set)  # of the requests whose choices are queued
    warned: set[str] = field(default_factory=set)  # ignored fields already named in the log

    def stop_requests(self) -> int:
        """Answer every request whose choices are queued with an error now (on the event loop); how many."""
        for queue in self.queues:
            queue.put_nowait(STOPPED)
        return len(self.queues)


def build_app(state: ServeState) -> Starlette:
    """The ASGI app over a started (or soon started) engine."""

    async def error_response(request: HttpRequest, exc: Exception) -> Response:
        if isinstance(exc, ApiError):
            err = exc
        elif isinstance(exc, HTTPException):
            err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        else:
            err = ApiError(500, f"internal error: {type(exc).__name__}")
        state.metrics.requests.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    async def completions(request: HttpRequest) -> Response:
        return await _generate(request, chat=False)

    async def chat_completions(request: HttpRequest) -> Response:
        return await _generate(request, chat=True)

    def prepare(body: bytes, chat: bool) -> Request:
        """On a worker thread: the checked request."""
        run = state.engine.run
        context = run.model.cfg.context_length
        return parse_request(read_json(body), chat, run.tokenizer, state.template, context, state.limits)

    async def _generate(http: HttpRequest, chat: bool) -> Response:
        _authorize(http, state.api_key)
        if state.draining:
            raise ApiError(503, "the server is shutting down", code="draining")
        async with state.workers.admit(http.client.host if http.client else "") as client:
            try:
                body = await _read_body(http, state.limits.max_body)
            except ClientDisconnect:  # gone (or timed out) before its request was whole: no one to answer
                return Response(status_code=int(CLIENT_GONE))
            req = await state.workers.run(client, prepare, body, chat)
        _log_ignored(state, req.ignored)
        if req.model and req.model != state.model_name:
            raise ApiError(
                404, f"model {req.model!r} is not served here (GET /v1/models: {state.model_name!r})", "model"
            )
        if state.draining:  # its body arrived after SIGTERM
            raise ApiError(503, "the server is shutting down", code="draining")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event: Any) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone, and so is whoever asked
                loop.call_soon_threadsafe(queue.put_nowait, event)

        deadline = time.monotonic() + state.limits.timeout
        seqs = [
            Seq(prompt, req.params[j], emit, choice=p * req.n + j, deadline=deadline)
            for p, prompt in enumerate(req.prompts)
            for j in range(req.n)
        ]
        try:
            state.engine.submit(seqs)
        except QueueFull as err:
            raise ApiError(429, f"too many requests waiting ({err}): retry later", code="queue_full") from None
        except RuntimeError:
            raise ApiError(503, "the server is shutting down", code="draining") from None
        shaper = Shaper(chat, state.model_name, state.engine.run.tokenizer)
        choices = [
            ChoiceState(p.logprobs is not None, p.return_routing, req.echo and req.echo[i], prompt, req.echo_only)
            for i, prompt in enumerate(req.prompts)
            for p in req.params
        ]
        state.queues.add(queue)
        if req.stream:
            state.metrics.requests.labels("200").inc()
            stream = _stream(shaper, req, seqs, choices, queue, state)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.ensure_future(_cancel_when_gone(http, seqs))
        try:
            await _collect(choices, queue)
        finally:
            gone = watcher.done() and not watcher.cancelled()
            watcher.cancel()
            state.queues.discard(queue)
            for seq in seqs:
                seq.cancelled = True  # a no-op for finished choices; frees the rest at the next step
        if gone:  # its choices ended "cancelled" because it left: nothing failed, and no one is answered
            state.metrics.requests.labels(CLIENT_GONE).inc()
            return Response(status_code=int(CLIENT_GONE))
        failed = next((c for c in choices if c.finish in FAILURES), None)
        if failed is not None:
            raise ApiError(FAILURES[failed.finish], f"generation ended: {failed.finish}", code=failed.finish)
        state.metrics.requests.labels("200").inc()
        answer = await state.workers.run(None, _render, shaper, choices, req.n)
        return Response(answer, media_type="application/json")

    async def models(request: HttpRequest) -> Response:
        _authorize(request, state.api_key)
        cfg = state.engine.run.model.cfg
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "moekit"}
        return JSONResponse({"object": "list", "data": [{**card, "max_model_len": cfg.context_length}]})

    async def health(request: HttpRequest) -> Response:
        running, waiting = state.engine.in_flight
        status = "draining" if state.draining else "busy" if running or waiting else "ready"
        body = {"status": status, "running": running, "waiting": waiting}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    async def metrics(request: HttpRequest) -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {ApiError: error_response, HTTPException: error_response, Exception: error_response}
    return Starlette(routes=routes, exception_handlers=handlers)


def _authorize(http: HttpRequest, api_key: str | None) -> None:
    if api_key is None:
        return
    given = http.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")


def _log_ignored(state: ServeState, fields: list[str]) -> None:
    """Name each ignored field in the log, once per server (a client repeating one does not flood it)."""
    for name in fields:
        if name not in state.warned:
            state.warned.add(name)
            logger.warning("ignored request field %r: moekit does not act on it (logged once)", name)


async def _read_body(http: HttpRequest, limit: int) -> bytes:
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body of {declared} bytes: at most {limit}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body over {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _render(shaper: Shaper, choices: list[ChoiceState], n: int) -> bytes:
    """A whole answer's JSON (on a worker thread: logprobs of long answers take a while)."""
    return json.dumps(shaper.completion(choices, usage(choices, n)), separators=(",", ":")).encode()


async def _cancel_when_gone(http: HttpRequest, seqs: list[Seq]) -> None:
    """Cancel ``seqs`` when the client disconnects (the server's next message once the body is read)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    for seq in seqs:
        seq.cancelled = True


def _stopped() -> ApiError:
    return ApiError(503, "the server stopped before this request finished", code="shutdown")


async def _collect(choices: list[ChoiceState], queue: asyncio.Queue) -> None:
    """Every choice's events until all have finished (cancelled ones too)."""
    left = len(choices)
    while left:
        event = await queue.get()
        if event is STOPPED:
            raise _stopped()
        choices[event.choice].add(event)
        left -= isinstance(event, Finish)


async def _stream(
    shaper: Shaper,
    req: Request,
    seqs: list[Seq],
    choices: list[ChoiceState],
    queue: asyncio.Queue,
    state: ServeState,
) -> AsyncIterator[bytes]:
    """One chunk per event, a chunk per finished choice, the usage if asked for, ``[DONE]``. A failed
    choice, or the server stopping, sends an error event instead. A client that goes away cancels the
    generator, which cancels its choices."""
    try:
        left = len(seqs)
        while left:
            event = await queue.get()
            if event is STOPPED:
                yield sse(_stopped().body())
                break
            c = choices[event.choice]
            if isinstance(event, Finish) and event.reason in FAILURES:
                err = ApiError(FAILURES[event.reason], f"generation ended: {event.reason}", code=event.reason)
                yield sse(err.body())
                c.add(event)
                left -= 1
                continue
            first = not c.started
            yield sse(shaper.chunk(event.choice, c.add(event), c, first))
            left -= isinstance(event, Finish)
        else:
            if req.include_usage:
                yield sse(shaper.usage_chunk(usage(choices, req.n)))
        yield sse("[DONE]")
    finally:
        state.queues.discard(queue)
        for seq in seqs:
            seq.cancelled = True
