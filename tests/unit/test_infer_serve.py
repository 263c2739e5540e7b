"""The HTTP server over real loopback sockets: generation matches the Python API, bad requests get 400."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from moekit.infer.generate import generate_texts
from moekit.infer.offload import OffloadOptions
from moekit.infer.serve import make_server
from moekit.run.load import load_run


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, write_run) -> Iterator[tuple[str, Path]]:
    run_dir = write_run(tmp_path_factory.mktemp("serve") / "run")
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=1 << 30))
    httpd = make_server(run, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", run_dir
    httpd.shutdown()
    httpd.server_close()
    run.offloader.close()


def call(url: str, body: object | bytes | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_health_and_generation_match_the_python_api(server: tuple[str, Path]) -> None:
    url, run_dir = server
    assert call(url + "/health") == (200, {"status": "ok"})
    request = {"prompts": ["ab", "hello"], "max_new_tokens": 6, "temperature": 0.9, "top_k": 20, "seed": 4}
    status, reply = call(url + "/generate", request)
    expected = generate_texts(load_run(run_dir), ["ab", "hello"], 6, 0.9, 20, 1.0, 4, batch_size=2)
    assert status == 200 and reply["texts"] == expected and reply["tokens_per_s"] > 0
    status, reply = call(url + "/generate", {"prompt": "x", "max_new_tokens": 3, "temperature": 0})
    assert status == 200 and len(reply["texts"]) == 1 and reply["texts"][0].startswith("x")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        ([1, 2], "JSON object"),
        ({"max_new_tokens": 3}, "exactly one of 'prompt'"),
        ({"prompt": ""}, "non-empty string"),
        ({"prompt": "a", "temperature": "hot"}, "'temperature'='hot'"),
        ({"prompt": "a", "top_p": 1.5}, "top_p=1.5"),
        ({"prompt": "a", "max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"prompt": "a", "colour": 1}, "unknown field(s): colour"),
    ],
)
def test_malformed_requests_get_400_with_one_line(server: tuple[str, Path], body: object, message: str) -> None:
    status, reply = call(server[0] + "/generate", body)
    assert status == 400 and message in reply["error"] and "\n" not in reply["error"]


def test_unknown_path_is_404(server: tuple[str, Path]) -> None:
    assert call(server[0] + "/nope")[0] == 404
