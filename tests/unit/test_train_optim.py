"""AdamW's weight decay is decided by a parameter's role (its name), not its number of dimensions."""

from __future__ import annotations

import torch

from moekit.config import ModelConfig, MoEConfig, TrainConfig
from moekit.model import Transformer
from moekit.train.optim import build_optimizer, decays

# Every parameter of ``_model()`` with its decay, written out: a new parameter must be added here on purpose.
BLOCK_DECAY = {
    "attn_norm.weight": False, "attn.sinks": False, "attn.qkv.weight": True, "attn.qkv.bias": False,
    "attn.qk_norm.q.weight": False, "attn.qk_norm.k.weight": False, "attn.out.weight": True,
    "attn.out.bias": False, "ffn_norm.weight": False, "ffn.router.gate.weight": True,
    "ffn.router.gate.bias": False, "ffn.experts.w_in": True, "ffn.experts.w_out": True,
    "ffn.experts.w_in_bias": False, "ffn.experts.w_out_bias": False, "ffn.shared.w_gate.weight": True,
    "ffn.shared.w_in.weight": True, "ffn.shared.w_out.weight": True, "ffn.shared_gate.weight": True,
}  # fmt: skip
MODEL_DECAY = {"embed.weight": True, "norm.weight": False, "lm_head.weight": True} | {
    f"blocks.{i}.{name}": decay for i in range(2) for name, decay in BLOCK_DECAY.items()
}


def _model() -> Transformer:
    """Every kind of parameter: stacked expert biases [E, F], norms, q/k norms, sinks, router bias, MLA norms."""
    torch.manual_seed(0)
    model = ModelConfig(
        vocab_size=64, context_length=16, n_layers=2, n_heads=4, d_model=32, d_ff=48,
        qk_norm=True, qkv_bias=True, attn_sinks=True, attn_out_bias=True, tie_embeddings=False,
    )  # fmt: skip
    moe = MoEConfig(
        d_model=32, d_ff=24, num_experts=4, top_k=2, num_shared_experts=1, shared_expert_gate=True,
        expert_ffn_bias=True, router_bias=True,
    )  # fmt: skip
    return Transformer(model, moe)


def test_roles_not_shapes_decide_decay() -> None:
    model = _model()
    names = dict(model.named_parameters())
    assert names["blocks.0.ffn.experts.w_in_bias"].dim() == 2  # the case a dim rule got wrong
    assert sorted(names) == sorted(MODEL_DECAY)
    for name, decay in MODEL_DECAY.items():
        assert decays(name) == decay, name
    # wrappers' prefixes do not change a role
    assert not decays("_orig_mod.blocks.0._checkpoint_wrapped_module.attn_norm.weight")
    assert decays("_orig_mod.blocks.0._checkpoint_wrapped_module.attn.qkv.weight")


def test_a_step_decays_weights_and_leaves_biases_and_norms() -> None:
    """With zero gradients AdamW's update is the decay alone: weights shrink by lr * wd, the rest stay."""
    model = _model()
    cfg = TrainConfig(lr=0.1, weight_decay=0.5)
    opt = build_optimizer(model.named_parameters(), cfg)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.5]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if decays(name) else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0, msg=name)


def test_tied_embedding_is_one_parameter() -> None:
    model = Transformer(
        ModelConfig(vocab_size=64, context_length=16, n_layers=1, n_heads=2, d_model=16, d_ff=32, tie_embeddings=True),
        MoEConfig(d_model=16, d_ff=8, num_experts=2, top_k=1),
    )
    named = [*model.named_parameters(remove_duplicate=False)]
    opt = build_optimizer(named, TrainConfig())
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
