"""What the Qwen3-MoE and gpt-oss families brought, trained from scratch: attention sinks and sliding
windows against an explicit softmax, the KV cache against the uncached reference, gradients,
checkpoints and offloaded experts against resident ones; each feature set by its flag."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import assert_padded_rows_match_alone

from moekit import runconfig
from moekit.config import ModelConfig, MoEConfig
from moekit.infer.generate import generate, generate_uncached, left_pad
from moekit.infer.offload import OffloadOptions, model_bytes
from moekit.model import Transformer
from moekit.model.rope import yarn_inverse_frequencies
from moekit.model.sdpa import attend, causal_mask
from moekit.run.checkpoint import save_checkpoint
from moekit.run.load import load_run
from moekit.tokenizer import ByteTokenizer

FEATURES = {  # every new feature, by the flags a training run would set
    "model.head_dim": "12",
    "model.tie_embeddings": "false",
    "model.n_kv_heads": "1",
    "model.qk_head_norm": "true",
    "model.qkv_bias": "true",
    "model.attn_out_bias": "true",
    "model.attn_sinks": "true",
    "model.sliding_window": "3",
    "model.full_attention_every": "2",
    "model.rope_scaling": "yarn",
    "model.rope_factor": "4",
    "model.rope_original_context": "8",
    "moe.activation": "clamped_swiglu",
    "moe.swiglu_limit": "0.8",
    "moe.expert_ffn_bias": "true",
    "moe.router_bias": "true",
    "moe.softmax_before_topk": "false",
}


def eager_attention(q, k, v, mask, sinks):
    """The textbook form (gpt-oss's eager path): scores, a sink column in the softmax, dropped after."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


@pytest.mark.parametrize("window,start", [(0, 0), (3, 0), (4, 5)])
def test_sinks_and_windows_equal_the_explicit_softmax(window: int, start: int) -> None:
    g = torch.Generator().manual_seed(0)
    L, S = 6, 6 + start
    q = torch.randn(2, 4, L, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, S, 8, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    mask = causal_mask(start, L, S, window, None, q.device)
    full = torch.ones(L, S, dtype=torch.bool).tril(start) if mask is None else mask
    if window:  # the window leaves each query exactly min(window, position + 1) keys
        assert full.sum(-1).tolist() == [min(window, start + i + 1) for i in range(L)]
    probe = torch.randn(2, 4, L, 8, generator=g)
    outs, grads = [], []
    for fn in (lambda: attend(q, k, v, mask, sinks, 0.0), lambda: eager_attention(q, k, v, full, sinks)):
        y = fn()
        outs.append(y)
        grads.append(torch.autograd.grad((y * probe).sum(), (q, k, v, sinks)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    no_sink = attend(q, k, v, mask, None, 0.0)
    assert (no_sink - outs[0]).abs().max() > 1e-2  # the sinks matter here


def test_yarn_keeps_fast_and_interpolates_slow_frequencies() -> None:
    cfg = ModelConfig(head_dim=16, rope_scaling="yarn", rope_factor=8.0, rope_original_context=64)
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, 16, 2) / 16)
    yarn = yarn_inverse_frequencies(cfg)
    assert yarn[0] == plain[0] and torch.allclose(yarn[-1], plain[-1] / 8)
    assert (yarn <= plain).all()


def features_model(sharpen: float = 20.0, **extra: str) -> Transformer:
    cfg = runconfig.resolve("tiny", FEATURES | extra)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):  # zero-initialised, they would test nothing
                p.normal_(std=0.1)
            if name.endswith("router.gate.weight"):
                p.mul_(4)
    return model.eval()


def test_flags_build_every_feature() -> None:
    model = features_model()
    attn, ffn = model.blocks[0].attn, model.blocks[0].ffn
    assert attn.qkv.weight.shape == ((2 + 2) * 12, 32) and attn.out.weight.shape == (32, 24)
    assert attn.sinks.shape == (2,) and attn.out.bias is not None and attn.qk_norm.q.weight.shape == (12,)
    assert [b.attn.window for b in model.blocks] == [3, 0]
    assert ffn.experts.w_in_bias.shape == (4, 2 * 64) and ffn.router.gate.bias.shape == (4,)
    assert abs(model.rope_freqs[0].abs().mean().item() - (0.1 * math.log(4) + 1)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"model.full_attention_every": "0", "model.sliding_window": "5"}])
def test_greedy_with_cache_equals_no_cache_reference(extra: dict[str, str]) -> None:
    """Prompts longer than the window, generation past the context (the cache refills)."""
    model = features_model(**extra)
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    for temperature in (0.0, 1.0):  # greedy, and sampled (seeded) for tokens a random model does not repeat
        cached = generate(model, prompt, 30, temperature=temperature, seed=0)
        assert torch.equal(cached, generate_uncached(model, prompt, 30, temperature=temperature, seed=0))
    assert len(set(cached[0, 7:].tolist())) > 10


def test_left_padded_batch_equals_each_prompt_alone() -> None:
    model = features_model()
    prompts = [[5, 17, 99, 3, 42, 8, 1], [200, 13], [7, 7, 7, 7]]
    assert_padded_rows_match_alone(model, prompts, steps=10)
    ids, pad = left_pad(prompts)
    batched = generate(model, ids, 10, temperature=0, left_pad_B=pad)
    for row, (p, n) in enumerate(zip(prompts, pad.tolist(), strict=True)):
        alone = generate(model, torch.tensor([p]), 10, temperature=0)
        assert torch.equal(batched[row, n:], alone[0])


def test_backward_reaches_every_new_parameter() -> None:
    model = features_model(sharpen=1.0).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    model(ids[:, :-1], targets_BL=ids[:, 1:]).loss.backward()
    for name, p in model.named_parameters():
        if name.endswith(("sinks", "out.bias", "w_in_bias", "w_out_bias", "gate.bias", "qk_norm.q.weight")):
            assert p.grad is not None and p.grad.abs().sum() > 0 and p.grad.isfinite().all(), name


def write_features_run(run_dir: Path) -> Transformer:
    """A run directory like ``moekit train`` writes, holding the features model."""
    cfg = runconfig.resolve("tiny", FEATURES | {"model.n_layers": "3", "moe.num_experts": "6"})
    model = features_model(**{"model.n_layers": "3", "moe.num_experts": "6"})
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    ByteTokenizer().save(run_dir)
    save_checkpoint(run_dir, 1, model, {}, keep=1)
    return model


@pytest.mark.slow
def test_checkpoint_and_offloaded_experts_equal_resident(tmp_path: Path) -> None:
    """Reloaded from its checkpoint, then with its experts offloaded under a budget of two slots:
    the same logits, the same greedy tokens (expert biases and the clamp in the offloaded path)."""
    model = write_features_run(tmp_path / "run")
    ids, pad = left_pad([[5, 17, 99, 3, 42, 8, 1], [200, 13]])
    reference = generate(model, ids, 12, temperature=0, left_pad_B=pad)
    resident = load_run(tmp_path / "run").model
    with torch.no_grad():
        assert torch.equal(resident(ids).logits, model(ids).logits)
    probe = load_run(tmp_path / "run", offload=OffloadOptions(memory_budget=1 << 40))
    budget = model_bytes(probe.model) + 2 * probe.offloader.cache.slot_bytes
    probe.offloader.close()
    run = load_run(tmp_path / "run", offload=OffloadOptions(memory_budget=budget))
    try:
        assert run.offloader.cache.num_slots == 2
        assert torch.equal(generate(run.model, ids, 12, temperature=0, left_pad_B=pad), reference)
        with torch.no_grad():
            torch.testing.assert_close(run.model(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    finally:
        run.offloader.close()


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="model.head_dim=7: head size must be even"):
        ModelConfig(head_dim=7)
    with pytest.raises(ValueError, match="model.qk_head_norm=True: excludes model.qk_norm"):
        ModelConfig(qk_norm=True, qk_head_norm=True)
    with pytest.raises(ValueError, match="model.rope_original_context=0: yarn needs it > 0"):
        ModelConfig(rope_scaling="yarn", rope_factor=4.0)
    with pytest.raises(ValueError, match="activation='clamped_swiglu': routed experts only"):
        MoEConfig(d_model=8, d_ff=8, activation="clamped_swiglu", num_shared_experts=1)
    with pytest.raises(ValueError, match="n_heads=3: must divide d_model=32"):
        ModelConfig(d_model=32, n_heads=3)
    assert ModelConfig(d_model=32, n_heads=3, head_dim=8).head_size == 8
