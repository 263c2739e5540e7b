"""Text generation as small functions: ``prefill`` the prompt once, then ``decode_step`` one token at a
time from the KV cache; ``generate`` samples with them.

Legend: B batch, L length, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moekit.model import KVCache, Transformer
from moekit.run.load import LoadedRun


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming the first out-of-range option (by its argument name, also the JSON field's)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature}: must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be >= 0 (0 = all tokens)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")


def sample_next(
    logits_BV: Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> Tensor:
    """Next token ids [B]: greedy when temperature is 0, else sampled from the filtered softmax."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the tokens before it already cover top_p (always keep the first).
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits_BV.device)


@torch.no_grad()
def prefill(model: Transformer, tokens_BL: Tensor, left_pad_B: Tensor | None = None) -> tuple[Tensor, KVCache]:
    """Run the prompt once into a fresh KV cache: the last position's logits [B, V], and the cache.
    ``left_pad_B``: leading padding positions of each row, masked out of attention."""
    cache = KVCache(model.cfg, tokens_BL.shape[0], tokens_BL.device, model.embed.weight.dtype, left_pad_B)
    return model(tokens_BL, cache=cache).logits[:, -1], cache


@torch.no_grad()
def decode_step(model: Transformer, token_B1: Tensor, cache: KVCache) -> Tensor:
    """One new position per row through the cache (which grows by one): its logits [B, V]."""
    return model(token_B1, cache=cache).logits[:, -1]


def _sampler(model: Transformer, prompt_BL: Tensor, seed: int | None) -> torch.Generator | None:
    if prompt_BL.shape[1] == 0:
        raise ValueError("prompt is empty: give at least one token")
    model.eval()
    return torch.Generator().manual_seed(seed) if seed is not None else None


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_BL: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    left_pad_B: Tensor | None = None,
) -> Tensor:
    """Prompt followed by ``max_new_tokens`` generated tokens, ``[B, L + max_new_tokens]``.

    The prompt is prefilled once and each new token costs one position; when the context fills, the
    last half-context is prefilled again (a sliding window). ``left_pad_B``: leading padding
    positions of each row (prompts of different lengths).
    """
    generator = _sampler(model, prompt_BL, seed)
    ctx = model.cfg.context_length
    out = prompt_BL
    cache: KVCache | None = None
    for _ in range(max_new_tokens):
        if cache is None or cache.length >= ctx:
            window = out[:, -(max(1, ctx // 2) if cache is not None else ctx) :]
            pad = None
            if left_pad_B is not None:  # padding that the window cut off is gone
                pad = (left_pad_B - (out.shape[1] - window.shape[1])).clamp_min(0)
            logits, cache = prefill(model, window, pad)
        else:
            logits = decode_step(model, out[:, -1:], cache)
        out = torch.cat([out, sample_next(logits, temperature, top_k, top_p, generator).unsqueeze(1)], dim=1)
    return out


@torch.no_grad()
def generate_uncached(
    model: Transformer,
    prompt_BL: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> Tensor:
    """``generate`` without a cache: every step reruns the whole (cropped) sequence. The reference the
    cached path is tested against."""
    generator = _sampler(model, prompt_BL, seed)
    out = prompt_BL
    for _ in range(max_new_tokens):
        logits = model(out[:, -model.cfg.context_length :]).logits[:, -1]
        out = torch.cat([out, sample_next(logits, temperature, top_k, top_p, generator).unsqueeze(1)], dim=1)
    return out


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Token ids ``[B, max length]`` right-aligned behind padding, and each row's padding count [B]."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    return ids, torch.tensor([width - len(p) for p in prompts])


def generate_texts(
    run: LoadedRun,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = 0,
    batch_size: int = 1,
) -> list[str]:
    """Continuations of several prompts (each prompt included), generated ``batch_size`` at a time."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    encoded = [run.tokenizer.encode(p) for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i + 1} is empty after tokenisation: give at least one character")
    device = run.model.embed.weight.device
    texts = []
    for start in range(0, len(encoded), batch_size):
        ids_BL, pad_B = left_pad(encoded[start : start + batch_size])
        out = generate(run.model, ids_BL.to(device), max_new_tokens, temperature, top_k, top_p, seed, pad_B.to(device))
        texts += [run.tokenizer.decode(row[pad:].tolist()) for row, pad in zip(out, pad_B.tolist(), strict=True)]
    return texts


def generate_text(
    run: LoadedRun,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = 0,
) -> str:
    """Decode the continuation of ``prompt`` (the prompt itself included)."""
    if not run.tokenizer.encode(prompt):
        raise ValueError(f"prompt={prompt!r}: empty after tokenisation; give at least one character")
    return generate_texts(run, [prompt], max_new_tokens, temperature, top_k, top_p, seed)[0]
