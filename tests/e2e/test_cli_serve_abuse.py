"""``moekit serve`` against clients that misbehave, each a real client on its own loopback address: one
that floods it with bodies of many prompts beside other clients' streams, and connections that send
nothing, or their headers or body a byte at a time."""

from __future__ import annotations

import json
import resource
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import openai
import pytest
from helpers import read_all, serving

RUN = {"model.tie_embeddings": "false", "model.context_length": "256"}
FLOODER = "127.0.0.2"  # another loopback address: the server tells this client from the others by it


def post_from(address: str, url: str, body: bytes, timeout: float = 60) -> httpx2.Response:
    transport = httpx2.HTTPTransport(local_address=address)
    with httpx2.Client(transport=transport, timeout=timeout) as client:
        return client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})


@pytest.mark.slow
def test_a_flooding_client_stalls_neither_probes_nor_streams(write_run, tmp_path: Path) -> None:
    """Four connections of one client post 150,000 one-character prompts (750 KB) in a loop: each is
    refused by its count before any prompt is tokenised, and the parsing runs off the event loop, so
    /health answers at once and four streams of other clients keep their pace. The same client with 8
    requests being read (their bodies not sent) has a 9th wait, while another client is served."""
    run_dir = write_run(tmp_path / "run", **RUN)
    flood = json.dumps({"prompt": ["a"] * 150_000, "max_tokens": 1}).encode()
    with serving(run_dir) as (proc, url):
        stop = threading.Event()
        refused: list[int] = []

        def flooder() -> None:
            while not stop.is_set():
                refused.append(post_from(FLOODER, url, flood).status_code)

        gaps: list[float] = []

        def stream(i: int) -> None:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            times = []
            for _ in client.completions.create(model="run", prompt=f"{i} the king", max_tokens=60, stream=True):
                times.append(time.perf_counter())
            gaps.append(max(b - a for a, b in zip(times, times[1:], strict=False)))

        flooders = [threading.Thread(target=flooder) for _ in range(4)]
        for t in flooders:
            t.start()
        while len(refused) < 4:  # the flood is under way
            time.sleep(0.05)
        streams = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in streams:
            t.start()
        probes = []
        with httpx2.Client(timeout=60) as probe:
            for _ in range(20):
                start = time.perf_counter()
                assert probe.get(url + "/health").status_code == 200
                probes.append(time.perf_counter() - start)
                time.sleep(0.05)
        for t in streams:
            t.join()
        stop.set()
        for t in flooders:
            t.join()
        assert set(refused) == {400} and len(gaps) == 4
        # Tokenised on the event loop before its count was checked, each flood body held the loop ~0.7 s:
        # probes waited 0.5-0.8 s (median) and each stream's longest wait for a token was ~0.9 s (here
        # 0.005 s and 0.1-0.2 s).
        assert statistics.median(probes) < 0.1, probes
        assert max(gaps) < 0.5, gaps

        held = []
        for _ in range(8):  # requests whose body never comes: each holds one of the client's 8 places
            conn = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), source_address=(FLOODER, 0))
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n")
            held.append(conn)
        small = b'{"prompt": "a", "max_tokens": 1}'
        with ThreadPoolExecutor(1) as pool:
            ninth = pool.submit(post_from, FLOODER, url, small)
            time.sleep(0.5)
            assert post_from("127.0.0.1", url, small).status_code == 200  # another client: served at once
            assert not ninth.done()  # waits for a place of its own client's
            for conn in held:
                conn.close()
            assert ninth.result(timeout=30).status_code == 200


def limit_open_files(n: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def trickle(port: int, head: bytes, slow: bytes) -> tuple[bytes, float]:
    """Send ``head``, then ``slow`` a byte every 0.1 s: the server's reply, and the seconds until it closed."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(head)
    start = time.perf_counter()

    def drip() -> None:
        for byte in slow:
            try:
                conn.send(bytes([byte]))
            except OSError:
                return
            time.sleep(0.1)

    threading.Thread(target=drip, daemon=True).start()
    reply = read_all(conn)
    return reply, time.perf_counter() - start


@pytest.mark.slow
def test_connections_that_send_nothing_or_trickle_are_cut(write_run, tmp_path: Path) -> None:
    """With 128 open files (ulimit -n), 300 connections that send nothing made every later request time out
    (accept() failed: too many open files). Capped at 8, each new connection closes the one waiting
    longest without a request; 8 connections each holding a request leave a 9th a 503. A connection is
    closed after --timeout-idle without a byte, and headers or a body sent a byte at a time get 408 at
    their deadline though bytes keep coming."""
    run_dir = write_run(tmp_path / "run", **RUN)
    flags = ["--max-connections", "8", "--timeout-idle", "1", "--timeout-header", "1.5", "--timeout-body", "1.5"]
    with serving(run_dir, *flags, preexec=limit_open_files(128)) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
        assert client.completions.create(model="run", prompt="a", max_tokens=2).usage.completion_tokens == 2
        for conn in idle:
            conn.close()

        post = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 99\r\n\r\n"
        )
        holding = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        for conn in holding:
            conn.sendall(post)  # a request each, its body to come
        time.sleep(0.3)
        reply = read_all(socket.create_connection(("127.0.0.1", port)))
        assert reply.startswith(b"HTTP/1.1 503") and b'"connections_full"' in reply
        for conn in holding:
            assert read_all(conn).startswith(b"HTTP/1.1 408")  # the body never came

        slow = {
            "idle": (b"", b""),
            "head": (b"", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100),
            "body": (post, b"{" + b" " * 97 + b"}"),
        }
        with ThreadPoolExecutor(3) as pool:
            cut = dict(zip(slow, pool.map(lambda sent: trickle(port, *sent), slow.values()), strict=True))
        assert cut["idle"][0] == b"" and 0.8 < cut["idle"][1] < 3, cut["idle"]  # closed without a word
        for phase in ("head", "body"):
            reply, waited = cut[phase]
            assert reply.startswith(b"HTTP/1.1 408") and b'"timeout"' in reply and 1.3 < waited < 3.5, (phase, cut)
        assert client.completions.create(model="run", prompt="a", max_tokens=2).usage.completion_tokens == 2
