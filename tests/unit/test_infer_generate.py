"""Generation: the KV cache path equals a no-cache reference; sampling is seeded and filtered."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import assert_padded_rows_match_alone
from torch import Tensor

from moekit import runconfig
from moekit.infer.generate import decode_step, generate, generate_uncached, greedy, left_pad, prefill, sample_next
from moekit.model import KVCache, Transformer


def tiny_model(sharpen: float = 20.0, **overrides: str) -> Transformer:
    cfg = runconfig.resolve("tiny", overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None)
    with torch.no_grad():  # sharpen the random model so greedy choices are not near-ties
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"model.moe_every": "0", "model.norm": "layernorm", "model.mlp_activation": "gelu"},
        {"model.n_kv_heads": "1", "moe.router": "switch", "moe.top_k": "1"},
        {"moe.num_shared_experts": "1", "model.tie_embeddings": "false"},
    ],
)
def test_greedy_with_cache_equals_no_cache_reference(overrides: dict[str, str]) -> None:
    model = tiny_model(**overrides)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompt, 24, temperature=0)
    reference = generate_uncached(model, prompt, 24, temperature=0)
    assert torch.equal(cached, reference)
    assert cached.shape == (2, 29)


def test_cached_logits_match_full_forward() -> None:
    model = tiny_model()
    seq = torch.randint(0, 256, (1, 12))
    full = model(seq).logits
    cache = KVCache(model.cfg, 1, seq.device, torch.float32)
    prefill = model(seq[:, :7], cache=cache).logits
    steps = [model(seq[:, i : i + 1], cache=cache).logits for i in range(7, 12)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=0)


def test_prefill_then_decode_steps_match_full_forward() -> None:
    model = tiny_model()
    seq = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    full = model(seq).logits  # [B, 12, V]; position i predicts token i + 1
    logits, cache = prefill(model, seq[:, :7])
    steps = [logits] + [decode_step(model, seq[:, i : i + 1], cache) for i in range(7, 12)]
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:], atol=1e-5, rtol=0)
    assert cache.length == 12


def test_a_batched_decode_step_runs_in_inference_mode_and_hands_back_a_normal_tensor() -> None:
    model = tiny_model()
    seq = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(5))
    _, cache = prefill(model, seq[:, :6])
    modes: list[bool] = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: modes.append(torch.is_inference_mode_enabled()))
    logits = decode_step(model, seq[:, 6:7], cache)
    hook.remove()
    assert modes == [True] and not logits.is_inference() and logits.shape == (2, model.cfg.vocab_size)
    logits.add_(1.0)  # written in place, as callers may
    torch.testing.assert_close(logits - 1.0, model(seq[:, :7]).logits[:, -1], atol=1e-5, rtol=0)


def test_forward_through_a_cache_reports_routing_counts_without_losses() -> None:
    """Decoding reads the routing counts only; given targets, or with autograd recording (a cached
    rollout being learned from), a cached forward still has the balancing losses."""
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, cache = prefill(model, prompt)
        decoded = model(prompt[:, -1:], cache=cache)
        _, cache = prefill(model, prompt[:, :-1])
        scored = model(prompt[:, -1:], prompt[:, :1], cache=cache)
    _, cache = prefill(model, prompt[:, :-1])
    learned = model(prompt[:, -1:], cache=cache)
    top_k = model.moe_cfg.top_k
    assert decoded.moe_stats and all(
        s.loss is None and int(s.tokens_per_expert.sum()) == top_k for s in decoded.moe_stats
    )
    assert all(s.loss is not None for s in scored.moe_stats)
    assert learned.logits.requires_grad and all(s.loss is not None for s in learned.moe_stats)
    torch.testing.assert_close(scored.loss, scored.lm_loss + sum(s.loss for s in scored.moe_stats))


def with_step_logits(generate_fn: Callable[..., Tensor], model: Transformer, prompt: Tensor, steps: int):
    """Greedy tokens of ``generate_fn``, and the last position's logits of each forward [B, steps, V]."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, logits: seen.append(logits[:, -1].clone()))
    try:
        out = generate_fn(model, prompt, steps, temperature=0)
    finally:
        hook.remove()
    return out, torch.stack(seen, dim=1)


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("prompt_length", [11, 40])
def test_generation_past_the_context_equals_uncached_reference(attention: str, prompt_length: int) -> None:
    """Past the context (32) the cached path prefills its last half-context again; the reference
    slides its window at the same steps, so every step's logits agree (prompts shorter and longer
    than the context). Attention weights scaled by 4 so a window slid differently moves the logits
    (by up to 1.2 when the reference kept the last full context) and the greedy tokens."""
    model = tiny_model(sharpen=2.0, **{"model.attention": attention})
    with torch.no_grad():
        for block in model.blocks:
            for weight in block.attn.parameters():
                if weight.dim() == 2:
                    weight.mul_(4)
    prompt = torch.randint(0, 256, (1, prompt_length), generator=torch.Generator().manual_seed(5))
    cached, cached_logits = with_step_logits(generate, model, prompt, 60)
    reference, reference_logits = with_step_logits(generate_uncached, model, prompt, 60)
    assert cached.shape == (1, prompt_length + 60)
    torch.testing.assert_close(cached_logits, reference_logits, atol=1e-5, rtol=0)
    assert torch.equal(cached, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_the_first_of_the_likeliest(dtype: torch.dtype) -> None:
    """Rows of few distinct values (ties everywhere, as bf16 logits have), rows with NaNs, all -inf: the
    first index of the largest value, a NaN counting as largest, written out per row."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 300), generator=gen).to(dtype)
    logits[5, [40, 200]] = float("nan")
    logits[7] = float("-inf")
    logits[9, -1] = 9
    for r, row in enumerate(logits.tolist()):
        nans = [i for i, x in enumerate(row) if x != x]
        want = nans[0] if nans else row.index(max(row))
        assert int(greedy(logits[r : r + 1])[0]) == want
    assert greedy(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_sampling_is_reproducible_with_a_seed() -> None:
    model = tiny_model(sharpen=1.0)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    a = generate(model, prompt, 16, temperature=1.0, top_k=20, seed=5)
    b = generate(model, prompt, 16, temperature=1.0, top_k=20, seed=5)
    c = generate(model, prompt, 16, temperature=1.0, top_k=20, seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_and_top_p_filtering() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, 2, None, gen)) for _ in range(300)}
    assert draws == {0, 1}
    draws = {int(sample_next(logits, 1.0, None, 0.7, gen)) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 covers it: token 2 and 3 are cut
    draws = {int(sample_next(logits, 1.0, None, 0.4, gen)) for _ in range(100)}
    assert draws == {0}
    assert int(sample_next(logits, 0.0, None, None, None)) == 0


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(tiny_model(), torch.zeros(1, 0, dtype=torch.long), 3)


def test_left_padded_batch_equals_each_prompt_alone() -> None:
    model = tiny_model()
    prompts = [[5, 17, 99, 3, 42, 8, 1], [200, 13], [7]]
    assert_padded_rows_match_alone(model, prompts, steps=20)
    ids, pad = left_pad(prompts)
    batched = generate(model, ids, 20, temperature=0, left_pad_B=pad)
    for row, prompt, p in zip(batched, prompts, pad.tolist(), strict=True):
        alone = generate(model, torch.tensor([prompt]), 20, temperature=0)[0]
        assert torch.equal(row[p:], alone)
