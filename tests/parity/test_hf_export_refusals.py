"""Export refuses, in one line naming the field or tensor, a model whose biases the written family has no
place for: writing it without them would give transformers a model with other logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moekit.config import ModelConfig, MoEConfig
from moekit.convert import ConversionError, to_hf
from moekit.model import Transformer

MLA = dict(attention="mla", n_heads=3, kv_lora_rank=12, qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=14)
V2 = dict(num_shared_experts=1, normalize_topk=False)  # softmax routing: written as DeepSeek-V2
V3 = dict(num_shared_experts=1, score_func="sigmoid")  # written as DeepSeek-V3


def model(attention: dict, moe: dict, expert_bias: float = 0.0) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(**dict(vocab_size=80, context_length=64, n_layers=2, n_heads=4, d_model=48, d_ff=40) | attention)
    ours = Transformer(cfg, MoEConfig(d_model=48, d_ff=24, num_experts=4, top_k=2, **moe)).eval()
    with torch.no_grad():
        for block in ours.blocks:
            block.ffn.router.expert_bias.copy_(torch.tensor([expert_bias, -expert_bias, 0.0, 0.0]))
    return ours


@pytest.mark.parametrize(
    ("attention", "moe", "expert_bias", "message"),
    [
        ({}, {}, 0.5, "MixtralForCausalLM: blocks.0.ffn.router.expert_bias is nonzero (aux-loss-free balancing"),
        (MLA, V2, 0.5, "DeepseekV2ForCausalLM: blocks.0.ffn.router.expert_bias is nonzero"),
        (MLA, V2 | dict(bias_update_rate=0.01), 0.0, "deepseek_v2: moe.bias_update_rate=0.01 does not fit"),
        (MLA, V3 | dict(router_bias=True), 0.0, "deepseek_v3: moe.router_bias=True does not fit"),
        (MLA, V3 | dict(expert_ffn_bias=True), 0.0, "deepseek_v3: moe.expert_ffn_bias=True does not fit"),
        (MLA, V2 | dict(expert_ffn_bias=True), 0.0, "deepseek_v2: moe.expert_ffn_bias=True does not fit"),
    ],
    ids=["mixtral-expert-bias", "v2-expert-bias", "v2-update-rate", "v3-router-bias", "v3-ffn-bias", "v2-ffn-bias"],
)
def test_biases_without_a_place_are_refused(
    attention: dict, moe: dict, expert_bias: float, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConversionError) as err:
        to_hf(model(attention, moe, expert_bias), tmp_path / "out")
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value
    assert not (tmp_path / "out").exists(), "nothing is written"


def test_a_zero_balancing_bias_is_left_out(tmp_path: Path) -> None:
    """A selection bias at zero changes no routing, so a family without one can still hold the model."""
    assert to_hf(model({}, {}), tmp_path / "out").model_type == "mixtral"
