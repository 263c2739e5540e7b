"""Sparse upcycling (Komatsuzaki et al. 2023): a dense model becomes an MoE whose experts start as its MLPs.

Every dense MLP becomes an MoE layer. With ``split = 1`` each expert is a copy of the MLP and the
router renormalises its top-k weights to sum to 1, so whatever the (random) router picks, the
upcycled model computes exactly the dense model at step 0; training then pulls the copies apart.
The router renormalises only two or more picks (one keeps its raw probability), so top_k >= 2.
With ``split = s`` the MLP's hidden units are cut into s slices (finer experts, as in Qwen-MoE's
upcycling); expert e holds slice ``e mod s`` scaled by s and the router starts at zero, so a token
on all experts with equal weights (the DTS gate's dense start) again computes the dense MLP exactly.

Legend: E experts, D model dim, F dense hidden dim, f = F / split expert hidden dim.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from moekit.config import MoEConfig
from moekit.errors import OptionError
from moekit.model import Transformer


def expert_slices(w_gate: Tensor | None, w_in: Tensor, w_out: Tensor, split: int) -> tuple[Tensor, Tensor]:
    """A dense MLP's ``w_gate`` (SwiGLU only) and ``w_in [F, D]``, ``w_out [D, F]`` (nn.Linear layout)
    cut into ``split`` experts in moekit's ``[s, D, 2f or f]`` and ``[s, f, D]`` layout (gate first);
    the slices' outputs sum to the MLP's.

    For SwiGLU the gate and up projections are sliced alike, so each slice keeps its own gate units.
    """
    halves = (w_gate, w_in) if w_gate is not None else (w_in,)
    pieces = [h.chunk(split) for h in halves]  # per half, `split` row blocks of f rows
    w_in_s = torch.stack([torch.cat([p[g] for p in pieces]).t() for g in range(split)])
    w_out_s = torch.stack([block.t() for block in w_out.chunk(split, dim=1)])
    return w_in_s, w_out_s


def upcycle(
    dense: Transformer,
    num_experts: int,
    top_k: int,
    *,
    split: int = 1,
    noise: float = 0.0,
    seed: int = 0,
    moe_overrides: dict[str, Any] | None = None,
) -> Transformer:
    """The MoE model upcycled from ``dense``; ``noise`` > 0 perturbs each expert by that fraction of its weights' std.

    ``moe_overrides``: further MoE settings (aux-loss weight, DTS gate, ...); top-k weights are
    always renormalised, which is what keeps the step-0 outputs equal to the dense model's.
    """
    cfg = dense.cfg
    if cfg.moe_layers():
        raise ValueError("upcycle: the model already has MoE blocks (model.moe_every > 0); give a dense model")
    if num_experts < 1:  # checked here, as MoEConfig would, to name the argument as the caller passed it
        raise OptionError("num_experts", "must be a positive integer", num_experts)
    if top_k < 2:  # the router renormalises only k > 1 picks: one pick would weigh the MLP by its raw probability
        raise OptionError("top_k", "upcycling needs 2 or more to start as the dense model exactly", top_k)
    if top_k > num_experts:
        raise OptionError("top_k", "cannot exceed {num_experts}", top_k, num_experts=num_experts)
    if split < 1 or num_experts % split:
        raise OptionError("split", "must be >= 1 and divide {num_experts}", split, num_experts=num_experts)
    if cfg.d_ff % split:
        raise OptionError("split", f"must divide the dense MLP width model.d_ff={cfg.d_ff}", split)
    if not (math.isfinite(noise) and noise >= 0):
        raise OptionError("noise", "must be a finite number >= 0", noise)
    settings = dict(moe_overrides or {}) | {"normalize_topk": True, "softmax_before_topk": True}
    moe_cfg = MoEConfig(
        d_model=cfg.d_model,
        d_ff=cfg.d_ff // split,
        num_experts=num_experts,
        top_k=top_k,
        activation=cfg.mlp_activation,
        **settings,
    )
    model = Transformer(replace(cfg, moe_every=1, first_dense_layers=0, experts_per_layer=None), moe_cfg)
    # Embeddings, attention and norms keep their names; only the FFNs differ (filled below).
    missing, unexpected = model.load_state_dict(dense.state_dict(), strict=False)
    stray = [name for name in [*missing, *unexpected] if not re.match(r"blocks\.\d+\.ffn\.", name)]
    if stray:
        raise ValueError(f"the dense model's weights differ from the MoE model's outside the FFNs: {stray[:3]}")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block, dense_block in zip(model.blocks, dense.blocks, strict=True):
            moe, mlp = block.ffn, dense_block.ffn
            gate = mlp.w_gate.weight if mlp.w_gate is not None else None
            w_in, w_out = expert_slices(gate, mlp.w_in.weight, split * mlp.w_out.weight, split)
            copies = num_experts // split
            moe.experts.w_in.copy_(w_in.repeat(copies, 1, 1))
            moe.experts.w_out.copy_(w_out.repeat(copies, 1, 1))
            if noise > 0:
                for w in (moe.experts.w_in, moe.experts.w_out):
                    w.add_(noise * w.std() * torch.randn(w.shape, generator=generator))
            if split > 1:
                moe.router.gate.weight.zero_()
    return model.train(dense.training)
