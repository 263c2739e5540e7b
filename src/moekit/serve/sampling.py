"""Each choice's next token: its logits processed as its options say, its token drawn, its logprobs.

A choice's logits before it samples, as vLLM and OpenAI define each option, in vLLM's order:
``logit_bias`` added; the choice's end tokens masked until ``min_tokens`` tokens are out; the
repetition penalty (CTRL's, over prompt and generated tokens: a positive logit divided by it, a
negative one multiplied); the frequency and presence penalties (OpenAI's, over generated tokens only:
minus ``frequency x count`` and ``presence x (count > 0)``); then ``min_p`` (tokens whose probability
after the temperature is below ``min_p`` x the likeliest's are dropped). Reported log-probabilities
stay the model's own, taken before any of this (vLLM's default).

Legend: R sequences that sample this step, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.infer.generate import greedy, sample_next
from moekit.serve.scheduler import SamplingParams, Seq


def changes_logits(p: SamplingParams) -> bool:
    """Whether ``p`` asks for anything here (a choice that asks for none samples from the model's logits as
    they are, exactly as ``generate`` would)."""
    penalties = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    return penalties or bool(p.logit_bias) or p.min_tokens > 0 or (p.min_p > 0.0 and p.temperature > 0)


def process_logits(
    logits_V: Tensor, p: SamplingParams, prompt: list[int], generated: list[int], ends: frozenset[int]
) -> Tensor:
    """``logits_V`` of one choice as it samples its next token after ``generated``, in float32 (a copy)."""
    logits = logits_V.float().clone()
    V = logits.shape[-1]
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias, strict=True)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if len(generated) < p.min_tokens and ends:
        logits[sorted(ends)] = -math.inf
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=V).to(logits.device)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(prompt, dtype=torch.long, device=logits.device)] = True
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if p.frequency_penalty or p.presence_penalty:
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.min_p > 0.0 and p.temperature > 0:
        # NOTE: probability_i >= min_p x the largest, after the temperature, is logit_i >= largest + T ln(min_p).
        floor = logits.max() + p.temperature * math.log(p.min_p)
        logits = logits.masked_fill(logits < floor, -math.inf)
    return logits


@dataclass(frozen=True)
class TopLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the N likeliest (token, logprob), likeliest first


def sample_rows(seqs: list[Seq], logits_RV: Tensor, ends: list[frozenset[int]]) -> Tensor:
    """One token per sequence [R]: greedy rows in one pick (``greedy``), sampled rows each with its own generator,
    consumed exactly as ``generate`` consumes it for a batch of one. A row whose options change its
    logits (``process_logits``; ``ends[r]``: its end tokens) draws from them instead."""
    tokens = greedy(logits_RV)
    for r, seq in enumerate(seqs):
        p = seq.params
        row = logits_RV[r : r + 1]
        if changes_logits(p):
            row = process_logits(row[0], p, seq.prompt, seq.tokens[len(seq.prompt) :], ends[r])[None]
            tokens[r] = greedy(row)[0]
        if p.temperature > 0:
            tokens[r] = sample_next(row, p.temperature, p.top_k or None, p.top_p, seq.generator)[0]
    return tokens


def top_logprobs(logits_RV: Tensor, tokens_R: Tensor, counts: list[int]) -> list[TopLogprobs]:
    """Each row's chosen token's log-probability under the model and its ``counts[r]`` likeliest tokens."""
    if not counts:
        return []
    logp_RV = torch.log_softmax(logits_RV.float(), dim=-1)
    chosen = logp_RV.gather(1, tokens_R.view(-1, 1)).squeeze(1).tolist()
    values, ids = logp_RV.topk(max(max(counts), 1), dim=-1)
    return [
        TopLogprobs(t, lp, list(zip(ids[r, :n].tolist(), values[r, :n].tolist(), strict=True)))
        for r, (t, lp, n) in enumerate(zip(tokens_R.tolist(), chosen, counts, strict=True))
    ]
