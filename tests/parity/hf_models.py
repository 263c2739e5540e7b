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
    """A tiny config of ``family``; MoE families get 4 experts, top-2."""
    import transformers as tf

    tiny = TINY | overrides
    moe = dict(num_experts=4, num_experts_per_tok=2)
    make = {
        "mixtral": lambda: tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, **tiny),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            moe_intermediate_size=24, shared_expert_intermediate_size=48, norm_topk_prob=False, **moe, **tiny
        ),
        "olmoe": lambda: tf.OlmoeConfig(**moe, **tiny),
        "llama": lambda: tf.LlamaConfig(**tiny),
        "mistral": lambda: tf.MistralConfig(**{"sliding_window": None, **tiny}),
        "qwen2": lambda: tf.Qwen2Config(**tiny),
    }
    return make[family]()


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that routing and logits are decisive; norm weights around 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)


def save_hf(family: str, directory: Path, shard_size: str | None = None, **overrides) -> torch.nn.Module:
    """Build, randomise and ``save_pretrained`` a tiny ``family`` model; return it in eval mode (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    randomize(model)
    model.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
