"""The server as clients written for vLLM use it, through the ``openai`` client (vLLM's fields in
``extra_body``): fields it does not act on ignored with a logged warning, or refused when ignoring them
would change the answer; token-id prompts; echo with the prompt's logprobs (checked against a plain
forward pass); ``top_k`` -1; many stop strings; ``stop_reason``; ``logprobs`` 0; an assistant message
with null content; ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, the penalties and ``logit_bias``
(greedy, against a plain decoding loop written out below, which recomputes the whole sequence every
step and shares no code with the server's sampling)."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import openai
import pytest
import test_serve_app as app_tests
import torch
from test_serve_app import Served, expected

from moekit.run.load import LoadedRun

run_dir, run, served = app_tests.run_dir, app_tests.run, app_tests.served  # the fixtures

PROMPT = "the king and queen"


def create(s: Served, **kwargs):
    return s.client.completions.create(model="run", prompt=kwargs.pop("prompt", PROMPT), **kwargs)


def test_fields_it_does_not_act_on_are_ignored_with_a_warning(served: Served, run: LoadedRun, caplog) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    extra = {"suffix": None, "best_of": 1, "store": False, "parallel_tool_calls": False, "colour": 1, "tools": tools}
    with caplog.at_level(logging.WARNING, logger="moekit.serve"):
        reply = create(served, max_tokens=6, temperature=0, extra_body=extra)
    assert reply.choices[0].text == expected(run, PROMPT, 6)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"'{name}'" in warned for name in ("store", "parallel_tool_calls", "colour", "tools")), warned
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "user", "content": "again"},
    ]
    chat = served.client.chat.completions.create(model="run", messages=messages, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content == expected(run, "user: hi\nassistant: \nuser: again\nassistant:", 4)
    for field, value in [("response_format", {"type": "json_object"}), ("tool_choice", "required")]:
        with pytest.raises(openai.BadRequestError, match=field):
            served.client.chat.completions.create(
                model="run", messages=messages, max_tokens=4, extra_body={field: value, "tools": tools}
            )


def test_token_id_prompts_top_k_minus_one_and_many_stop_strings(served: Served, run: LoadedRun) -> None:
    ids = [run.tokenizer.encode(p) for p in ("hello", PROMPT)]
    reply = create(served, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in reply.choices] == [expected(run, p, 8) for p in ("hello", PROMPT)]
    one = create(served, prompt=ids[0], max_tokens=8, temperature=0)
    assert one.choices[0].text == expected(run, "hello", 8)
    seeded = [create(served, max_tokens=8, seed=4, extra_body={"top_k": k}).choices[0].text for k in (-1, 0)]
    assert seeded[0] == seeded[1] == expected(run, PROMPT, 8, 1.0, 4)
    full = expected(run, PROMPT, 20)
    stop = [f"never{i}" for i in range(9)] + [full[7:9]]
    reply = create(served, max_tokens=20, temperature=0, stop=stop)
    cut = full.index(full[7:9])
    assert reply.choices[0].text == full[:cut] and reply.choices[0].model_extra["stop_reason"] == full[7:9]
    assert create(served, max_tokens=3, temperature=0).choices[0].model_extra["stop_reason"] is None


def prompt_logprobs(run: LoadedRun, ids: list[int]) -> list[float]:
    """Each prompt token's log-probability after the tokens before it: one plain forward pass."""
    with torch.no_grad():
        logits = run.model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def test_echo_returns_the_prompt_and_its_logprobs(served: Served, run: LoadedRun) -> None:
    """As log-likelihood harnesses ask for it: the prompt's tokens' logprobs (the first has none) within
    1e-5 of a plain forward pass, then the generated tokens'; streamed the same; ``max_tokens`` 0 gives
    the prompt alone. ``logprobs`` 0 gives each token's own logprob as its top_logprobs."""
    ids = run.tokenizer.encode(PROMPT)
    reply = create(served, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    assert choice.text == PROMPT + expected(run, PROMPT, 4)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = prompt_logprobs(run, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1 : len(ids)], reference, strict=True)) < 1e-5
    assert lp.text_offset[: len(ids)] == list(range(len(ids)))  # one character per byte of this prompt
    streamed = create(served, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.logprobs.text_offset] == lp.text_offset
    alone = create(served, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
    assert alone.choices[0].text == PROMPT and len(alone.choices[0].logprobs.tokens) == len(ids)
    assert alone.usage.completion_tokens == 0 and alone.choices[0].finish_reason == "length"
    zero = create(served, max_tokens=3, temperature=0, logprobs=0).choices[0].logprobs
    assert [list(top.values()) for top in zero.top_logprobs] == [[lp] for lp in zero.token_logprobs]


def greedy_reference(run: LoadedRun, prompt: list[int], steps: int, ends=(), **opts) -> list[int]:
    """Greedy tokens under the sampling options, as vLLM and OpenAI define them, written out: logit_bias
    added; end tokens barred until min_tokens; the repetition penalty over prompt and generated tokens
    (a positive logit divided by it, a negative one multiplied); the frequency and presence penalties
    over generated tokens. Stops at an end token (unless ignore_eos) or a stop_token_id."""
    rep, pres = opts.get("repetition_penalty", 1.0), opts.get("presence_penalty", 0.0)
    freq = opts.get("frequency_penalty", 0.0)
    bias, min_tokens = opts.get("logit_bias", {}), opts.get("min_tokens", 0)
    stop_ids = set(opts.get("stop_token_ids", ()))
    ending = stop_ids | (set() if opts.get("ignore_eos") else set(ends))
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = run.model(torch.tensor([prompt + out])).logits[0, -1].double().tolist()
        for token, b in bias.items():
            logits[int(token)] += b
        if len(out) < min_tokens:
            for token in ending:
                logits[token] = -math.inf
        for token in set(prompt) | set(out):
            logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
        for token in set(out):
            logits[token] -= freq * out.count(token) + pres
        out.append(max(range(len(logits)), key=logits.__getitem__))
        if out[-1] in ending:
            break
    return out


def test_penalties_and_logit_bias_equal_a_plain_decoding_loop(served: Served, run: LoadedRun) -> None:
    ids = run.tokenizer.encode(PROMPT)
    plain = greedy_reference(run, ids, 16)
    options = [
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "logit_bias": {str(plain[2]): -30.0, "101": 4.0}},
    ]
    for extra in options:
        want = greedy_reference(run, ids, 16, **extra)
        assert want != plain, extra  # the options change this answer
        reply = create(served, max_tokens=16, temperature=0, extra_body=extra)
        assert reply.choices[0].text == run.tokenizer.decode(want), extra


def test_end_tokens_ignore_eos_min_tokens_and_stop_token_ids(run: LoadedRun, run_dir: Path, tmp_path: Path) -> None:
    ids = run.tokenizer.encode(PROMPT)
    plain = greedy_reference(run, ids, 12)
    end = next(t for i, t in enumerate(plain) if i >= 3 and t not in plain[:i])  # first generated at 3 or later
    at = plain.index(end)
    ended_dir = shutil.copytree(run_dir, tmp_path / "ended")
    (ended_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    s = Served(run, ended_dir, model_name="run")
    try:
        reply = create(s, max_tokens=12, temperature=0)
        c = reply.choices[0]
        assert c.text == run.tokenizer.decode(plain[:at]) and c.finish_reason == "stop"
        assert c.model_extra["stop_reason"] is None  # the model's end token
        unended = create(s, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}).choices[0]
        assert unended.text == run.tokenizer.decode(plain) and unended.finish_reason == "length"
        longer = greedy_reference(run, ids, 12, ends=[end], min_tokens=at + 2)
        assert end not in longer[: at + 2]
        held = create(s, max_tokens=12, temperature=0, extra_body={"min_tokens": at + 2}).choices[0]
        want = longer[: longer.index(end)] if end in longer else longer
        assert held.text == run.tokenizer.decode(want)
        first = next(i for i, t in enumerate(plain) if i >= 1 and t not in plain[:i])
        body = {"stop_token_ids": [plain[first]], "ignore_eos": True}
        stopped = create(s, max_tokens=12, temperature=0, extra_body=body).choices[0]
        assert (
            stopped.text == run.tokenizer.decode(plain[:first]) and stopped.model_extra["stop_reason"] == plain[first]
        )
    finally:
        s.close()


def test_a_prompt_past_the_context_is_refused_and_a_huge_one_before_tokenising(served: Served, run: LoadedRun) -> None:
    """A prompt of more tokens than the context (64) holds is a 400 naming its length; one of more
    characters than 64 a context token could cover is refused by its length alone (its message counts
    characters: no tokenising, so a client's megabyte body costs the server none); the server answers on."""
    from moekit.serve.protocol import ApiError, _encode

    with pytest.raises(openai.BadRequestError, match=r"the prompt is \d+ tokens: the context holds 64"):
        create(served, prompt="the king " * 20, max_tokens=2)
    with pytest.raises(ApiError, match=r"the prompt is 513 characters: more than the context's 8 tokens hold"):
        _encode(run.tokenizer, "k" * (8 * 64 + 1), 8, False)
    assert len(_encode(run.tokenizer, "k" * 7, 8, False)) == 7  # within the bound: tokenised
    assert create(served, max_tokens=3, temperature=0).choices[0].text == expected(run, PROMPT, 3)
