"""``moekit serve`` stopping and starting: requests cut short at a bound (the drain timeout, a second
SIGTERM) are each answered with an error and the exit status says so, a long model step is given up
between two layers, probes before the model has loaded are refused at once, and the API key is taken
from the environment."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest
from helpers import SERVE_ENV, start_serve

# Long prompts through 8 layers: a prefill step of several seconds on a CPU, each layer a fraction of it.
SLOW = {"model.tie_embeddings": "false", "model.context_length": "2048", "model.d_model": "128"}
SLOW |= {"model.n_layers": "8", "model.d_ff": "512", "model.n_heads": "4"}


def post(url: str, body: dict, out: list, headers: dict | None = None) -> None:
    """POST ``body``; appends (status, content type, the lines or the JSON of the answer)."""
    with httpx2.Client(timeout=120) as client:
        reply = client.post(url + "/v1/completions", json=body, headers=headers or {})
    kind = reply.headers.get("content-type", "")
    out.append((reply.status_code, kind, reply.text.splitlines() if "event-stream" in kind else reply.json()))


def in_threads(url: str, bodies: list[dict]) -> tuple[list[threading.Thread], list]:
    out: list = []
    threads = [threading.Thread(target=post, args=(url, body, out)) for body in bodies]
    for t in threads:
        t.start()
    return threads, out


def assert_cut_short(out: list) -> None:
    """Each answer an error: a 503 of code "shutdown", or a stream whose last event is one, then [DONE]."""
    for status, kind, answer in out:
        if "event-stream" in kind:
            events = [line for line in answer if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "shutdown", events
        else:
            assert status == 503 and "json" in kind and answer["error"]["code"] == "shutdown", (status, answer)


def accepts(url: str) -> bool:
    try:
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_a_long_model_step_is_given_up_between_layers_at_the_drain_timeout(write_run, tmp_path: Path) -> None:
    """Eight 1,700-token prompts prefill in one step of a second or more. SIGTERM early in it, with
    --drain-timeout 0.3: the requests are cut short within a fraction of that step (the engine gives it
    up between two layers), each answered with an error, and the exit status is 1. (The drain waited
    for the step and every token after it, and exited 0.)"""
    run_dir = write_run(tmp_path / "run", **SLOW)
    # NOTE: eight prompts, not four: a step's length is the margin the assertion below has over the
    # drain timeout and the layer under way (four prefilled in 0.77 s once attention got faster).
    flags = ["--prefill-tokens", "16000", "--prefill-chunk", "2000", "--kv-budget", "160MB", "--drain-timeout", "0.3"]
    proc, url = start_serve(run_dir, *flags)
    try:
        prompts = [f"{i} the king and queen " * 85 for i in range(8)]
        start = time.perf_counter()
        warm: list = []
        post(url, {"prompt": prompts, "max_tokens": 1}, warm)
        step = time.perf_counter() - start  # one prefill step of the eight, and one token each
        assert warm[0][0] == 200, warm
        bodies = [{"prompt": p, "max_tokens": 200, "stream": i % 2 == 0} for i, p in enumerate(prompts)]
        threads, out = in_threads(url, bodies)
        with httpx2.Client(timeout=30) as probe:
            while probe.get(url + "/health").json()["running"] < len(prompts):  # admitted: their step is under way
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        while accepts(url):  # until the server closes its socket: every request is over, the engine idle
            time.sleep(0.02)
        took = time.perf_counter() - signalled
        assert proc.wait(timeout=60) == 1
        for t in threads:
            t.join()
        assert len(out) == len(prompts)
        assert_cut_short(out)
        assert took < 0.6 * step, (took, step)  # the step was not run to its end
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_probes_while_loading_the_key_from_the_environment_and_a_second_sigterm(write_run, tmp_path: Path) -> None:
    """Before the model has loaded, connections are refused at once (they waited for the load). The API
    key comes from $MOEKIT_API_KEY, named in --help. A second SIGTERM stops at once: a stream gets an
    error event and [DONE], a whole answer a JSON 503 (it got a plain-text 500), and the exit status
    is 1 (the process was killed by the signal)."""
    run_dir = write_run(tmp_path / "run", **SLOW)  # a load long enough to probe
    helped = subprocess.run([sys.executable, "-m", "moekit", "serve", "--help"], capture_output=True, text=True)
    assert "MOEKIT_API_KEY" in helped.stdout
    port = free_port()
    env = {**SERVE_ENV, "MOEKIT_API_KEY": "sesame"}
    started, waits = threading.Event(), []

    def probe() -> None:
        while not started.is_set():
            begin = time.perf_counter()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
                    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    conn.recv(1024)
            except OSError:
                pass
            waits.append(time.perf_counter() - begin)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        proc, url = start_serve(run_dir, f"--port={port}", "--kv-budget=1GB", env=env)  # filling it takes a while
    finally:
        started.set()
        prober.join()
    try:
        # Each refused, or answered, at once; a port bound (and listening) before the load held the first
        # probe until the model was loaded and its KV cache filled, 0.7-1.1 s for this one.
        assert len(waits) > 10 and max(waits) < 0.3, waits
        key = {"Authorization": "Bearer sesame"}
        assert httpx2.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 401
        assert (
            httpx2.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=key).status_code == 200
        )
        out: list = []
        bodies = [{"prompt": "a", "max_tokens": 400, "stream": stream} for stream in (True, False)]
        threads = [threading.Thread(target=post, args=(url, body, out, key)) for body in bodies]
        for t in threads:
            t.start()
        with httpx2.Client(timeout=30) as client:
            while client.get(url + "/health").json()["running"] < 2:
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 1
        for t in threads:
            t.join()
        assert len(out) == 2
        assert_cut_short(out)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
