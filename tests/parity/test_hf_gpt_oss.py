"""gpt-oss against transformers (fp32): attention sinks, alternating windowed and full layers, biased
attention, clamped SwiGLU experts with biases (fused, gate and up interleaved), a biased router
taking a softmax over its top-k logits, YaRN; converted, then exported and reloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import save_hf  # noqa: E402
from test_hf_parity import assert_routing_decides, assert_same_model, tokens  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moekit.convert import ConversionError, from_hf, to_hf  # noqa: E402

ODD = dict(vocab_size=97, num_hidden_layers=4)


def save_gpt_oss(directory: Path, **overrides) -> torch.nn.Module:
    """``save_hf`` with token embeddings large beside the biases every token shares (attention
    output, expert down projections), so that routing depends on the token and reaches every expert."""
    model = save_hf("gpt_oss", directory, router_scale=4.0, **ODD | overrides)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(6)
    model.save_pretrained(directory)
    return model


def test_gpt_oss_converts_and_exports(tmp_path: Path) -> None:
    hf_model = save_gpt_oss(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    cfg, moe = ours.cfg, ours.moe_cfg
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.attn_out_bias and cfg.head_size == 12
    assert [cfg.window(i) for i in range(4)] == [5, 0, 5, 0] and cfg.rope_scaling == "yarn"
    assert moe.activation == "clamped_swiglu" and moe.swiglu_limit == 0.5 and moe.expert_ffn_bias and moe.router_bias
    assert_routing_decides(ours)
    ids = tokens(97, (2, 24))
    with torch.no_grad():  # the clamp is reached: the test would pass a plain SwiGLU otherwise
        h = ours.blocks[0].ffn_norm(ours.embed(ids)).flatten(0, 1) @ ours.blocks[0].ffn.experts.w_in[0]
    assert (h.abs() > moe.swiglu_limit).float().mean() > 0.2
    assert_same_model(hf_model, ours)
    assert to_hf(ours, tmp_path / "out").model_type == "gpt_oss"
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert exported["rope_parameters"]["rope_type"] == "yarn"
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)


def test_gpt_oss_layer_types_and_defaults(tmp_path: Path) -> None:
    """Every third block full, plain RoPE, no attention biases."""
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    rope = dict(rope_type="default", rope_theta=10000.0)
    hf_model = save_gpt_oss(
        tmp_path / "hf", num_hidden_layers=6, layer_types=layer_types, attention_bias=False, rope_parameters=rope
    )
    ours = from_hf(tmp_path / "hf")
    assert ours.cfg.full_attention_every == 3 and not ours.cfg.qkv_bias and ours.cfg.rope_scaling == "none"
    assert_same_model(hf_model, ours)
    to_hf(ours, tmp_path / "out")
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)


def test_gpt_oss_what_does_not_fit_is_named(tmp_path: Path) -> None:
    save_hf("gpt_oss", tmp_path / "hf", **ODD)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    irregular = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"layer_types": irregular}))
    with pytest.raises(ConversionError, match="gpt_oss: layer_types"):
        from_hf(tmp_path / "hf")
    rope = dict(config["rope_parameters"], partial_rotary_factor=0.5)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"rope_parameters": rope}))
    with pytest.raises(ConversionError, match="gpt_oss: partial_rotary_factor"):
        from_hf(tmp_path / "hf")


@pytest.mark.parametrize("window", [4, 0], ids=["windowed", "every-block-full"])
def test_native_model_with_sinks_exports_as_gpt_oss(tmp_path: Path, window: int) -> None:
    """A model trained from scratch with sinks and clamped SwiGLU experts but no biases: written with
    zero biases, and read back with the same logits. Without a window every block is full attention
    (transformers' gpt-oss still needs a window: the context)."""
    from moekit.config import ModelConfig, MoEConfig
    from moekit.model import Transformer

    torch.manual_seed(0)
    model_cfg = ModelConfig(
        vocab_size=81, context_length=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
        attn_sinks=True, sliding_window=window, full_attention_every=2,
    )  # fmt: skip
    moe = MoEConfig(
        d_model=32, d_ff=24, num_experts=5, top_k=2, activation="clamped_swiglu", softmax_before_topk=False,
        swiglu_limit=1.0,
    )  # fmt: skip
    ours = Transformer(model_cfg, moe).eval()
    with torch.no_grad():
        for block in ours.blocks:
            block.ffn.router.gate.weight.mul_(8)
            block.attn.sinks.normal_(std=1.0)
    assert to_hf(ours, tmp_path / "out").model_type == "gpt_oss"
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)
    again = from_hf(tmp_path / "out")
    ids = tokens(81, (2, 24))
    with torch.no_grad():
        assert (again(ids).logits - ours(ids).logits).abs().max().item() < 1e-5


# Tiny DeepSeek shapes that transformers' default groups (V3: 8 groups, the best 4) and dense blocks fit.
MLA_SIZES = dict(
    hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=3,
    kv_lora_rank=12, qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=14, n_routed_experts=16,
    num_experts_per_tok=4,
)  # fmt: skip


@pytest.mark.parametrize(
    "family",
    ["gpt_oss", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v2", "deepseek_v3"]
    + ["mistral", "qwen2", "llama"],
)
def test_a_config_json_without_defaults_reads_as_transformers_fills_it(family: str) -> None:
    """Fields a config.json leaves out mean transformers' defaults (gpt-oss: YaRN, window 128, biases;
    Mixtral: theta 1e6; Mixtral and OLMoE: norm eps 1e-5; DeepSeek-V3: routed_scaling_factor 2.5, groups;
    Mistral: a window of 4096; every family: its context)."""
    import transformers as tf
    from hf_models import hf_config

    from moekit.convert.hf_config import configs_from_hf

    if family.startswith("deepseek"):
        make = tf.DeepseekV3Config if family == "deepseek_v3" else tf.DeepseekV2Config
        minimal = dict(model_type=family, vocab_size=97, max_position_embeddings=64, **MLA_SIZES)
    else:
        full = hf_config(family, vocab_size=97).to_dict()
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers")
        sizes += ("num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok")
        sizes += ("num_experts", "shared_expert_intermediate_size")
        minimal = {k: full[k] for k in ("model_type", *sizes, "max_position_embeddings") if k in full}
        make = type(hf_config(family))
    made = make(**{k: v for k, v in minimal.items() if k != "model_type"})
    assert configs_from_hf(minimal) == configs_from_hf(made.to_dict())
    del minimal["max_position_embeddings"]  # the context (and Mistral's window) left out too
    made = make(**{k: v for k, v in minimal.items() if k != "model_type"})
    assert configs_from_hf(minimal) == configs_from_hf(made.to_dict())
