"""The served side of the serving benchmarks: ``moekit serve`` as a subprocess, streaming clients on
threads, their latencies, and the server's counters (``/metrics``, Linux's /proc)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def add_prompt_chars(parser: argparse.ArgumentParser) -> None:
    """``--prompt-chars LO HI``: how long the corpus's prompts are (``check_prompt_chars`` after parsing)."""
    text = "each prompt's characters, drawn between LO and HI (default: 32 96)"
    parser.add_argument("--prompt-chars", type=int, nargs=2, default=[32, 96], metavar=("LO", "HI"), help=text)


def check_prompt_chars(parser: argparse.ArgumentParser, lo_hi: list[int]) -> None:
    """A one-line error unless 1 <= LO <= HI."""
    if not 1 <= lo_hi[0] <= lo_hi[1]:
        parser.error(f"--prompt-chars {lo_hi[0]} {lo_hi[1]}: give 1 <= LO <= HI")


class Server:
    """``moekit serve`` as a subprocess on a free port; SIGTERM drains it. ``fields``: what every request
    body carries besides the prompt and sampling (another server may need its model's name)."""

    fields: dict = {}

    def __init__(self, run_dir: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "moekit", "serve", str(run_dir), "--port", "0", "--device", "cpu", *flags]
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if " on http://" not in line:
            raise RuntimeError(f"moekit serve did not start: {line!r}")
        self.host, port = line.split(" on http://")[1].split("/")[0].rsplit(":", 1)
        self.port = int(port)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def stream(
    server: Server, prompt: str, max_tokens: int, seed: int, out: list, start: float = 0.0, first: list | None = None
) -> None:
    """One streaming completion (greedy); appends (sent, [token arrival times], completion tokens) to
    ``out``, and its first token's time to ``first``."""
    if start:
        time.sleep(max(0.0, start - time.perf_counter()))
    conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": seed, "stream": True}
    body["stream_options"] = {"include_usage": True}
    body |= server.fields
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200, reply.read()
    times, usage = [], 0
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
            times.append(time.perf_counter())
            if first is not None and len(times) == 1:
                first.append(times[0])
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
    conn.close()
    out.append((sent, times, usage))


def clients(server: Server, prompts: list[str], max_tokens: int, starts: list[float]) -> tuple[list, float]:
    """Streams started at ``starts`` (perf_counter times); their records and the wall time."""
    records: list = []
    threads = [
        threading.Thread(target=stream, args=(server, p, max_tokens, i, records, s))
        for i, (p, s) in enumerate(zip(prompts, starts, strict=True))
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(records) == len(prompts) and all(r[2] == max_tokens for r in records), "a request was lost"
    return records, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def latency(records: list) -> dict[str, float]:
    ttft = [times[0] - sent for sent, times, _ in records]
    itl = [b - a for _, times, _ in records for a, b in zip(times, times[1:], strict=False)]
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
    }


def served_rows(server: Server, prompts: list[str], counts: list[int], max_tokens: int) -> dict[int, dict[str, float]]:
    """Each count of concurrent greedy clients once to warm up (8 tokens: vLLM compiles per shape), then
    timed: per count, output tokens/s and the latencies (``latency``)."""
    for n in counts:
        clients(server, prompts[:n], 8, [0.0] * n)
    rows = {}
    for n in counts:
        records, wall = clients(server, prompts[:n], max_tokens, [0.0] * n)
        rows[n] = {"tok_s": sum(rec[2] for rec in records) / wall, **latency(records)}
    return rows


THREAD_STATES = {"running": "on cpu", "waiting": "waiting for cpu"}


def engine_seconds(server: Server) -> dict[str, float]:
    """The server's engine thread seconds by phase and by CPU state (where the kernel counts it), its
    steps so far (``/metrics``), and the CPU seconds every process of the machine used so far."""
    text = urllib.request.urlopen(f"http://{server.host}:{server.port}/metrics", timeout=60).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith('moekit_engine_seconds_total{phase="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith('moekit_engine_thread_seconds_total{state="'):
            out[THREAD_STATES[line.split('"')[1]]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("moekit_steps_total "):
            out["steps"] = float(line.split()[1])
    return {**out, **cpu_seconds(server.proc.pid)}


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of the whole machine, of the server (``pid``) and of this process (the clients),
    from Linux's /proc; nothing elsewhere."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        with open(f"/proc/{pid}/stat") as f:
            server = f.read().rsplit(")", 1)[1].split()[11:13]  # utime, stime
    except OSError:
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    machine = (sum(ticks) - ticks[3] - ticks[4]) / hz  # all but idle and iowait
    return {"machine cpu": machine, "server cpu": sum(map(int, server)) / hz, "client cpu": sum(os.times()[:2])}
