"""The OpenAI-compatible HTTP API on Starlette: it checks requests, queues their choices on the engine
and forwards the engine's events (whole, or streamed as server-sent events). It never runs the model.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
(``ready``: nothing in flight, ``busy``: requests in flight, ``draining``: shutting down, 503),
``GET /metrics`` (Prometheus). With an API key, ``/v1/*`` needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moekit.serve.chat import ChatTemplate
from moekit.serve.engine import Engine, Finish, QueueFull
from moekit.serve.metrics import Metrics
from moekit.serve.protocol import ApiError, Limits, Request, parse_request, read_json
from moekit.serve.responses import ChoiceState, Shaper, sse, usage
from moekit.serve.scheduler import Seq

FAILURES = {"timeout": 504, "error": 500, "cancelled": 503}


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

    async def _generate(http: HttpRequest, chat: bool) -> Response:
        _authorize(http, state.api_key)
        if state.draining:
            raise ApiError(503, "the server is shutting down", code="draining")
        body = read_json(await _read_body(http, state.limits.max_body))
        engine = state.engine
        context = engine.run.model.cfg.context_length
        req = parse_request(body, chat, engine.run.tokenizer, state.template, context, state.limits)
        if req.model and req.model != state.model_name:
            raise ApiError(
                404, f"model {req.model!r} is not served here (GET /v1/models: {state.model_name!r})", "model"
            )
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        emit = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)  # noqa: E731
        deadline = time.monotonic() + state.limits.timeout
        seqs = [
            Seq(prompt, req.params[j], emit, choice=p * req.n + j, deadline=deadline)
            for p, prompt in enumerate(req.prompts)
            for j in range(req.n)
        ]
        try:
            engine.submit(seqs)
        except QueueFull as err:
            raise ApiError(429, f"too many requests waiting ({err}): retry later", code="queue_full") from None
        except RuntimeError:
            raise ApiError(503, "the server is shutting down", code="draining") from None
        shaper = Shaper(chat, state.model_name, engine.run.tokenizer)
        choices = [ChoiceState(p.logprobs is not None, p.return_routing) for _ in req.prompts for p in req.params]
        if req.stream:
            state.metrics.requests.labels("200").inc()
            stream = _stream(shaper, req, seqs, choices, queue)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.ensure_future(_cancel_when_gone(http, seqs))
        try:
            await _collect(choices, queue)
        finally:
            watcher.cancel()
            for seq in seqs:
                seq.cancelled = True  # a no-op for finished choices; frees the rest at the next step
        failed = next((c for c in choices if c.finish in FAILURES), None)
        if failed is not None:
            raise ApiError(FAILURES[failed.finish], f"generation ended: {failed.finish}", code=failed.finish)
        state.metrics.requests.labels("200").inc()
        return JSONResponse(shaper.completion(choices, usage(choices, req.n)))

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


async def _cancel_when_gone(http: HttpRequest, seqs: list[Seq]) -> None:
    """Cancel ``seqs`` when the client disconnects (the server's next message once the body is read)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    for seq in seqs:
        seq.cancelled = True


async def _collect(choices: list[ChoiceState], queue: asyncio.Queue) -> None:
    """Every choice's events until all have finished (cancelled ones too)."""
    left = len(choices)
    while left:
        event = await queue.get()
        choices[event.choice].add(event)
        left -= isinstance(event, Finish)


async def _stream(
    shaper: Shaper, req: Request, seqs: list[Seq], choices: list[ChoiceState], queue: asyncio.Queue
) -> AsyncIterator[bytes]:
    """One chunk per token, a chunk per finished choice, the usage if asked for, ``[DONE]``. A client
    that goes away cancels the generator, which cancels its choices."""
    sent = [0] * len(seqs)
    try:
        left = len(seqs)
        while left:
            event = await queue.get()
            c = choices[event.choice]
            if isinstance(event, Finish) and event.reason in FAILURES:
                err = ApiError(FAILURES[event.reason], f"generation ended: {event.reason}", code=event.reason)
                yield sse(err.body())
                c.add(event)
                left -= 1
                continue
            yield sse(shaper.chunk(event, sent[event.choice], first=not c.text))
            c.add(event)
            sent[event.choice] += len(event.text)
            left -= isinstance(event, Finish)
        if req.include_usage:
            yield sse(shaper.usage_chunk(usage(choices, req.n)))
        yield sse("[DONE]")
    finally:
        for seq in seqs:
            seq.cancelled = True
