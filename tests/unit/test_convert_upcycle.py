"""Sparse upcycling: the upcycled model equals its dense parent at step 0."""

from __future__ import annotations

import pytest
import torch

from moekit.config import ModelConfig
from moekit.convert.upcycle import expert_slices, upcycle
from moekit.errors import OptionError
from moekit.experts import DenseFFN
from moekit.model import Transformer

TOL = 1e-5  # fp32: the same products summed in another order


def dense_model(activation: str = "swiglu", norm: str = "rmsnorm") -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50, context_length=16, n_layers=2, n_heads=2, d_model=16, d_ff=24,
        mlp_activation=activation, norm=norm, moe_every=0,
    )  # fmt: skip
    return Transformer(cfg).eval()


def logits(model: Transformer, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(model.cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(("activation", "norm"), [("swiglu", "rmsnorm"), ("gelu", "layernorm")])
def test_upcycled_model_equals_dense_at_step_zero(activation: str, norm: str) -> None:
    dense = dense_model(activation, norm)
    moe = upcycle(dense, num_experts=4, top_k=2)
    assert len(moe.moe_layers()) == 2 and moe.moe_cfg.activation == activation
    assert (logits(moe) - logits(dense)).abs().max().item() < TOL


def test_noise_moves_the_experts_apart() -> None:
    dense = dense_model()
    moe = upcycle(dense, num_experts=4, top_k=2, noise=0.05)
    experts = moe.moe_layers()[0].experts.w_in
    assert not torch.equal(experts[0], experts[1])
    gap = (logits(moe) - logits(dense)).abs().max().item()
    assert TOL < gap < 0.5


def test_slices_sum_to_the_dense_mlp() -> None:
    """The reference: the dense FFN itself, against the sum of its slices computed one by one."""
    torch.manual_seed(0)
    for activation in ("swiglu", "gelu"):
        ffn = DenseFFN(8, 12, activation)
        gate = ffn.w_gate.weight if ffn.w_gate is not None else None
        w_in, w_out = expert_slices(gate, ffn.w_in.weight, ffn.w_out.weight, 3)
        assert w_in.shape == (3, 8, 8 if activation == "swiglu" else 4) and w_out.shape == (3, 4, 8)
        x = torch.randn(5, 8)
        pieces = []
        for g in range(3):
            h = x @ w_in[g]
            act = (
                torch.nn.functional.silu(h[:, :4]) * h[:, 4:] if activation == "swiglu" else torch.nn.functional.gelu(h)
            )
            pieces.append(act @ w_out[g])
        torch.testing.assert_close(sum(pieces), ffn(x), atol=1e-6, rtol=1e-5)


def test_finer_experts_equal_dense_on_the_dense_dts_start() -> None:
    """split=2: a token on all experts with equal weights (zero router, DTS step 0) computes the dense MLP."""
    dense = dense_model()
    moe = upcycle(dense, num_experts=4, top_k=2, split=2, moe_overrides={"dts_steps": 10})
    assert moe.moe_cfg.d_ff == 12
    for layer in moe.moe_layers():
        layer.set_step(0)
    assert (logits(moe) - logits(dense)).abs().max().item() < TOL
    for layer in moe.moe_layers():  # a trained router, annealed to top-2 of 4 slices: no longer the dense MLP
        layer.router.gate.weight.data.normal_()
        layer.set_step(10)
    assert (logits(moe) - logits(dense)).abs().max().item() > TOL


def test_upcycle_rejects_bad_requests() -> None:
    dense = dense_model()
    with pytest.raises(ValueError, match="split=3: must be >= 1 and divide num_experts=4"):
        upcycle(dense, 4, 2, split=3)
    with pytest.raises(OptionError, match=r"^top_k=5: cannot exceed num_experts=4$"):  # upcycle's arguments
        upcycle(dense, 4, 5)
    with pytest.raises(OptionError, match=r"^num_experts=0: must be a positive integer$"):
        upcycle(dense, 0, 2)
    moe = upcycle(dense, 4, 2)
    with pytest.raises(ValueError, match="already has MoE blocks"):
        upcycle(moe, 4, 2)
    for noise in (-0.1, float("inf"), float("nan")):  # inf wrote non-finite experts, nan no noise at all
        with pytest.raises(ValueError, match="noise=.*: must be a finite number >= 0"):
            upcycle(dense, 4, 2, noise=noise)
