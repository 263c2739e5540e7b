"""The server as real clients and their mistakes meet it: a near-zero temperature beside other requests,
text held back when an end token arrives, OpenAI's content parts, a non-streaming client that hangs
up, the server's token limit and timeout, and a Hugging Face tokenizer that frames text with a BOS.
Outputs are compared with ``moekit.infer.generate.generate`` (tokens equal: fp32, no tolerance)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import openai
import pytest
import test_serve_app as app_tests
import torch
from test_serve_app import SMALL, Served, expected, finished, wait_until

from moekit.infer.generate import generate, sample_next
from moekit.run.load import LoadedRun
from moekit.serve.chat import ChatTemplate
from moekit.serve.protocol import Limits, parse_request
from moekit.serve.server import build_state

run_dir, run, served = app_tests.run_dir, app_tests.run, app_tests.served  # the fixtures


@contextmanager
def slow_steps(run: LoadedRun, seconds: float) -> Iterator[None]:
    """Every forward of ``run``'s model takes at least ``seconds`` (a request then outlasts a client)."""
    handle = run.model.register_forward_pre_hook(lambda *_: time.sleep(seconds))
    try:
        yield
    finally:
        handle.remove()


def test_a_near_zero_temperature_samples_greedily_beside_other_requests(served: Served, run: LoadedRun) -> None:
    """1e-300 overflows the logits it divides: sampling takes the limit (greedy) instead of failing the
    whole batch."""
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 3.0 - 1e-6, 0.0]])
    assert sample_next(logits, 1e-300, None, None, torch.Generator().manual_seed(0)).tolist() == [1, 0]
    first = served.client.completions.create(model="run", prompt="a", max_tokens=30, temperature=0, stream=True)
    chunks = iter(first)
    texts = [next(chunks).choices[0].text]  # running
    tiny = served.client.completions.create(model="run", prompt="hello", max_tokens=8, temperature=1e-300, seed=3)
    assert tiny.choices[0].text == expected(run, "hello", 8)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"  # not ended by an error in the batch
    assert "".join(texts + [c.choices[0].text for c in rest]) == expected(run, "a", 30)


def test_text_held_back_is_released_when_an_end_token_ends_the_choice(
    run: LoadedRun, run_dir: Path, tmp_path: Path
) -> None:
    """A stop string that begins like the text before the end token holds that text back; the end
    token must release it (the stop string never matched)."""
    prompt = "the king and queen"
    full = expected(run, prompt, 20)
    at = next(i for i in range(2, len(full)) if full[i].isascii() and full[i - 1].isascii() and full[i] not in full[:i])
    hf_dir = shutil.copytree(run_dir, tmp_path / "hf")
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": full[at]}))
    s = Served(run, hf_dir)
    try:
        stop = full[at - 1] + "\u00a7"  # begins with the last character before the end token
        messages = [{"role": "user", "content": prompt}]
        reply = s.client.chat.completions.create(model="hf", messages=messages, max_tokens=20, temperature=0, stop=stop)
        assert reply.choices[0].message.content == full[:at] and reply.choices[0].finish_reason == "stop"
        parts = [
            {"role": "user", "content": [{"type": "text", "text": prompt[:7]}, {"type": "text", "text": prompt[7:]}]}
        ]
        again = s.client.chat.completions.create(model="hf", messages=parts, max_tokens=20, temperature=0)
        assert again.choices[0].message.content == full[:at]  # text parts joined: the same prompt
    finally:
        s.close()


def test_streamed_offsets_and_logprobs_follow_the_text_held_back(served: Served, run: LoadedRun) -> None:
    """Text held back (a U+FFFD that may be half a character, a tail that may begin a stop string) keeps
    its tokens' logprobs with it: each token's text_offset is where its text begins in the answer, the
    same streamed as whole (a stream counted from the text sent so far), and the stop string's tokens
    have no logprobs, as its text is not returned. Reference offsets: the longest common prefix of the
    whole text and the text of the tokens before each."""
    prompt = "the king and queen"
    prompt_ids = torch.tensor([run.tokenizer.encode(prompt)])
    ids = generate(run.model, prompt_ids, 24, 0.0)[0, prompt_ids.shape[1] :].tolist()
    full = run.tokenizer.decode(ids)
    offsets = [len(os.path.commonprefix([run.tokenizer.decode(ids[:i]), full])) for i in range(len(ids))]
    assert "\ufffd" in full and len(set(offsets)) == len(offsets)  # held-back U+FFFDs, one token each
    at = next(k for k in range(8, len(full)) if full[k : k + 2].isascii() and full.index(full[k : k + 2]) == k)
    stop = full[at : at + 2]
    create = partial(served.client.completions.create, model="run", prompt=prompt, max_tokens=24, temperature=0)
    whole = create(logprobs=1, stop=[stop]).choices[0]
    assert whole.text == full[:at] and whole.logprobs.text_offset == [o for o in offsets if o < at]
    chunks = [c.choices[0] for c in create(logprobs=1, stop=[stop], stream=True) if c.choices]
    assert [o for c in chunks for o in c.logprobs.text_offset] == whole.logprobs.text_offset
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    unstopped = [c.choices[0] for c in create(logprobs=1, stream=True) if c.choices]
    assert [o for c in unstopped for o in c.logprobs.text_offset] == offsets


def test_top_logprobs_needs_logprobs(served: Served) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    code, reply = served.call("/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert code == 400 and reply["error"]["param"] == "top_logprobs"


def answered(s: Served, status: str) -> float:
    return s.state.metrics.registry.get_sample_value("moekit_requests_total", {"status": status}) or 0.0


def test_a_client_that_hangs_up_on_a_whole_answer_cancels_it(served: Served, run: LoadedRun) -> None:
    """Tokens keep arriving while the client is gone: the request is cancelled, not run to its end, and
    counted as nginx's 499 (client gone), not as a 503 of the server's."""
    engine = served.state.engine
    cancelled, unavailable, gone = finished(served, "cancelled"), answered(served, "503"), answered(served, "499")
    host, port = served.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "a", "max_tokens": 60, "temperature": 0}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with slow_steps(run, 0.02):  # 60 tokens: over a second
        client = socket.create_connection((host, int(port)))
        client.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: engine.in_flight[0] == 1)
        client.close()
        wait_until(lambda: finished(served, "cancelled") == cancelled + 1)
    wait_until(lambda: engine.in_flight == (0, 0))
    assert engine.pool.free_blocks == engine.pool.num_blocks
    wait_until(lambda: answered(served, "499") == gone + 1)
    assert answered(served, "503") == unavailable


def test_the_servers_token_limit_and_timeout(run: LoadedRun, run_dir: Path) -> None:
    s = Served(run, run_dir, limits=Limits(max_tokens=5, timeout=0.5))
    try:
        reply = s.client.completions.create(model="run", prompt="hello", temperature=0)
        assert reply.usage.completion_tokens == 5 and reply.choices[0].text == expected(run, "hello", 5)
        with pytest.raises(openai.BadRequestError, match="server's limit"):
            s.client.completions.create(model="run", prompt="hello", max_tokens=6)
        with slow_steps(run, 0.2):  # 5 tokens: a second, past the timeout
            with pytest.raises(openai.APIStatusError) as err:
                s.client.completions.create(model="run", prompt="hello")
            assert err.value.status_code == 504 and err.value.body["code"] == "timeout"
            stream = s.client.completions.create(model="run", prompt="ab", stream=True)
            with pytest.raises(openai.APIError, match="generation ended: timeout"):  # the stream's error event
                list(stream)
        engine = s.state.engine
        wait_until(lambda: engine.in_flight == (0, 0))
        assert engine.pool.free_blocks == engine.pool.num_blocks and finished(s, "timeout") == 2
    finally:
        s.close()


def bos_tokenizer():
    """A Hugging Face tokenizer whose post-processor puts ``<s>`` before every text, as Llama's, Mistral's
    and Mixtral's do: one token per character, ``<s>`` 1 and ``</s>`` 2 special."""
    from tokenizers import Tokenizer, models, processors

    from moekit.tokenizer import BPETokenizer

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz []/INST"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tk.add_special_tokens(["<s>", "</s>"])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return BPETokenizer(tk)


def test_a_bos_framing_tokenizer_gets_one_bos_and_stops_at_its_eos(run: LoadedRun, run_dir: Path, tmp_path: Path):
    tokenizer = bos_tokenizer()
    assert tokenizer.encode("</s>") == [1, 2], "the post-processor frames even the end marker"
    hf_dir = shutil.copytree(run_dir, tmp_path / "hf")
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    state = build_state(dataclasses.replace(run, tokenizer=tokenizer), hf_dir, SMALL)
    assert state.engine.stop_tokens == {2, 7}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    ids = parse_request(chat, True, tokenizer, ChatTemplate(hf_dir), 64, Limits()).prompts[0]
    assert ids == [1, *tokenizer.encode("[INST] hi [/INST]", add_special_tokens=False)]  # one BOS
    completion = parse_request({"prompt": "hi"}, False, tokenizer, ChatTemplate(hf_dir), 64, Limits()).prompts[0]
    assert completion == [1, *tokenizer.encode("hi", add_special_tokens=False)]  # a raw prompt is framed
    older = tmp_path / "older"  # the special tokens in special_tokens_map.json, as older directories keep them
    older.mkdir()
    (older / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (older / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    assert parse_request(chat, True, tokenizer, ChatTemplate(older), 64, Limits()).prompts[0] == ids
