"""Text generation as small functions: ``prefill`` the prompt once, then ``decode_step`` one token at a
time from the KV cache; ``generate`` samples with them.

Legend: B batch, L length, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.config import MoEConfig
from moekit.errors import OptionError
from moekit.experts.matmul import single_token_kernels
from moekit.infer.token_step import takes, token_step
from moekit.model import KVCache, Transformer
from moekit.run.load import LoadedRun

NextLogits = Callable[[Tensor], Tensor]  # tokens so far [B, L] -> the next position's logits [B, V]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """``OptionError`` naming the first out-of-range option (by its argument name, also the JSON field's)."""
    if max_new_tokens < 0:
        raise OptionError("max_new_tokens", "must be >= 0", max_new_tokens)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise OptionError("temperature", "must be a finite number >= 0 (0 = greedy)", temperature)
    if top_k < 0:
        raise OptionError("top_k", "must be >= 0 (0 = all tokens)", top_k)
    if not 0 < top_p <= 1:
        raise OptionError("top_p", "must be in (0, 1]", top_p)


def check_batch_independent(moe: MoEConfig | None, others: str) -> None:
    """Refuse routing that depends on the whole batch (capacity limits, expert choice): ``others``, what
    shares a sequence's batch, would change its tokens."""
    if moe is None:
        return
    if moe.capacity_factor is not None:
        raise ValueError(
            f"moe.capacity_factor={moe.capacity_factor}: each expert keeps a share of the whole batch's tokens, "
            f"so a sequence's tokens would depend on {others}"
        )
    if moe.router == "expert_choice":
        raise ValueError(
            f"moe.router=expert_choice: experts pick among the whole batch's tokens, so a sequence's tokens would "
            f"depend on {others}"
        )


def greedy(logits_BV: Tensor) -> Tensor:
    """Each row's likeliest token [B]; of several tied, the first (a NaN counts as the likeliest), as
    ``argmax`` picks.

    NOTE: max's indices rather than argmax: torch 2.13's CPU argmax over 16-bit rows is not vectorized
    (ad hoc, 64 x 8192 bf16 logits, 2 threads: 0.85 ms against 0.16; fp32 0.15 either way)."""
    return logits_BV.max(dim=-1).indices


def sample_next(
    logits_BV: Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> Tensor:
    """Next token ids [B]: greedy when temperature is 0, else sampled from the filtered softmax."""
    if temperature == 0:
        return greedy(logits_BV)
    top_k = top_k or None  # 0: every token, as check_sampling says
    logits = logits_BV.float() / temperature
    if not logits.isfinite().all():  # a temperature too small for float32: the gaps to the best, in float64
        logits = (logits_BV.double() - logits_BV.double().amax(dim=-1, keepdim=True)) / temperature
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
    with single_token_kernels(tokens_BL.numel()):
        last = torch.tensor([tokens_BL.shape[1] - 1], device=tokens_BL.device)
        return model(tokens_BL, cache=cache, logits_at=last).logits[:, -1], cache


def decode_step(model: Transformer, token_B1: Tensor, cache: KVCache) -> Tensor:
    """One new position per row through the cache (which grows by one): its logits [B, V]. One token of
    one sequence goes through ``token_step`` where it computes what the model does (``takes``).

    In inference mode, its ops skip autograd's dispatch: a d1024 bf16 step of one sequence 5-8% shorter
    than under ``no_grad`` (``python benchmarks/decode_split.py``: 8.20 against 8.96 ms), of a batch of
    4 or 16 sequences 4-5% (ad hoc). Blocks' forward pre-hooks run in it too (what they make is an
    inference tensor). The logits come back as a normal tensor (a copy of ``B x V`` values); the cache,
    made by ``prefill``, stays one a forward with autograd may extend."""
    with single_token_kernels(token_B1.numel()), torch.inference_mode():
        if takes(model, token_B1):
            logits = token_step(model, token_B1, cache)
        else:
            logits = model(token_B1, cache=cache).logits[:, -1]
    return logits.clone()


@dataclass(frozen=True)
class Sampling:
    """How each next token is drawn (``sample_next``), and the seed of its draws."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


def _sample_loop(
    model: Transformer, prompt_BL: Tensor, max_new_tokens: int, sampling: Sampling, next_logits: NextLogits
) -> Tensor:
    """The prompt and ``max_new_tokens`` tokens drawn one at a time from ``next_logits(tokens so far)``.
    What the entry points share: the argument checks, the seeded generators and the sampling; each
    brings its own way to the logits. Each row draws from a generator of its own seeded with ``seed``,
    so a row samples what its prompt alone samples, whatever shares its batch."""
    if prompt_BL.shape[1] == 0:
        raise ValueError("prompt is empty: give at least one token")
    model.eval()
    B = prompt_BL.shape[0]
    seeded = sampling.seed is not None and sampling.temperature > 0
    generators = [torch.Generator().manual_seed(sampling.seed) for _ in range(B)] if seeded else [None] * B
    out = prompt_BL
    for _ in range(max_new_tokens):
        logits_BV = next_logits(out)
        if sampling.temperature == 0:  # greedy: one pick for the batch
            token_B = greedy(logits_BV)
        else:
            token_B = torch.cat(
                [
                    sample_next(logits_BV[r : r + 1], sampling.temperature, sampling.top_k, sampling.top_p, g)
                    for r, g in enumerate(generators)
                ]
            )
        out = torch.cat([out, token_B.unsqueeze(1)], dim=1)
    return out


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
    positions of each row (prompts of different lengths). Batched rows slide together at the padded
    length: a row with padding slides when the longest row fills the context, so it keeps fewer of
    its own tokens in view than it would alone and its tokens may differ from then on.
    """
    if prompt_BL.shape[0] > 1:
        check_batch_independent(model.moe_cfg, "the prompts beside it: generate one prompt at a time (batch size 1)")
    ctx = model.cfg.context_length
    cache: KVCache | None = None

    def next_logits(out_BL: Tensor) -> Tensor:
        nonlocal cache
        if cache is not None and cache.length < ctx:
            return decode_step(model, out_BL[:, -1:], cache)
        window = out_BL[:, -(max(1, ctx // 2) if cache is not None else ctx) :]
        pad = None
        if left_pad_B is not None:  # padding that the window cut off is gone
            pad = (left_pad_B - (out_BL.shape[1] - window.shape[1])).clamp_min(0)
        logits, cache = prefill(model, window, pad)
        return logits

    return _sample_loop(model, prompt_BL, max_new_tokens, Sampling(temperature, top_k, top_p, seed), next_logits)


@torch.no_grad()
def generate_uncached(model: Transformer, prompt_BL: Tensor, max_new_tokens: int, **sampling: float | None) -> Tensor:
    """``generate`` without a cache: every step reruns its whole window. The reference the cached path
    is tested against; ``sampling``: ``generate``'s options by name (``Sampling``'s fields).

    The window follows ``generate``'s schedule: it starts at the prompt's last ``ctx`` tokens and
    grows by one per step; once it would pass the context it restarts from the last ``max(1, ctx // 2)``
    tokens (where ``generate`` prefills again) and grows again."""
    ctx = model.cfg.context_length
    start: int | None = None  # where the window begins in the tokens so far

    def next_logits(out_BL: Tensor) -> Tensor:
        nonlocal start
        length = out_BL.shape[1]
        if start is None:
            start = max(0, length - ctx)
        elif length - 1 - start >= ctx:  # the tokens before the newest one already fill the context
            start = length - max(1, ctx // 2)
        return model(out_BL[:, start:]).logits[:, -1]

    return _sample_loop(model, prompt_BL, max_new_tokens, Sampling(**sampling), next_logits)


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
        raise OptionError("batch_size", "must be >= 1", batch_size)
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
        raise OptionError("prompt", "empty after tokenisation; give at least one character", prompt)
    return generate_texts(run, [prompt], max_new_tokens, temperature, top_k, top_p, seed)[0]
