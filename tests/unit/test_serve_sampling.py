"""moekit.serve.sampling against the options written out element by element (float64, plain loops); the
served answers are checked against a plain decoding loop in test_serve_compat.py."""

from __future__ import annotations

import math

import torch

from moekit.serve.sampling import changes_logits, process_logits
from moekit.serve.scheduler import SamplingParams


def reference(logits: list[float], p: SamplingParams, prompt: list[int], generated: list[int], ends: set[int]):
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    if len(generated) < p.min_tokens:
        for token in ends:
            out[token] = -math.inf
    for token in set(prompt) | set(generated):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(generated):
        out[token] -= p.frequency_penalty * generated.count(token) + p.presence_penalty
    if p.min_p > 0 and p.temperature > 0:
        exp = [math.exp((x - max(out)) / p.temperature) for x in out]  # probabilities after the temperature
        out = [x if e / max(exp) >= p.min_p else -math.inf for x, e in zip(out, exp, strict=True)]
    return out


def test_each_option_changes_the_logits_as_written_out() -> None:
    torch.manual_seed(0)
    logits = torch.randn(40) * 3  # positive and negative logits
    prompt, generated = [1, 2, 2, 7], [7, 9, 9, 9, 30]
    cases = [
        SamplingParams(8, repetition_penalty=1.7),
        SamplingParams(8, repetition_penalty=0.6, presence_penalty=0.5, frequency_penalty=-0.3),
        SamplingParams(8, logit_bias=((3, 5.0), (9, -2.5)), frequency_penalty=1.0),
        SamplingParams(8, min_tokens=6),
        SamplingParams(8, temperature=0.7, min_p=0.1, repetition_penalty=1.2),
    ]
    for p in cases:
        assert changes_logits(p)
        got = process_logits(logits, p, prompt, generated, frozenset({4, 30})).tolist()
        want = reference(logits.double().tolist(), p, prompt, generated, {4, 30})
        assert [math.isinf(x) for x in got] == [math.isinf(x) for x in want], p
        assert max(abs(a - b) for a, b in zip(got, want, strict=True) if not math.isinf(b)) < 1e-5, p
    assert not changes_logits(SamplingParams(8, temperature=0.7, top_k=5, stop_token_ids=frozenset({3})))
    assert not changes_logits(SamplingParams(8, temperature=0.0, min_p=0.5))  # greedy keeps the likeliest anyway
