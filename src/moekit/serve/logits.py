"""One choice's logits before it samples, as vLLM and OpenAI define each option, in vLLM's order:
``logit_bias`` added; the choice's end tokens masked until ``min_tokens`` tokens are out; the
repetition penalty (CTRL's, over prompt and generated tokens: a positive logit divided by it, a
negative one multiplied); the frequency and presence penalties (OpenAI's, over generated tokens only:
minus ``frequency x count`` and ``presence x (count > 0)``); then ``min_p`` (tokens whose probability
after the temperature is below ``min_p`` x the likeliest's are dropped). Reported log-probabilities
stay the model's own, taken before any of this (vLLM's default).

Legend: V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moekit.serve.scheduler import SamplingParams


def changes_logits(p: SamplingParams) -> bool:
    """Whether ``p`` asks for anything here (a choice that does not samples from the model's logits as
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
