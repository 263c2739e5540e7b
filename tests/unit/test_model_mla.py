"""Multi-head latent attention: the absorbed decode and the latent cache against the naive form.

References: the model's own uncached forward (every key and value expanded from the latents) and a
cache of expanded per-head keys and values. Tolerance 1e-5 in fp32 (the same sums, reassociated).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_padded_rows_match_alone

from moekit import runconfig
from moekit.config import ModelConfig
from moekit.infer.generate import generate, generate_uncached, left_pad
from moekit.model import KVCache, Transformer
from moekit.model.mla import MLA

MLA_FLAGS = {
    "model.attention": "mla",
    "model.n_heads": "3",
    "model.d_model": "48",
    "model.kv_lora_rank": "12",
    "model.qk_nope_head_dim": "10",
    "model.qk_rope_head_dim": "6",
    "model.v_head_dim": "14",
    "moe.num_experts": "6",
    "moe.n_group": "3",
    "moe.topk_group": "2",
    "moe.top_k": "3",
    "moe.score_func": "sigmoid",
    "moe.group_score": "top2_sum",
}


def mla_model(**overrides: str) -> Transformer:
    cfg = runconfig.resolve("tiny", MLA_FLAGS | overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    with torch.no_grad():  # sharpen the random model so greedy choices are not near-ties
        model.lm_head.weight.mul_(20)
    return model.eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"model.q_lora_rank": "16"},
        {
            "model.rope_scaling": "yarn",
            "model.rope_factor": "4",
            "model.rope_original_context": "16",
            "model.rope_mscale_all_dim": "0.7",
        },
    ],
    ids=["no-q-lora", "q-lora", "yarn"],
)
def test_latent_and_expanded_caches_equal_the_uncached_forward(overrides: dict[str, str]) -> None:
    model = mla_model(**overrides)
    seq = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(1))
    full = model(seq).logits
    for expanded in (False, True):
        cache = KVCache(model.cfg, 2, seq.device, torch.float32, mla_expanded=expanded)
        logits = [model(seq[:, :6], cache=cache).logits, model(seq[:, 6:9], cache=cache).logits]
        logits += [model(seq[:, i : i + 1], cache=cache).logits for i in range(9, 14)]
        torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-5, rtol=0)


def test_absorbed_equals_naive_attention() -> None:
    """The two forms on the same latents, queries and a ragged mask, module level."""
    cfg = ModelConfig(d_model=40, n_heads=4, attention="mla", kv_lora_rank=20, qk_rope_head_dim=8, q_lora_rank=12)
    torch.manual_seed(0)
    attn = MLA(cfg)
    B, L, S = 3, 4, 11
    q_nope, q_rope = torch.randn(B, L, 4, cfg.qk_nope_head_dim), torch.randn(B, L, 4, 8)
    latent = torch.randn(B, S, 28)
    mask = torch.rand(B, 1, L, S) > 0.3
    mask[..., 0] = True
    naive = attn._naive(q_nope, q_rope, latent, mask)
    absorbed = attn._absorbed(q_nope, q_rope, latent, mask)
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)


def test_latent_cache_is_what_deepseek_v2_promises() -> None:
    """The latent holds R + P numbers per token per layer; the expanded cache H * (N + P + V)."""
    model = mla_model()
    cfg = model.cfg
    latent = KVCache(cfg, 1, torch.device("cpu"), torch.float32).bytes_per_token()
    expanded = KVCache(cfg, 1, torch.device("cpu"), torch.float32, mla_expanded=True).bytes_per_token()
    assert latent == 4 * cfg.n_layers * (12 + 6)
    assert expanded == 4 * cfg.n_layers * 3 * (10 + 6 + 14)


def test_generation_batched_with_padding_matches_uncached() -> None:
    model = mla_model()
    prompts = [[5, 9, 100, 7], [3, 44]]
    assert_padded_rows_match_alone(model, prompts, steps=12)
    tokens, pad = left_pad(prompts, 0)
    cached = generate(model, tokens, 12, temperature=0, left_pad_B=pad)
    for row, prompt in enumerate(prompts):
        alone = generate_uncached(model, torch.tensor([prompt]), 12, temperature=0)
        assert cached[row, -12:].tolist() == alone[0, -12:].tolist()


@pytest.mark.slow
def test_checkpoint_and_offloaded_inference(tmp_path, write_run) -> None:
    """A saved MLA model with group-limited routing reloads, and with its experts offloaded under a
    two-expert budget generates the same greedy tokens as resident."""
    from moekit.infer.offload import OffloadOptions, model_bytes
    from moekit.run.load import load_run

    run_dir = write_run(tmp_path / "run", **MLA_FLAGS, **{"model.q_lora_rank": "16"})
    resident = load_run(run_dir).model
    assert isinstance(resident.blocks[0].attn, MLA)
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(4))
    reference = generate(resident, prompt, 10, temperature=0)
    probe = load_run(run_dir, offload=OffloadOptions(memory_budget=1 << 40))
    budget = model_bytes(probe.model) + 2 * probe.offloader.cache.slot_bytes
    probe.offloader.close()
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget))
    try:
        assert torch.equal(generate(run.model, prompt, 10, temperature=0), reference)
    finally:
        run.offloader.close()


def test_mla_trains() -> None:
    """Gradients reach every MLA weight and a few AdamW steps lower the loss on a fixed batch."""
    model = mla_model(**{"model.q_lora_rank": "16"}).train()
    seq = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(seq[:, :-1], seq[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if ".attn." in n}
        assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), "an MLA weight got no gradient"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kv_lora_rank=8), "model.kv_lora_rank=8: needs model.attention = mla"),
        (dict(attention="mla", qk_rope_head_dim=5), "model.qk_rope_head_dim=5: must be even"),
        (dict(attention="mla", n_kv_heads=2), "model.n_kv_heads=2: mla has no kv heads"),
        (dict(rope_mscale_all_dim=1.0), "model.rope_mscale_all_dim=1.0: moves"),
        (dict(attention="gqa"), "model.attention='gqa': must be one of"),
    ],
)
def test_mla_config_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(d_model=32, n_heads=4, **kwargs)
