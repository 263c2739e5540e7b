"""``moekit serve`` as a user runs it: the real process draining on SIGTERM, its flags checked, and a
run ``moekit train`` made of the DeepSeek preset served with its experts offloaded."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from helpers import SERVE_ENV as ENV
from helpers import budget_for, read_all, start_serve

from moekit.infer.generate import generate
from moekit.run.load import load_run


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_sigterm_drains_the_real_server(write_run, tmp_path: Path) -> None:
    """``moekit serve`` as a subprocess: a stream is running when SIGTERM arrives; health says draining,
    a new request gets 503, the stream still completes, then the process exits 0, its engine thread
    ended cleanly. A request whose headers came before the signal and its body after is refused with
    503 (it was answered 200, then cut with neither ``[DONE]`` nor an error once the process left
    without waiting for it)."""
    run_dir = write_run(tmp_path / "run", **{"model.tie_embeddings": "false", "model.context_length": "512"})
    proc, url = start_serve(run_dir)
    try:
        body = {"prompt": "a", "max_tokens": 400, "stream": True, "stream_options": {"include_usage": True}}
        body = json.dumps(body).encode()
        late = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        late.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as stream:
            assert stream.readline().startswith(b"data: {")
            proc.send_signal(signal.SIGTERM)
            assert _call(url + "/health")[1]["status"] == "draining"
            code, reply = _call(url + "/v1/completions", {"prompt": "b", "max_tokens": 2})
            assert code == 503 and reply["error"]["code"] == "draining"
            late.sendall(body)
            answer = read_all(late)
            assert answer.startswith(b"HTTP/1.1 503") and b'"draining"' in answer, answer[:300]
            events = [line for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 400
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "flag",
    ["--kv-budget=1KB", "--kv-budget=100000GB", "--port=70000", "--timeout=0", "--timeout-body=0"]
    + ["--drain-timeout=nan"],
)
def test_serve_flags_are_checked(write_run, tmp_path: Path, flag: str, capsys) -> None:
    from moekit.cli import main
    from moekit.hostmem import available_memory

    if flag == "--kv-budget=100000GB" and available_memory() is None:
        pytest.skip("the memory available is read from Linux's /proc")
    run_dir = write_run(tmp_path / "run")
    assert main(["serve", str(run_dir), flag, "--port=0" if "port" not in flag else flag]) == 2
    err = capsys.readouterr().err
    assert flag.split("=")[0] in err
    if flag == "--kv-budget=100000GB":  # parsed, then found larger than the memory available
        assert "available" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "value"), [("moe.capacity_factor", "1.0"), ("moe.router", "expert_choice")], ids=["capacity", "choice"]
)
def test_routing_that_depends_on_the_batch_is_refused(write_run, tmp_path: Path, field: str, value: str) -> None:
    """Continuous batching would make each answer depend on the requests served beside it."""
    run_dir = write_run(tmp_path / "run", **{field: value})
    cmd = [sys.executable, "-m", "moekit", "serve", str(run_dir), "--port", "0", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)  # a server would not end
    err = done.stderr.strip()
    assert done.returncode == 2 and field in err and "beside it" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_a_trained_deepseek_run_serves_with_offloaded_experts(corpus_file: Path, tmp_path: Path) -> None:
    """``moekit train --preset deepseek-tiny`` (latent attention, group-limited routing) for a few steps,
    then ``moekit serve --memory-budget`` with room for 2 experts: the ``openai`` client's greedy
    completion equals ``generate`` on the resident run."""
    run = tmp_path / "run"
    args = ["train", "--preset", "deepseek-tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--train.steps", "3", "--train.ckpt_every", "3"]
    train = subprocess.run([sys.executable, "-m", "moekit", *args], capture_output=True, text=True, env=ENV)
    assert train.returncode == 0, train.stderr
    resident = load_run(run)
    ids = torch.tensor([resident.tokenizer.encode("the king")])
    want = resident.tokenizer.decode(generate(resident.model, ids, 8, 0.0)[0, ids.shape[1] :].tolist())
    proc, url = start_serve(run, f"--memory-budget={budget_for(run, 2)}")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="run", prompt="the king", max_tokens=8, temperature=0)
        assert reply.choices[0].text == want and reply.usage.completion_tokens == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
