"""Text generation: prefill the prompt once, then decode one token at a time from a KV cache.

Legend: B batch, L length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moekit.model import KVCache, Transformer
from moekit.runconfig import RunConfig, from_json
from moekit.train.checkpoint import CheckpointError, latest_checkpoint, load_model_weights, read_manifest
from moekit.train.data import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class LoadedRun:
    model: Transformer
    tokenizer: Tokenizer
    config: RunConfig
    checkpoint: Path


def load_run(run_dir: Path, device: str = "cpu") -> LoadedRun:
    """The trained model (newest checkpoint, weights verified), its tokenizer and config."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise CheckpointError(f"{run_dir}: not a moekit run directory (no config.json)")
    cfg = from_json(run_dir / "config.json")
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{run_dir}: has no checkpoint yet")
    read_manifest(path)
    model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None)
    load_model_weights(path, model)
    return LoadedRun(model.to(device).eval(), load_tokenizer(run_dir), cfg, path)


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
def generate(
    model: Transformer,
    prompt_BL: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> Tensor:
    """Prompt followed by ``max_new_tokens`` generated tokens, ``[B, L + max_new_tokens]``.

    With ``use_cache`` the prompt is prefilled once and each new token costs one position; when the
    context fills, the cache is rebuilt from the last half-context (a sliding window). Without it,
    every step reruns the whole (cropped) sequence: the reference the cache is tested against.
    """
    if prompt_BL.shape[1] == 0:
        raise ValueError("prompt is empty: give at least one token")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    model.eval()
    ctx = model.cfg.context_length
    out = prompt_BL
    cache: KVCache | None = None
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(out[:, -ctx:]).logits[:, -1]
        else:
            if cache is None or cache.length >= ctx:
                window = out[:, -(max(1, ctx // 2) if cache is not None else ctx) :]
                cache = KVCache(model.cfg, out.shape[0], out.device, model.embed.weight.dtype)
                logits = model(window, cache=cache).logits[:, -1]
            else:
                logits = model(out[:, -1:], cache=cache).logits[:, -1]
        next_B1 = sample_next(logits, temperature, top_k, top_p, generator).unsqueeze(1)
        out = torch.cat([out, next_B1], dim=1)
    return out


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
    ids = run.tokenizer.encode(prompt)
    if not ids:
        raise ValueError("--prompt is empty after tokenisation: give at least one character")
    device = run.model.embed.weight.device
    prompt_BL = torch.tensor([ids], dtype=torch.long, device=device)
    out = generate(run.model, prompt_BL, max_new_tokens, temperature, top_k, top_p, seed)
    return run.tokenizer.decode(out[0].tolist())
