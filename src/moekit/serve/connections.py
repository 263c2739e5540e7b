"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on each phase of a request and a cap on open
connections. uvicorn closes an idle connection only once a response has ended on it, and forgets
that timer at the next byte: a client that connects and sends nothing, sends its headers a byte at a
time or never finishes its body holds a connection (a file descriptor) for ever, and enough of them
stop the server from accepting anyone.

Each phase has one deadline, counted from its start (bytes trickling in do not extend it):
- idle, from the connection or the end of the last response to the first byte of a request: closed;
- head, from that byte to the end of the headers: answered 408 and closed;
- body, from the headers to the end of the body: answered 408 and closed;
after which the request is the app's (its ``--timeout``) until its response ends.
A connection past ``max_connections`` closes the one that has waited longest without a whole request
head (idle or head), or, when every other connection holds a request, is answered 503 and closed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from moekit.serve.errors import ApiError

WAITING = ("idle", "head")  # phases of a connection that holds no request yet


@dataclass(frozen=True)
class ConnectionLimits:
    """The deadlines of each phase (seconds) and the cap on open connections; each a flag of ``moekit serve``."""

    max_connections: int = 512
    idle: float = 5.0
    header: float = 10.0
    body: float = 30.0


class GuardedH11Protocol(H11Protocol):
    """One connection: uvicorn's, and its phase with the phase's deadline (see the module docstring)."""

    limits: ConnectionLimits = ConnectionLimits()
    count: Callable[[int], None] = staticmethod(lambda status: None)  # each status answered here

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.phase, self.since, self.timer = "idle", 0.0, None
        super().connection_made(transport)
        self._enter("idle")
        if len(self.connections) > self.limits.max_connections:
            waiting = [c for c in self.connections if c is not self and getattr(c, "phase", None) in WAITING]
            if waiting:
                min(waiting, key=lambda c: c.since)._close()
            else:
                self._answer(ApiError(503, "too many connections: retry later", code="connections_full"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter("closed")
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase == "idle":
            self._enter("head")
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._follow()

    def _follow(self) -> None:
        """The phase h11 says the request is in (a new deadline only when it changes)."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            phase = "body"
        elif state is h11.IDLE:
            phase = "idle" if self.phase in ("app", "body") else self.phase  # a response ended: a new wait
        else:
            phase = "app"
        if phase != self.phase:
            self._enter(phase)

    def _enter(self, phase: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.phase, self.since = phase, self.loop.time()
        deadline = {"idle": self.limits.idle, "head": self.limits.header, "body": self.limits.body}.get(phase)
        if deadline is not None:
            self.timer = self.loop.call_later(deadline, self._expire, phase)

    def _expire(self, phase: str) -> None:
        if self.transport.is_closing():
            return
        if phase == "idle":
            self._close()
            return
        cycle = self.cycle if phase == "body" else None
        if cycle is not None and cycle.response_started:  # the app answered without reading the body
            self._close()
            return
        what = "headers" if phase == "head" else "body"
        seconds = self.limits.header if phase == "head" else self.limits.body
        self._answer(ApiError(408, f"request {what} not received within {seconds:g} s", code="timeout"))
        if cycle is not None:  # the app waits for the body: it reads a disconnect, and answers no one
            cycle.disconnected = True
            cycle.message_event.set()

    def _answer(self, err: ApiError) -> None:
        """Answer ``err`` ahead of (or instead of) the app, and close."""
        body = json.dumps(err.body()).encode()
        head = f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
        self.transport.write(f"{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        self.count(err.status)
        self._close()

    def _close(self) -> None:
        self._enter("closed")
        self.transport.close()


def protocol_class(limits: ConnectionLimits, count: Callable[[int], None]) -> type[GuardedH11Protocol]:
    """The protocol uvicorn builds each connection with (``http=``), bound to ``limits``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "count": staticmethod(count)})
