"""The server over real loopback sockets with the official ``openai`` client: completions, chat,
streaming, n > 1, stop strings, logprobs, routing traces, 16 concurrent streams, latent attention
(MLA) resident and offloaded, sliding windows with sinks, and a table of bad requests. Greedy and
seeded outputs are compared with ``moekit.infer.generate.generate`` (tokens equal: fp32, no tolerance)."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import openai
import pytest
import torch
from helpers import budget_for

from moekit.infer.generate import generate
from moekit.infer.offload import OffloadOptions
from moekit.run.load import LoadedRun, load_run
from moekit.serve.engine import EngineOptions
from moekit.serve.protocol import Limits
from moekit.serve.server import bind, build_state, serve_in_thread

# Untied embeddings: the sharpened test model then writes varied text instead of repeating its input.
RUN = {"model.tie_embeddings": "false", "model.context_length": "64"}
SMALL = EngineOptions(kv_budget=1 << 20, block_size=4, max_running=8, prefill_chunk=8)  # several chunks per prompt


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, write_run) -> Path:
    return write_run(tmp_path_factory.mktemp("serve") / "run", **RUN)


@pytest.fixture(scope="module")
def run(run_dir: Path) -> LoadedRun:
    return load_run(run_dir)


class Served:
    """A server on a free loopback port in this process, and an ``openai`` client for it."""

    def __init__(self, run: LoadedRun, run_dir: Path, options: EngineOptions = SMALL, **kwargs) -> None:
        self.state = build_state(run, run_dir, options, **kwargs)
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server, self.thread = serve_in_thread(self.state, sock)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key=kwargs.get("api_key") or "none", max_retries=0, timeout=60
        )

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.state.engine.stop()
        self.state.workers.close()

    def call(self, path: str, body: object | bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def served(run: LoadedRun, run_dir: Path) -> Iterator[Served]:
    s = Served(run, run_dir, limits=Limits(max_body=4096))
    yield s
    s.close()


def finished(s: Served, reason: str) -> float:
    """Choices the server has finished for ``reason``, from its Prometheus counter."""
    return s.state.metrics.registry.get_sample_value("moekit_choices_total", {"reason": reason}) or 0.0


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def expected(run: LoadedRun, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> str:
    """The text ``generate`` continues ``prompt`` with, alone in its batch."""
    ids = torch.tensor([run.tokenizer.encode(prompt)])
    out = generate(run.model, ids, max_tokens, temperature, None, 1.0, seed)
    return run.tokenizer.decode(out[0, ids.shape[1] :].tolist())


PROMPTS = ["the king and queen of the castle walked along", "ab", "hello"]


def test_greedy_completions_equal_generate(served: Served, run: LoadedRun) -> None:
    reply = served.client.completions.create(model="run", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in reply.choices] == [expected(run, p, 12) for p in PROMPTS]
    assert [c.finish_reason for c in reply.choices] == ["length"] * 3
    prompt_tokens = sum(len(run.tokenizer.encode(p)) for p in PROMPTS)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 36)
    assert [m.id for m in served.client.models.list().data] == ["run"]


USAGE = {"include_usage": True}


def test_streaming_sends_one_chunk_per_token_and_the_same_text(served: Served, run: LoadedRun) -> None:
    """The usage comes last, in a chunk of no choices, only when asked for (as OpenAI sends it)."""
    create = partial(served.client.completions.create, model="run", prompt=PROMPTS[0], max_tokens=10, stream=True)
    chunks = list(create(seed=5, stream_options=USAGE | {"include_obfuscation": False}))  # the client's fields
    tokens = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(tokens) == 10 and chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected(run, PROMPTS[0], 10, 1.0, 5)
    plain = list(create(seed=5))
    assert all(c.choices and c.usage is None for c in plain) and len(plain) == 11
    assert "".join(c.choices[0].text for c in plain) == expected(run, PROMPTS[0], 10, 1.0, 5)


def test_n_choices_sample_with_consecutive_seeds(served: Served, run: LoadedRun) -> None:
    """The n choices share the prompt's prefill and blocks; a stream of n = 3 closed by its client after
    a few tokens cancels its choices and gives every block back."""
    engine = served.state.engine
    reply = served.client.completions.create(model="run", prompt="ab", max_tokens=8, n=3, seed=11, temperature=0.9)
    assert [c.text for c in reply.choices] == [expected(run, "ab", 8, 0.9, 11 + j) for j in range(3)]
    assert reply.usage.prompt_tokens == 2 and reply.usage.completion_tokens == 24
    assert engine.pool.free_blocks == engine.pool.num_blocks
    prompt = PROMPTS[0][:21]  # 5 blocks of 4 and a sixth with one position, shared by the choices
    stream = served.client.completions.create(model="run", prompt=prompt, max_tokens=40, n=3, seed=1, stream=True)
    seen: set[int] = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if seen == {0, 1, 2}:
            break
    cancelled = finished(served, "cancelled")
    stream.close()
    wait_until(lambda: finished(served, "cancelled") == cancelled + 3)
    wait_until(lambda: engine.in_flight == (0, 0))
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_stop_string_cuts_the_text(served: Served, run: LoadedRun) -> None:
    full = expected(run, PROMPTS[0], 15)
    stop = full[5:7]
    reply = served.client.completions.create(model="run", prompt=PROMPTS[0], max_tokens=15, temperature=0, stop=[stop])
    assert reply.choices[0].text == full[: full.index(stop)] and reply.choices[0].finish_reason == "stop"
    streamed = served.client.completions.create(
        model="run", prompt=PROMPTS[0], max_tokens=15, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.index(stop)]


def test_chat_uses_the_plain_template_without_a_tokenizer_config(served: Served, run: LoadedRun) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    reply = served.client.chat.completions.create(model="run", messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == expected(run, "system: be brief\nuser: hi\nassistant:", 6)
    stream = served.client.chat.completions.create(model="run", messages=messages, max_tokens=6, stream=True, seed=2)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == expected(
        run, "system: be brief\nuser: hi\nassistant:", 6, 1.0, 2
    )


def test_chat_renders_a_hugging_face_template(run: LoadedRun, run_dir: Path, tmp_path: Path) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    template += "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    hf_dir = shutil.copytree(run_dir, tmp_path / "hf")
    config = {"chat_template": template, "eos_token": {"content": "~"}, "bos_token": "^"}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    s = Served(run, hf_dir)
    try:
        messages = [{"role": "user", "content": "hi"}]
        reply = s.client.chat.completions.create(model="hf", messages=messages, max_tokens=6, temperature=0)
        prompt = render_jinja_template([messages], chat_template=template, add_generation_prompt=True, eos_token="~")
        assert prompt[0][0] == "<|user|>hi~<|assistant|>"
        full = expected(run, prompt[0][0], 6)
        assert reply.choices[0].message.content == full.split("~")[0]  # the eos token ends the answer
    finally:
        s.close()


def test_logprobs_and_routing(served: Served, run: LoadedRun) -> None:
    reply = served.client.completions.create(
        model="run", prompt="hello", max_tokens=5, temperature=0, logprobs=3, extra_body={"return_routing": True}
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(top) <= 3 for top in lp.top_logprobs)
    assert all(
        abs(chosen - max(top.values())) < 1e-6 for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )
    routing = reply.choices[0].model_extra["routing"]
    top_k, experts = run.config.moe.top_k, run.config.moe.num_experts
    assert len(routing) == 5 and all(len(layers) == len(run.model.moe_layers()) for layers in routing)
    assert all(len(set(e)) == top_k and all(0 <= x < experts for x in e) for layers in routing for e in layers)
    chat = served.client.chat.completions.create(
        model="run", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [2, 2, 2]


def staggered(s: Served, requests: list[dict]) -> dict[int, str]:
    """Each request (``completions.create`` arguments) streamed by a thread of its own, 10 ms after the
    one before: the texts, by request index, each checked to use its whole ``max_tokens``."""
    texts: dict[int, str] = {}

    def client(i: int) -> None:
        time.sleep(0.01 * i)
        chunks = list(s.client.completions.create(model="run", stream=True, stream_options=USAGE, **requests[i]))
        assert chunks[-1].usage.completion_tokens == requests[i]["max_tokens"]
        texts[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(texts) == list(range(len(requests)))
    return texts


def test_sixteen_staggered_streams_each_equal_their_single_request(run: LoadedRun, run_dir: Path) -> None:
    s = Served(run, run_dir, EngineOptions(kv_budget=1 << 20, block_size=4, max_running=16, prefill_chunk=8))
    prompts = [f"{i}: the king and queen walked along the river"[: 5 + 3 * i] for i in range(16)]
    try:
        requests = [dict(prompt=p, max_tokens=12, temperature=0.8, seed=100 + i) for i, p in enumerate(prompts)]
        texts = staggered(s, requests)
        assert all(texts[i] == expected(run, prompts[i], 12, 0.8, 100 + i) for i in range(16))
        assert s.state.engine.pool.free_blocks == s.state.engine.pool.num_blocks  # every block given back
    finally:
        s.close()


def assert_serves(run, run_dir: Path, requests: list[dict], want: list[str]) -> None:
    """Staggered ``requests`` to a server on ``run`` answer ``want``, and every KV block comes back."""
    s = Served(run, run_dir)
    try:
        texts = staggered(s, requests)
        assert [texts[i] for i in range(len(requests))] == want
        assert s.state.engine.pool.free_blocks == s.state.engine.pool.num_blocks
    finally:
        s.close()


MLA = {"model.attention": "mla", "model.n_heads": "2", "model.d_model": "32", "model.qk_rope_head_dim": "4"}


@pytest.mark.parametrize("q_lora_rank", ["0", "16"], ids=["no-q-lora", "q-lora"])
def test_latent_attention_serves_staggered_requests_resident_and_offloaded(
    write_run, tmp_path: Path, q_lora_rank: str
) -> None:
    """MLA through the paged latent cache: staggered greedy and seeded requests of different lengths
    (prompts of 1 to 7 blocks, several prefill chunks) equal ``generate``'s on the resident model,
    served resident and with experts offloaded under a budget of 3 expert slots; every block freed."""
    run_dir = write_run(tmp_path / "run", **RUN, **MLA, **{"model.q_lora_rank": q_lora_rank})
    resident = load_run(run_dir)
    offloaded = load_run(run_dir, offload=OffloadOptions(memory_budget=budget_for(run_dir, 3), prefetch="off"))
    words = "the king and queen of the castle walked along the river to see the ships"
    requests = [
        dict(prompt=words[: 3 + 5 * i], max_tokens=4 + 3 * i, temperature=0.0 if i % 2 else 0.9, seed=7 + i)
        for i in range(6)
    ]
    want = [expected(resident, r["prompt"], r["max_tokens"], r["temperature"], r["seed"]) for r in requests]
    for run in (resident, offloaded):
        assert_serves(run, run_dir, requests, want)
    assert offloaded.offloader.cache.counters.evictions > 0  # the experts did not all fit
    offloaded.offloader.close()


WINDOWED = {"model.sliding_window": "5", "model.full_attention_every": "2", "model.attn_sinks": "true"}


def test_sliding_windows_and_sinks_serve_staggered_requests_past_the_window(write_run, tmp_path: Path) -> None:
    """Windowed blocks (5 positions, across 4-position KV blocks) beside full ones, every head with a
    sink: staggered greedy and seeded requests, each longer than the window, equal ``generate``'s."""
    run = load_run(write_run(tmp_path / "run", **RUN, **WINDOWED))
    with torch.no_grad():
        for name, p in run.model.named_parameters():
            if name.endswith("sinks"):  # zero-initialised, they would test nothing
                p.normal_(std=1.0)
    words = "the king and queen of the castle walked along the river to see the ships"
    requests = [
        dict(prompt=words[: 2 + 5 * i], max_tokens=6 + 2 * i, temperature=0.0 if i % 2 else 0.9, seed=3 + i)
        for i in range(6)
    ]
    assert all(len(r["prompt"]) + r["max_tokens"] > run.model.cfg.sliding_window for r in requests)
    want = [expected(run, r["prompt"], r["max_tokens"], r["temperature"], r["seed"]) for r in requests]
    assert_serves(run, tmp_path / "run", requests, want)


BAD = [
    (b"{not json", 400, None),
    (b'{"prompt": "a", "temperature": NaN}', 400, None),
    ({"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "top_k": -2}, 400, "top_k"),  # -1 (as 0): every token
    ({"prompt": "a", "seed": 2**64}, 400, "seed"),
    ({"prompt": "a", "seed": -1}, 400, "seed"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ({"prompt": "a", "max_tokens": 64}, 400, "max_tokens"),  # the prompt leaves 63 positions
    ({"prompt": "x" * 64}, 400, "prompt"),
    ({"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate: no UTF-8 bytes to tokenize
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 256]}, 400, "prompt"),  # token ids: within the vocabulary of 256
    ({"prompt": [[1], "a", []]}, 400, "prompt"),
    ({"prompt": "a", "n": 17}, 400, "n"),
    ({"prompt": ["a"] * 9, "n": 2}, 400, "n"),
    ({"prompt": "a", "stop": ["a"] * 65}, 400, "stop"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "a", "max_tokens": 10**400}, 400, "max_tokens"),  # beyond any float: no OverflowError
    ({"prompt": "a", "temperature": 10**400}, 400, "temperature"),
    ({"prompt": "a", "frequency_penalty": 2.5}, 400, "frequency_penalty"),  # OpenAI's [-2, 2]
    ({"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "a", "logit_bias": {"256": 5}}, 400, "logit_bias"),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens"),
    ({"prompt": "a", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "a", "response_format": {"type": "json_object"}}, 400, "response_format"),  # would change it
    ({"prompt": "a", "best_of": 2}, 400, "best_of"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    (b'{"prompt": "' + b"a" * 5000 + b'"}', 413, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_requests_get_an_openai_error(served: Served, body: object, status: int, param: str | None) -> None:
    code, reply = served.call("/v1/completions", body, {"Content-Type": "application/json"})
    assert code == status and set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and reply["error"]["message"]
    assert served.call("/health") == (200, {"status": "ready", "running": 0, "waiting": 0})


def test_chat_errors_unknown_routes_and_the_api_key(run: LoadedRun, run_dir: Path) -> None:
    s = Served(run, run_dir, api_key="sesame", limits=Limits(max_body=4096))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0, timeout=60).models.list()
        with pytest.raises(openai.BadRequestError, match="messages"):
            s.client.chat.completions.create(model="run", messages=[{"role": "wizard", "content": "x"}])
        assert s.call("/v1/nothing")[0] == 404 and "error" in s.call("/v1/nothing")[1]
        code, reply = s.call("/v1/completions")  # GET where only POST is served: the client's mistake
        assert code == 405 and reply["error"]["type"] == "invalid_request_error"
        assert s.client.completions.create(model="run", prompt="a", max_tokens=2).usage.total_tokens == 3
        assert s.call("/health")[0] == 200  # no key needed
    finally:
        s.close()


def test_a_full_queue_answers_429(run: LoadedRun, run_dir: Path) -> None:
    s = Served(run, run_dir, EngineOptions(kv_budget=1 << 20, block_size=4, max_running=1, max_queue=1))
    try:
        first = s.client.completions.create(model="run", prompt="a", max_tokens=60, stream=True, stream_options=USAGE)
        next(iter(first))  # running
        second = s.client.completions.create(model="run", prompt="b", max_tokens=2, stream=True, stream_options=USAGE)
        with pytest.raises(openai.RateLimitError):
            s.client.completions.create(model="run", prompt="c", max_tokens=2)
        assert len(list(second)) == 4 and list(first)[-1].usage.completion_tokens == 60
    finally:
        s.close()


def test_metrics_count_tokens_latencies_and_expert_load(served: Served) -> None:
    served.client.completions.create(model="run", prompt="metrics", max_tokens=3)
    request = urllib.request.Request(served.url + "/metrics")
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    for name in ("moekit_generation_tokens_total", "moekit_time_to_first_token_seconds_bucket", "moekit_queue_length"):
        assert name in text
    assert 'moekit_expert_tokens_total{expert="0",layer="0"}' in text
    assert "moekit_inter_token_latency_seconds_count" in text
    if not Path("/proc/thread-self/schedstat").exists():  # a kernel without scheduler statistics
        return
    running = float(text.split('moekit_engine_thread_seconds_total{state="running"} ')[1].split()[0])
    assert 0 < running <= sum(served.state.engine.seconds.values()) + 0.5  # its CPU time, within its wall time
