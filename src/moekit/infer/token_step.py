"""A decode step of one sequence, with the ops one token needs.

At batch 1 on a CPU every op and module call around the weight products costs microseconds, and the
MoE layer's general path (built for thousands of tokens) routes, sorts, counts, gathers, computes
and scatters rows: a d1024 step made about 935 ops, a fifth of its time outside the products.
``token_step`` computes what ``model(token, cache=cache)`` computes, bit for bit
(tests/unit/test_infer_token_step.py), through the model's own modules and functions and the cache's
own attention (a ``KVCache`` or a serving step's ``PagedStep``), and leaves out what one token does
not need: the dispatcher (its picks are its rows), the routing statistics, the blocks' wrappers.
``decode_step`` and the serving engine take it wherever ``takes`` says they may.

Legend: D model dim, K picks per token, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.dispatch import LocalDispatcher
from moekit.infer.resident_experts import PerExpert
from moekit.layer import MoE
from moekit.model.rope import apply_rope
from moekit.model.transformer import Attention, Block, Cache, Transformer
from moekit.routing import TopKRouter


def takes(model: Transformer, token_B1: Tensor) -> bool:
    """Whether ``token_step`` computes this step exactly: one token of one sequence, a model in eval
    mode whose every block it handles (standard attention; token-choice routers over experts computed
    one at a time from memory, prepacked or quantized: ``PerExpert``) and in which no module it does
    not call has hooks (blocks' forward pre-hooks excepted: it runs them). Checked at each step, so a
    model whose modules were swapped or hooked since is never computed from stale ones."""
    if token_B1.numel() != 1 or model.training or _global_hooks():
        return False
    return all(_computes_exactly(block) for block in model.blocks)


def token_step(model: Transformer, token_11: Tensor, cache: Cache, loads: list[Tensor] | None = None) -> Tensor:
    """``model(token, cache=cache).logits[:, -1]`` for a step ``takes`` allows: logits ``[1, V]``. ``loads``:
    where to append each MoE layer's tokens per expert (the forward's ``MoEStats.tokens_per_expert``).
    Each block's forward pre-hooks run before it, with the arguments the forward gives it (the serving
    engine stops between layers through them); one that returns new arguments is refused."""
    freqs = cache.rope(model.rope_freqs, 1)
    x = model.embed(token_11)  # [1, 1, D]
    for i, block in enumerate(model.blocks):
        for hook in block._forward_pre_hooks.values():
            if hook(block, (x, freqs, cache, i, token_11, False)) is not None:
                raise RuntimeError(f"a forward pre-hook of block {i} returned new arguments: run the model instead")
        x = x + _attention(block.attn, block.attn_norm(x), freqs, cache, i)
        h = block.ffn_norm(x)
        x = x + (_moe(block.ffn, h, loads) if isinstance(block.ffn, MoE) else block.ffn(h))
    cache.advance(1)
    return model.lm_head(model.norm(x))[:, -1]


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _computes_exactly(block: Block) -> bool:
    """Whether ``token_step`` computes this block as its forward does (dropout off: eval mode)."""
    attn, ffn = block.attn, block.ffn
    if not isinstance(attn, Attention) or block._forward_hooks or _hooked(attn):
        return False
    if not isinstance(ffn, MoE):
        return True
    # NOTE: a capacity limit drops nothing at one token: each expert gets at most one row, and a
    # capacity is at least one.
    return (
        isinstance(ffn.router, TopKRouter)
        and isinstance(ffn.dispatcher, LocalDispatcher)
        and isinstance(ffn.experts, PerExpert)
        and not (_hooked(ffn) or _hooked(ffn.router) or _hooked(ffn.experts))
    )


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a module ``token_step`` does not call has hooks its forward would run."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _attention(attn: Attention, x_11D: Tensor, freqs: Tensor, cache: Cache, layer: int) -> Tensor:
    """``attn(x, freqs, cache, layer)`` for one token: the same projections, RoPE and cache, fewer views."""
    Q, d = attn.q_per_group, attn.head_dim
    h = attn.qkv(x_11D).view(1, 1, -1, Q + 2, d)  # [1, 1, G, Q + 2, d], as Attention.forward
    if attn.qk_norm is not None:
        h = attn.qk_norm(h)
    qk = apply_rope(h[..., : Q + 1, :], freqs)
    q_1H1d = qk[..., :Q, :].reshape(1, -1, 1, d)
    k_1G1d, v_1G1d = qk[..., Q, :].transpose(1, 2), h[..., Q + 1, :].transpose(1, 2)
    y = cache.attend(layer, q_1H1d, k_1G1d, v_1G1d, attn.window, attn.sinks)
    return attn.out(y.transpose(1, 2).reshape(1, 1, -1))


def _moe(moe: MoE, h_11D: Tensor, loads: list[Tensor] | None) -> Tensor:
    """``moe(h)`` for one token: each picked expert's output, in the dispatcher's order (by expert),
    weighted and summed as ``LocalDispatcher.combine`` sums one token's rows."""
    x_1D = h_11D.view(1, -1)
    _, _, weights_1K, experts_1K = moe.router.pick(x_1D)
    if loads is not None:
        loads.append(torch.bincount(experts_1K[0], minlength=moe.cfg.num_experts))
    picked = experts_1K[0].tolist()
    order = sorted(range(len(picked)), key=picked.__getitem__)
    experts = moe.experts
    y_KD = torch.cat([experts.compute(x_1D, *experts.kernels(picked[k]), picked[k]) for k in order])
    weights_K = weights_1K[0, order]
    y_1D = (y_KD * weights_K.unsqueeze(1).to(y_KD.dtype)).sum(0, keepdim=True)
    return moe.add_dense(x_1D, y_1D).to(h_11D.dtype).view_as(h_11D)
