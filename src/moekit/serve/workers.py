"""Per-request CPU work (parsing a body, tokenising its prompts, rendering a whole answer) on a few
threads instead of the event loop, where it would stall every stream and probe while it ran.

Fair between clients (by address): each client has at most ``per_client`` requests being read and
prepared at once (more wait, their bodies unread) and its work runs one job at a time, so a client that
floods the server queues behind itself while every other client's job finds a free thread after at
most the jobs already running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Client:
    """One client's requests under way (waiting ones too), its places to read them, its turn on the threads."""

    places: asyncio.Semaphore
    requests: int = 0
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)


class Workers:
    """A small thread pool shared fairly between clients (see the module docstring)."""

    def __init__(self, threads: int = 2, per_client: int = 8) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="moekit-request")
        self.per_client = per_client
        self.clients: dict[str, Client] = {}

    @contextlib.asynccontextmanager
    async def admit(self, address: str) -> AsyncIterator[Client]:
        """One of the ``per_client`` places of the client at ``address``, once one is free."""
        client = self.clients.setdefault(address, Client(asyncio.Semaphore(self.per_client)))
        client.requests += 1
        try:
            async with client.places:
                yield client
        finally:
            client.requests -= 1
            if client.requests == 0:
                del self.clients[address]

    async def run(self, client: Client | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread, after the client's earlier jobs (None: no turn to wait for)."""
        async with client.turn if client is not None else contextlib.nullcontext():
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
