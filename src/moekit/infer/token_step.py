"""A decode step of one sequence, with the ops one token needs.

At batch 1 on a CPU every op and module call around the weight products costs microseconds, and the
MoE layer's general path (built for thousands of tokens) routes, sorts, counts, gathers, computes
and scatters rows: a d1024 step made about 935 ops, a fifth of its time outside the products.
``token_step`` computes what ``model(token, cache=cache)`` computes, bit for bit
(tests/unit/test_infer_token_step.py), through the model's own modules and functions, and leaves out
what one token does not need: the dispatcher (its picks are its rows), the routing statistics, the
blocks' wrappers, the cache's mask logic. ``decode_step`` takes it wherever ``takes`` says it may.

Legend: D model dim, K picks per token, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.dispatch import LocalDispatcher
from moekit.infer.resident_experts import PerExpert
from moekit.layer import MoE
from moekit.model.rope import apply_rope
from moekit.model.sdpa import one_query
from moekit.model.transformer import Attention, Block, Cache, KVCache, Transformer
from moekit.routing import TopKRouter


def takes(model: Transformer, token_B1: Tensor, cache: Cache) -> bool:
    """Whether ``token_step`` computes this step exactly: one token of one unpadded sequence through a
    ``KVCache``, a model in eval mode whose every block it handles (standard attention without
    windows or sinks; token-choice routers over experts computed one at a time from memory,
    prepacked or quantized: ``PerExpert``). Checked at each step, so a model whose modules were
    swapped since is never computed from stale ones."""
    if token_B1.numel() != 1 or not isinstance(cache, KVCache) or cache.left_pad is not None or cache.mla_expanded:
        return False
    return not model.training and all(_computes_exactly(block) for block in model.blocks)


def token_step(model: Transformer, token_11: Tensor, cache: KVCache) -> Tensor:
    """``model(token, cache=cache).logits[:, -1]`` for a step ``takes`` allows: logits ``[1, V]``."""
    freqs = cache.rope(model.rope_freqs, 1)
    x = model.embed(token_11)  # [1, 1, D]
    for i, block in enumerate(model.blocks):
        x = x + _attention(block.attn, block.attn_norm(x), freqs, cache, i)
        h = block.ffn_norm(x)
        x = x + (_moe(block.ffn, h) if isinstance(block.ffn, MoE) else block.ffn(h))
    cache.advance(1)
    return model.lm_head(model.norm(x))[:, -1]


def _computes_exactly(block: Block) -> bool:
    """Whether ``TokenStep`` computes this block as its forward does (dropout off: eval mode)."""
    if not isinstance(block.attn, Attention) or block.attn.window or block.attn.sinks is not None:
        return False
    moe = block.ffn
    if not isinstance(moe, MoE):
        return True
    # NOTE: a capacity limit drops nothing at one token: each expert gets at most one row, and a
    # capacity is at least one.
    return (
        isinstance(moe.router, TopKRouter)
        and isinstance(moe.dispatcher, LocalDispatcher)
        and isinstance(moe.experts, PerExpert)
    )


def _attention(attn: Attention, x_11D: Tensor, freqs: Tensor, cache: KVCache, layer: int) -> Tensor:
    """``attn(x, freqs, cache, layer)`` for one token of one sequence (``KVCache.attend`` without a mask:
    no window, no sinks, no padding): its keys and values written at the cache's position, its
    queries against every cached key (``one_query``)."""
    Q, d = attn.q_per_group, attn.head_dim
    h = attn.qkv(x_11D).view(1, 1, -1, Q + 2, d)  # [1, 1, G, Q + 2, d], as Attention.forward
    if attn.qk_norm is not None:
        h = attn.qk_norm(h)
    qk = apply_rope(h[..., : Q + 1, :], freqs)
    pos = cache.length
    keys, values = cache.keys[layer], cache.values[layer]  # [1, G, S, d]
    keys[0, :, pos] = qk[0, 0, :, Q]
    values[0, :, pos] = h[0, 0, :, Q + 1]
    q_1H1d = qk[..., :Q, :].reshape(1, -1, 1, d)
    y = one_query(q_1H1d, keys[:, :, : pos + 1], values[:, :, : pos + 1], None, d**-0.5)
    return attn.out(y.view(1, 1, -1))


def _moe(moe: MoE, h_11D: Tensor) -> Tensor:
    """``moe(h)`` for one token: each picked expert's output, in the dispatcher's order (by expert),
    weighted and summed as ``LocalDispatcher.combine`` sums one token's rows."""
    x_1D = h_11D.view(1, -1)
    _, _, weights_1K, experts_1K = moe.router.pick(x_1D)
    picked = experts_1K[0].tolist()
    order = sorted(range(len(picked)), key=picked.__getitem__)
    experts = moe.experts
    y_KD = torch.cat([experts.compute(x_1D, *experts.kernels(picked[k]), picked[k]) for k in order])
    weights_K = weights_1K[0, order]
    y_1D = (y_KD * weights_K.unsqueeze(1).to(y_KD.dtype)).sum(0, keepdim=True)
    return moe.add_dense(x_1D, y_1D).to(h_11D.dtype).view_as(h_11D)
