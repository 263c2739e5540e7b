"""``moekit serve`` as a user runs it: the real process draining on SIGTERM, its flags checked, and a
model it cannot serve refused by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_sigterm_drains_the_real_server(write_run, tmp_path: Path) -> None:
    """``moekit serve`` as a subprocess: a stream is running when SIGTERM arrives; health says draining,
    a new request gets 503, the stream still completes, then the process exits 0."""
    run_dir = write_run(tmp_path / "run", **{"model.tie_embeddings": "false", "model.context_length": "512"})
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    cmd = [sys.executable, "-m", "moekit", "serve", str(run_dir), "--port", "0", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = line.split(" on ")[1].split("/v1")[0]
        body = json.dumps({"prompt": "a", "max_tokens": 400, "stream": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as stream:
            assert stream.readline().startswith(b"data: {")
            proc.send_signal(signal.SIGTERM)
            assert _call(url + "/health")[1]["status"] == "draining"
            code, reply = _call(url + "/v1/completions", {"prompt": "b", "max_tokens": 2})
            assert code == 503 and reply["error"]["code"] == "draining"
            events = [line for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 400
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("flag", ["--kv-budget=1KB", "--port=70000", "--timeout=0"])
def test_serve_flags_are_checked(write_run, tmp_path: Path, flag: str, capsys) -> None:
    from moekit.cli import main

    run_dir = write_run(tmp_path / "run")
    assert main(["serve", str(run_dir), flag, "--port=0" if "port" not in flag else flag]) == 2
    assert flag.split("=")[0] in capsys.readouterr().err


def test_serve_refuses_mla_by_name(write_run, tmp_path: Path, capsys) -> None:
    from moekit.cli import main

    mla = {"model.attention": "mla", "model.n_heads": "2", "model.d_model": "32"}
    run_dir = write_run(tmp_path / "run", **mla)
    assert main(["serve", str(run_dir), "--port=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.attention='mla'" in err
