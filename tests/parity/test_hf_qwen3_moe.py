"""Qwen3-MoE against transformers (fp32): per-head q/k norms, a head size apart from hidden / heads,
dense blocks between MoE ones, renormalised top-k; converted, then exported and reloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import save_hf  # noqa: E402
from test_hf_parity import assert_routing_decides, assert_same_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moekit.convert import ConversionError, from_hf, to_hf  # noqa: E402

ODD = dict(vocab_size=97, num_hidden_layers=4)  # an odd vocabulary; blocks 0 (mlp_only) and 2 (sparse step 2) dense


@pytest.mark.parametrize("overrides", [{}, dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)])
def test_qwen3_moe_converts_and_exports(overrides: dict, tmp_path: Path) -> None:
    hf_model = save_hf("qwen3_moe", tmp_path / "hf", router_scale=4.0, **ODD | overrides)
    ours = from_hf(tmp_path / "hf")
    cfg = ours.cfg
    assert cfg.qk_head_norm and cfg.head_size == 12 and cfg.n_heads * cfg.head_size != cfg.d_model
    assert cfg.moe_layers() == ([1, 3] if overrides else [1, 2, 3])
    assert ours.moe_cfg.num_experts == 6 and ours.moe_cfg.normalize_topk == (not overrides)
    assert_routing_decides(ours)
    assert_same_model(hf_model, ours)
    assert to_hf(ours, tmp_path / "out").model_type == "qwen3_moe"
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["head_dim"] == 12 and exported["mlp_only_layers"] == ([0, 2] if overrides else [0])
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)


def test_qwen3_moe_attention_bias_and_sliding_window(tmp_path: Path) -> None:
    """attention_bias biases q/k/v and the output projection; use_sliding_window windows every block."""
    overrides = dict(attention_bias=True, use_sliding_window=True, sliding_window=6)
    hf_model = save_hf("qwen3_moe", tmp_path / "hf", router_scale=4.0, **ODD | overrides)
    ours = from_hf(tmp_path / "hf")
    assert ours.cfg.qkv_bias and ours.cfg.attn_out_bias and ours.cfg.sliding_window == 6
    assert all(ours.cfg.window(i) == 6 for i in range(ours.cfg.n_layers))
    assert_same_model(hf_model, ours)
    to_hf(ours, tmp_path / "out")
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    ("edit", "rope"),
    [
        # rope_scaling replaces rope_parameters outright; the top-level theta fills what it leaves out
        (dict(rope_scaling=YARN, rope_theta=5e5), ("yarn", 5e5)),
        # a theta inside rope_parameters wins over the top-level one
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_theta=1e6), ("none", 1e4)),
    ],
    ids=["rope_scaling_beside_rope_parameters", "conflicting_rope_theta"],
)
def test_rope_fields_read_as_transformers_reads_them(edit: dict, rope: tuple, tmp_path: Path) -> None:
    """Hand-edited RoPE fields (as a model card's context extension adds them) mean what they mean to transformers."""
    save_hf("qwen3_moe", tmp_path / "hf", router_scale=4.0, **ODD)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | edit))
    ours = from_hf(tmp_path / "hf")
    assert (ours.cfg.rope_scaling, ours.cfg.rope_theta) == rope
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), ours)


def test_qwen3_moe_what_does_not_fit_is_named(tmp_path: Path) -> None:
    save_hf("qwen3_moe", tmp_path / "hf", **ODD)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = dict(config["rope_parameters"], rope_type="llama3", factor=8.0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"rope_parameters": rope}))
    with pytest.raises(ConversionError, match="qwen3_moe: rope_type 'llama3'"):
        from_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu"}))
    with pytest.raises(ConversionError, match="qwen3_moe: hidden_act 'gelu'"):
        from_hf(tmp_path / "hf")


def test_native_qwen3_style_model_exports(tmp_path: Path) -> None:
    """A model trained from scratch with per-head q/k norms and its own head size is written as Qwen3-MoE."""
    from moekit.config import ModelConfig, MoEConfig
    from moekit.model import Transformer

    torch.manual_seed(0)
    model_cfg = ModelConfig(
        vocab_size=81, context_length=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=10, d_model=32, d_ff=48,
        qk_head_norm=True, tie_embeddings=True,
    )  # fmt: skip
    ours = Transformer(model_cfg, MoEConfig(d_model=32, d_ff=24, num_experts=5, top_k=2)).eval()
    with torch.no_grad():
        for block in ours.blocks:
            block.ffn.router.gate.weight.mul_(8)
            block.attn.qk_norm.q.weight.normal_(1, 0.2)
    assert to_hf(ours, tmp_path / "out").model_type == "qwen3_moe"
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)
