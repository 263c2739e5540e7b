"""A decode step of one sequence, with the ops one token needs.

At batch 1 on a CPU every op and module call around the weight products costs microseconds, and the
MoE layer's general path (built for thousands of tokens) routes, sorts, counts, gathers, computes and
scatters one token's two rows. ``token_step`` computes what ``model(token, cache=cache)`` computes, bit
for bit (tests/unit/test_infer_token_step.py; the row layout's C calls below aside), through the
model's own modules and the cache's own attention (a ``KVCache`` or a serving step's ``PagedStep``), and
leaves out what one token does not need: the dispatcher (its picks are its rows), the routing
statistics, the modules' call wrappers.
``decode_step`` and the serving engine take it wherever ``takes`` says they may: prepacked experts (fp32,
or 16 bits on a CPU with native kernels), bf16 ones kept plain for the row kernel (every bf16 load on
a CPU without native bf16), and quantized ones; plain grouped experts (fp16 on other CPUs, a GPU) and
offloaded ones run the forward. What it saves:
``python benchmarks/decode_split.py``.

In the row layout, and for int8 weights where the int8 row kernel runs, a block's attention half
(``fuses_attention``) and a MoE layer with a softmax top-k router and SwiGLU experts (``fuses``) are one
C call each, residual included (``kernels.attention_token_bf16``, ``kernels.moe_token_bf16``): the ops
they replace cost more than the products around them on a CPU without AVX-512 (``python
benchmarks/decode_split.py DIR``'s "with the C calls"). The attention's call rounds as the forward
does and equals it bit for bit. The MoE call sums the router's fp32 logits in its own order and takes
silu's and the softmax's exp from the C library: where that tips a bf16 rounding, the step parts from
the forward's by a few bf16 units (tests/unit/test_infer_token_step.py bounds it); where it tips a
near-tie between two experts' scores, it picks the other expert, as a different batch of the forward
could. Where every block takes both calls (``fuses_every_block``: MoE layers only, no block pre-hooks),
the blocks take one call together (``kernels.blocks_token_bf16``), the feed-forward RMSNorms inside it:
the same sums, and no Python between the blocks (a d1024 bf16 step 21.1 ms against 22.5 with a call
per block half: ``python benchmarks/decode_split.py DIR``,
``benchmarks/measured/decode-split-d1024-avx2-blocks.json``). ``ONE_CALL`` turns that off, ``C_CALLS``
all of them.

Legend: D model dim, K picks per token, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.dispatch import LocalDispatcher
from moekit.infer.quant import INT8_ROW_KERNEL_ISAS
from moekit.infer.resident_experts import (
    PerExpert,
    QuantizedExperts,
    QuantizedLinear,
    RowExperts,
    RowLinear,
    RowRMSNorm,
)
from moekit.kernels import (
    MAX_EXPERTS,
    AttentionWeights,
    BlockWeights,
    MoEWeights,
    attention_token_bf16,
    blocks_token_bf16,
    moe_token_bf16,
    rows_available,
    rows_isa,
)
from moekit.layer import MoE
from moekit.model.transformer import Attention, Block, Cache, KVCache, Transformer
from moekit.routing import TopKRouter


def takes(model: Transformer, token_B1: Tensor) -> bool:
    """Whether ``token_step`` computes this step as the forward does (bit for bit, the row layout's MoE call
    aside: module docstring): one token of one sequence, a model in eval mode
    whose every block it handles (standard attention; token-choice routers over experts computed one at
    a time from memory, prepacked, kept plain or quantized: ``PerExpert``) and in which no module it does
    not call has hooks (blocks' forward pre-hooks excepted: it runs them) or a replaced forward (a compiled
    block). Checked at each step, so a model whose modules were swapped or hooked since is never
    computed from stale ones."""
    if token_B1.numel() != 1 or not _plain(model, Transformer) or _hooked(model) or _global_hooks():
        return False
    return _inactive(model.drop) and all(_computes_exactly(block) for block in model.blocks)


def token_step(model: Transformer, token_11: Tensor, cache: Cache, loads: list[Tensor] | None = None) -> Tensor:
    """``model(token, cache=cache).logits[:, -1]`` for a step ``takes`` allows: logits ``[1, V]``. ``loads``:
    where to append each MoE layer's tokens per expert (the forward's ``MoEStats.tokens_per_expert``).
    Each block's forward pre-hooks run before it, as a module call runs them (the serving engine stops
    between layers through them); a block whose pre-hooks return new arguments runs its own forward
    on them."""
    freqs = cache.rope(model.rope_freqs, 1)
    rope_d2 = torch.view_as_real(freqs[0]) if freqs.dtype == torch.complex64 else None  # (cos, sin) for C
    x = model.embed(token_11)  # [1, 1, D]
    if rope_d2 is not None and fuses_every_block(model, x, cache):
        x = _fused_blocks(model, x, rope_d2, cache, loads)
    else:
        x = _blocks(model, x, freqs, rope_d2, cache, token_11, loads)
    cache.advance(1)
    return model.lm_head(model.norm(x))[:, -1]


def _blocks(
    model: Transformer,
    x: Tensor,
    freqs: Tensor,
    rope_d2: Tensor | None,
    cache: Cache,
    token_11: Tensor,
    loads: list[Tensor] | None,
) -> Tensor:
    """The residual stream after every block, block by block (each block's pre-hooks first)."""
    for i, block in enumerate(model.blocks):
        given = args = (x, freqs, cache, i, token_11, False)
        for hook in block._forward_pre_hooks.values():
            result = hook(block, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
        if args is not given:
            x, stats = block.forward(*args)
            if loads is not None and stats is not None:
                loads.append(stats.tokens_per_expert)
            continue
        # Block.forward in eval mode (its dropout an identity), the attention's own forward unwrapped
        if rope_d2 is not None and fuses_attention(block, cache, i, x):
            x = _fused_attention(block, x, rope_d2, cache, i)
        else:
            x = x + block.attn.forward(block.attn_norm(x), freqs, cache, i)
        h = block.ffn_norm(x)
        if not isinstance(block.ffn, MoE):
            x = x + block.ffn(h)
        elif fuses(block.ffn, h):
            x = _fused_moe(block.ffn, h, x, loads)
        else:
            x = x + _moe(block.ffn, h, loads)
    return x


def _global_hooks() -> bool:
    registry = torch.nn.modules.module
    return bool(registry._global_forward_hooks or registry._global_forward_pre_hooks)


def _computes_exactly(block: Block) -> bool:
    """Whether ``token_step`` computes this block as its forward does."""
    attn, ffn = block.attn, block.ffn
    if not (_plain(block, Block) and _plain(attn, Attention)) or _hooked(attn) or not _inactive(block.drop):
        return False
    # token_step runs a block's pre-hooks (positional arguments only), not its forward hooks
    if block._forward_hooks or block._forward_pre_hooks_with_kwargs:
        return False
    if not isinstance(ffn, MoE):
        return True
    # NOTE: a capacity limit drops nothing at one token: its top-k picks are distinct experts, each gets
    # one row, and a capacity (capacity_factor > 0) is at least one.
    return (
        _plain(ffn, MoE)
        and _plain(ffn.router, TopKRouter)
        and type(ffn.dispatcher) is LocalDispatcher
        and isinstance(ffn.experts, PerExpert)
        and not (_hooked(ffn) or _hooked(ffn.router) or _hooked(ffn.experts))
    )


def _plain(module: torch.nn.Module, kind: type) -> bool:
    """A module of exactly ``kind``, in eval mode, running its class's forward (``_replaced``)."""
    return type(module) is kind and not module.training and not _replaced(module)


def _replaced(module: torch.nn.Module) -> bool:
    """Whether a module runs a forward of its own (as ``torch.compile(module.forward)`` sets) or is
    compiled (``module.compile()``)."""
    return "forward" in vars(module) or module._compiled_call_impl is not None


def _inactive(drop: torch.nn.Module) -> bool:
    """A block's or the model's dropout that computes nothing: an identity, or dropout in eval mode."""
    return any(_plain(drop, kind) for kind in (torch.nn.Identity, torch.nn.Dropout)) and not _hooked(drop)


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a module ``token_step`` does not call has hooks its forward would run."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _moe(moe: MoE, h_11D: Tensor, loads: list[Tensor] | None) -> Tensor:
    """``moe(h)`` for one token: each picked expert's output, in the dispatcher's order (by expert),
    weighted and summed by the dispatcher's own one-token combine."""
    x_1D = h_11D.view(1, -1)
    _, _, weights_1K, experts_1K = moe.router.pick(x_1D)
    if loads is not None:
        loads.append(torch.bincount(experts_1K[0], minlength=moe.cfg.num_experts))
    picked = experts_1K[0].tolist()
    order = sorted(range(len(picked)), key=picked.__getitem__)
    experts = moe.experts
    y_KD = torch.cat([experts.compute(x_1D, *experts.kernels(picked[k]), picked[k]) for k in order])
    y_1D = LocalDispatcher.combine_one_token(y_KD, weights_1K[0, order])
    return moe.add_dense(x_1D, y_1D).to(h_11D.dtype).view_as(h_11D)


# Whether the one-token C calls are taken where they may be (benchmarks/decode_split.py turns them off
# to split the time of the ops they replace), and whether every block takes one call together where each
# may (it times them block by block without).
C_CALLS = True
ONE_CALL = True


def fuses(moe: MoE, h_11D: Tensor) -> bool:
    """Whether ``moe``'s routed experts and the residual around them take one C call at this token
    (``kernels.moe_token_bf16``): SwiGLU experts without biases in the row layout or in int8
    (``_c_weights``), a softmax top-k router without groups, noise or a DTS schedule under way, and
    nothing dense beside the experts."""
    experts, router = moe.experts, moe.router
    if not (C_CALLS and _c_weights(experts) and h_11D.dtype == torch.bfloat16) or torch.is_grad_enabled():
        return False
    cfg = router.cfg
    plain_router = cfg.score_func == "softmax" and cfg.softmax_before_topk and router.noise is None
    scheduled = cfg.dts_steps and router.step is not None
    return (
        plain_router
        and cfg.num_experts <= MAX_EXPERTS
        and cfg.n_group == 1
        and not scheduled
        and experts.compute.activation.name == "swiglu"
        and experts.w_in_bias is None
        and experts.w_out_bias is None
        and moe.residual_mlp is None
        and moe.shared is None
    )


def _fused_moe(moe: MoE, h_11D: Tensor, x_11D: Tensor, loads: list[Tensor] | None) -> Tensor:
    """``x + moe(h)`` for one token where ``fuses``, in one C call."""
    y_D, picked_K = moe_token_bf16(h_11D.view(-1), x_11D.view(-1), _moe_weights(moe))
    if loads is not None:
        loads.append(torch.bincount(picked_K, minlength=moe.cfg.num_experts))
    return y_D.view_as(x_11D)


def _moe_weights(moe: MoE) -> MoEWeights:
    """A ``fuses`` MoE layer's weights as the C calls take them (the router's in fp32, as it computes)."""
    router, experts = moe.router, moe.experts
    bias, cfg = router.gate.bias, router.cfg
    (w_in, w_in_scale), (w_out, w_out_scale) = (_weight_and_scale(experts, role) for role in ("w_in", "w_out"))
    router_bias = None if bias is None else bias.float()
    router_ED, selection_bias = router.gate.weight.float().contiguous(), router.expert_bias.float()
    return MoEWeights(
        router_ED,
        router_bias,
        selection_bias,
        cfg.top_k,
        cfg.normalize_topk,
        cfg.route_scale,
        w_in,
        w_out,
        w_in_scale,
        w_out_scale,
    )


def fuses_attention(block: Block, cache: Cache, layer: int, x_11D: Tensor) -> bool:
    """Whether ``block``'s attention half and the residual around it take one C call at this token
    (``kernels.attention_token_bf16``): the row layout's RMSNorm and projections, unhooked, no QK norm,
    sinks or window, heads of 32 to 128 (``kernels.one_query_bf16``'s) over one sequence's contiguous bf16
    ``KVCache`` whose every position is its own."""
    attn = block.attn
    if not C_CALLS or type(cache) is not KVCache or cache.left_pad is not None or cache.mla_expanded:
        return False
    projections = (attn.qkv, attn.out)
    if not _row_norm(block.attn_norm) or not all(map(_c_weights, projections)) or any(map(_hooked, projections)):
        return False
    keys, values, d = cache.keys[layer], cache.values[layer], attn.head_dim
    plain = attn.qk_norm is None and attn.sinks is None and not attn.window and d % 32 == 0 and d <= 128
    cached = keys.shape[0] == 1 and keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape
    qkv, out = _weight_and_scale(attn.qkv, "weight")[0], _weight_and_scale(attn.out, "weight")[0]
    widths = qkv.shape[0] == out.shape[1] + 2 * keys.shape[1] * d and out.shape[1] % d == 0
    biases = all(m.bias is None or m.bias.dtype == torch.bfloat16 for m in projections)
    bf16 = x_11D.dtype == keys.dtype == torch.bfloat16 and not torch.is_grad_enabled()
    return plain and cached and widths and biases and bf16


def _fused_attention(block: Block, x_11D: Tensor, rope_d2: Tensor, cache: KVCache, layer: int) -> Tensor:
    """``x + attn(attn_norm(x))`` for one token where ``fuses_attention``, in one C call; this token's key
    and value land in ``cache`` at its length, as ``KVCache.append`` puts them."""
    weights = _attention_weights(block, cache, layer)
    return attention_token_bf16(x_11D.view(-1), rope_d2, cache.length, weights).view_as(x_11D)


def _attention_weights(block: Block, cache: KVCache, layer: int) -> AttentionWeights:
    """A ``fuses_attention`` block's attention half as the C calls take it."""
    attn, norm = block.attn, block.attn_norm
    qkv, qkv_scale = _weight_and_scale(attn.qkv, "weight")
    out, out_scale = _weight_and_scale(attn.out, "weight")  # [D, H d]
    keys, values, heads = cache.keys[layer][0], cache.values[layer][0], out.shape[1] // attn.head_dim
    return AttentionWeights(
        norm.weight, norm.eps, qkv, attn.qkv.bias, keys, values, heads, out, attn.out.bias, qkv_scale, out_scale
    )


def fuses_every_block(model: Transformer, x_11D: Tensor, cache: Cache) -> bool:
    """Whether every block takes one C call together (``kernels.blocks_token_bf16``): each block's attention
    half ``fuses_attention`` and its feed-forward is a MoE layer that ``fuses`` after the row layout's
    RMSNorm, unhooked; no block has forward pre-hooks (they run between blocks). ``ONE_CALL`` turns it off."""
    return (
        ONE_CALL
        and bool(model.blocks)
        and all(
            not block._forward_pre_hooks
            and _row_norm(block.ffn_norm)
            and isinstance(block.ffn, MoE)
            and fuses_attention(block, cache, i, x_11D)
            and fuses(block.ffn, x_11D)
            for i, block in enumerate(model.blocks)
        )
    )


def _fused_blocks(
    model: Transformer, x_11D: Tensor, rope_d2: Tensor, cache: KVCache, loads: list[Tensor] | None
) -> Tensor:
    """The residual stream after every block for one token where ``fuses_every_block``, in one C call."""
    blocks = [
        BlockWeights(
            _attention_weights(block, cache, i), block.ffn_norm.weight, block.ffn_norm.eps, _moe_weights(block.ffn)
        )
        for i, block in enumerate(model.blocks)
    ]
    y_D, picks = blocks_token_bf16(x_11D.view(-1), blocks, rope_d2, cache.length)
    if loads is not None:
        for picked, block in zip(picks, model.blocks, strict=True):
            loads.append(torch.bincount(picked, minlength=block.ffn.cfg.num_experts))
    return y_D.view_as(x_11D)


def _row_norm(norm: torch.nn.Module) -> bool:
    """The row layout's RMSNorm, unhooked, running its own forward: one the C calls may compute instead."""
    return type(norm) is RowRMSNorm and not (_replaced(norm) or _hooked(norm))


def _c_weights(module: torch.nn.Module) -> bool:
    """Whether the one-token C calls multiply ``module``'s weights: bf16 ones in the row layout (``RowExperts``,
    ``RowLinear``), or int8 ones (``QuantizedExperts``, ``QuantizedLinear``) where the int8 row kernel runs
    (``quant.INT8_ROW_KERNEL_ISAS``, as ``quant.int8_mm`` takes it)."""
    kind = type(module)
    if _replaced(module):  # a forward the C calls would skip (their modules hold no dropout: any mode will do)
        return False
    if kind in (RowExperts, RowLinear):
        return rows_available()
    return kind in (QuantizedExperts, QuantizedLinear) and module.fmt == "int8" and rows_isa() in INT8_ROW_KERNEL_ISAS


def _weight_and_scale(module: torch.nn.Module, role: str) -> tuple[Tensor, Tensor | None]:
    """A ``_c_weights`` module's weight ``role`` (``w_in``, ``w_out``, ``weight``) and its int8 scales (None: bf16)."""
    if isinstance(module, RowExperts | RowLinear):
        return getattr(module, role), None
    if isinstance(module, QuantizedLinear):
        return module.q, module.scale
    return getattr(module, f"{role}_q"), getattr(module, f"{role}_scale")
