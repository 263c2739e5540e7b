"""The load-balancing loss weight across conversion, against transformers' own
``load_balancing_loss_func`` (Mixtral's; Qwen2-MoE and OLMoE use the same function).

Reference: transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func.
Tolerance: 1e-6 relative (fp32; the same sums in a different order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import save_hf  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

from moekit.config import ModelConfig, MoEConfig  # noqa: E402
from moekit.convert import from_hf, to_hf  # noqa: E402
from moekit.convert.hf_config import configs_from_hf  # noqa: E402
from moekit.layer import MoE  # noqa: E402
from moekit.model import Transformer  # noqa: E402

RTOL = 1e-6
E, T = 6, 64


def router_logits(seed: int) -> torch.Tensor:
    """[T, E] logits with a skewed load, so the loss is far from its uniform value."""
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(T, E, generator=g) + torch.linspace(0, 2, E)


def moekit_aux(logits_TE: torch.Tensor, top_k: int) -> float:
    """moekit's aux loss of one MoE layer whose router logits are ``logits_TE`` (identity gate, x = logits)."""
    layer = MoE(MoEConfig(d_model=E, d_ff=4, num_experts=E, top_k=top_k))
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(E))
        _, stats = layer(logits_TE, return_stats=True)
    return stats.aux_loss.item()


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_transformers_loss_is_top_k_times_moekits(top_k: int) -> None:
    logits = router_logits(0)
    ours, theirs = moekit_aux(logits, top_k), load_balancing_loss_func((logits,), E, top_k).item()
    assert theirs == pytest.approx(top_k * ours, rel=RTOL)
    assert ours > 1.05, "a skewed load, not the uniform value 1"


def hf_mixtral_config(n_layers: int, top_k: int, coef: float) -> dict:
    return dict(
        model_type="mixtral",
        vocab_size=32,
        hidden_size=E,
        intermediate_size=4,
        num_hidden_layers=n_layers,
        num_attention_heads=1,
        num_local_experts=E,
        num_experts_per_tok=top_k,
        router_aux_loss_coef=coef,
    )


@pytest.mark.parametrize("n_layers", [1, 3])
@pytest.mark.parametrize("top_k", [2, 3])
def test_aux_weight_survives_import_and_export(n_layers: int, top_k: int, tmp_path: Path) -> None:
    """coef * loss is the same in moekit (one loss per layer, summed) and in transformers (one loss
    over all layers), on the same router logits in every layer, after conversion either way."""
    logits = router_logits(1)
    theirs = load_balancing_loss_func((logits,) * n_layers, E, top_k).item()
    ours = n_layers * moekit_aux(logits, top_k)  # the per-layer losses moekit adds up

    hf_coef = 0.02
    _, moe = configs_from_hf(hf_mixtral_config(n_layers, top_k, hf_coef))
    assert moe.aux_loss_coef * ours == pytest.approx(hf_coef * theirs, rel=RTOL)

    model_cfg = ModelConfig(vocab_size=32, context_length=16, n_layers=n_layers, n_heads=1, d_model=E, d_ff=8)
    native_coef = 0.01
    model = Transformer(model_cfg, MoEConfig(d_model=E, d_ff=4, num_experts=E, top_k=top_k, aux_loss_coef=native_coef))
    to_hf(model, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())["router_aux_loss_coef"]
    assert exported * theirs == pytest.approx(native_coef * ours, rel=RTOL)
    assert from_hf(tmp_path / "out").moe_cfg.aux_loss_coef == pytest.approx(native_coef, rel=RTOL)


def test_one_layer_model_weights_its_aux_loss_as_transformers_does(tmp_path: Path) -> None:
    """End to end on a converted one-MoE-layer Qwen2-MoE: transformers' weighted aux loss (from its
    own forward) equals the one moekit adds to the training loss."""
    hf_model = save_hf("qwen2_moe", tmp_path / "hf", router_scale=4.0, num_hidden_layers=1, router_aux_loss_coef=0.05)
    ours = from_hf(tmp_path / "hf")
    ids = torch.randint(96, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf_model(ids, output_router_logits=True).aux_loss.item()
        (stats,) = ours(ids).moe_stats
    assert ours.moe_cfg.aux_loss_coef * stats.aux_loss.item() == pytest.approx(0.05 * theirs, rel=1e-5)
