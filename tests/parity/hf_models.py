"""Tiny Hugging Face models of each family, built locally with random weights (no download)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def hf_config(family: str, **overrides):
    """A tiny config of ``family``; MoE families get 4 experts, top-2. ``overrides`` win over every default."""
    import transformers as tf

    moe = dict(num_experts=4, num_experts_per_tok=2)
    made = {
        "mixtral": (tf.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)),
        "qwen2_moe": (
            tf.Qwen2MoeConfig,
            dict(moe_intermediate_size=24, shared_expert_intermediate_size=48, norm_topk_prob=False, **moe),
        ),
        "olmoe": (tf.OlmoeConfig, moe),
        # Awkward shapes: 6 experts, a head size apart from hidden / heads, a dense first block.
        "qwen3_moe": (
            tf.Qwen3MoeConfig,
            dict(moe, num_experts=6, moe_intermediate_size=24, head_dim=12, mlp_only_layers=[0], norm_topk_prob=True),
        ),
        # 6 experts, head size 12, windowed and full layers, YaRN, a clamp the activations reach.
        "gpt_oss": (
            tf.GptOssConfig,
            dict(
                num_local_experts=6,
                num_experts_per_tok=2,
                intermediate_size=24,
                head_dim=12,
                sliding_window=5,
                swiglu_limit=0.5,
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=150000.0,
                    factor=4.0,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                    original_max_position_embeddings=16,
                ),
            ),
        ),
        "llama": (tf.LlamaConfig, {}),
        "mistral": (tf.MistralConfig, dict(sliding_window=None)),
        "qwen2": (tf.Qwen2Config, {}),
    }
    make, defaults = made[family]
    return make(**(defaults | TINY | overrides))


def randomize(model: torch.nn.Module, seed: int = 0, router_scale: float = 1.0) -> None:
    """Weights large enough that routing and logits are decisive; norm weights around 1.

    ``router_scale`` multiplies the routers' weights: > 1 makes each token's picks clear-cut (a
    few experts take most of the weight), so a wrong expert or a wrong weight shows in the logits.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
            if name.endswith((".gate.weight", ".router.weight")):  # a router (not a shared expert's "_gate")
                p.mul_(router_scale)


def save_hf(
    family: str, directory: Path, shard_size: str | None = None, router_scale: float = 1.0, **overrides
) -> torch.nn.Module:
    """Build, randomise and ``save_pretrained`` a tiny ``family`` model; return it in eval mode (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    randomize(model, router_scale=router_scale)
    model.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )


def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary, as Hugging Face's tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(TINY["vocab_size"] - 1)} | {"[UNK]": TINY["vocab_size"] - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
