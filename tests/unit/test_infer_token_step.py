"""``token_step``: a decode step of one sequence computes what the model's forward through the cache
computes, bit for bit, for every model shape it takes (the row layout's C calls within a stated
tolerance), and the steps it does not take are left to the forward."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import moekit.infer.token_step as ops
from moekit import runconfig
from moekit.experts.matmul import native_16bit, prepackable, single_token_kernels
from moekit.infer.generate import decode_step, prefill
from moekit.infer.quant import INT8_ROW_KERNEL_ISAS
from moekit.infer.resident_experts import RowExperts, RowRMSNorm, prepack_, quantize_dense_, quantize_experts_
from moekit.infer.token_step import fuses, takes, token_step
from moekit.kernels import rows_available, rows_isa, rows_unavailable_reason
from moekit.model import KVCache, Transformer

FAMILIES = {
    "mixtral": {"model.n_heads": "4", "model.n_kv_heads": "2"},
    # Qwen2-MoE: a gated shared expert, a dense first block, unnormalised top-k weights, one KV head
    "qwen2-moe": {
        "moe.num_shared_experts": "1",
        "moe.shared_expert_gate": "true",
        "moe.normalize_topk": "false",
        "model.first_dense_layers": "1",
        "model.n_heads": "4",
        "model.n_kv_heads": "1",
    },
    # OLMoE: q/k norms over the whole projection; 3 of 8 picks, so the sum's order is the dispatcher's
    "olmoe": {"model.qk_norm": "true", "moe.num_experts": "8", "moe.top_k": "3"},
    "qwen3": {"model.qk_head_norm": "true", "moe.softmax_before_topk": "false", "model.tie_embeddings": "false"},
    # DeepSeek-V3's router (a selection bias, groups, sigmoid scores, a route scale) over standard attention
    "deepseek-router": {
        "moe.score_func": "sigmoid",
        "moe.route_scale": "2.5",
        "moe.num_experts": "8",
        "moe.top_k": "3",
        "moe.n_group": "4",
        "moe.topk_group": "2",
    },
    # gpt-oss: biases everywhere, clamped SwiGLU, sinks, a sliding window on every other block, an untied head
    "gpt-oss": {
        "model.attn_sinks": "true",
        "model.sliding_window": "4",
        "model.full_attention_every": "2",
        "model.qkv_bias": "true",
        "model.attn_out_bias": "true",
        "moe.expert_ffn_bias": "true",
        "moe.router_bias": "true",
        "moe.activation": "clamped_swiglu",
        "model.tie_embeddings": "false",
    },
    "biased": {"model.qkv_bias": "true", "model.attn_out_bias": "true", "moe.router_bias": "true"},
    # unnormalised top-3 weights times a route scale
    "scaled": {"moe.route_scale": "2.5", "moe.normalize_topk": "false", "moe.top_k": "3", "moe.num_experts": "8"},
    "residual+capacity": {"moe.residual": "true", "moe.capacity_factor": "0.5", "model.norm": "layernorm"},
    # routers whose training-time randomness is off in eval, and dropout, an identity in eval
    "noisy+dropout": {"moe.router": "noisy_topk", "model.dropout": "0.5"},
    "gshard": {"moe.router": "gshard"},
    "switch": {"moe.router": "switch", "moe.top_k": "1", "moe.capacity_factor": "1.0"},
    # the dense-to-sparse gate mid-schedule (its step set below): 6 of 8 experts at a temperature
    "dts": {"moe.dts_steps": "10", "moe.num_experts": "8"},
    "every-other": {"model.moe_every": "2", "model.n_layers": "4", "moe.activation": "gelu"},
}
FORMATS = {  # dtype, expert format, dense format: load_for_inference's resident forms
    "fp32": (torch.float32, None, None),
    "bf16": (torch.bfloat16, None, None),
    "bf16-rows": (torch.bfloat16, None, None),  # laid out for a batch-1 decode (prepack_'s few_rows)
    "int8": (torch.bfloat16, "int8", "int8"),
    "int4": (torch.bfloat16, "int4", "int4"),
}


def _model(family: str, fmt: str, seed: int = 0) -> Transformer:
    """A tiny model of ``family`` in ``fmt``, its biases and selection biases drawn large (a dropped one shows);
    in the row layout and in int8 heads of 32, the narrowest the C attention takes."""
    width = {"model.d_model": "128"} if fmt in ("bf16-rows", "int8") else {}
    cfg = runconfig.resolve("tiny", {"model.n_layers": "3", "model.context_length": "64", **width, **FAMILIES[family]})
    torch.manual_seed(seed)
    model = Transformer(cfg.model, cfg.moe).eval()
    dtype, experts, dense = FORMATS[fmt]
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "expert_bias")):
                t.normal_(0.0, 0.5)
        for p in model.parameters():  # as a load converts them (a complex RoPE table is no bf16 tensor)
            p.data = p.data.to(dtype)
        for moe in model.moe_layers():
            moe.set_step(3)  # the DTS gate's schedule (no-op for the others)
        if experts:
            quantize_experts_(model, experts)
            quantize_dense_(model, dense)
        return prepack_(model, few_rows=fmt == "bf16-rows")


def _needs_packed_bf16(fmt: str) -> None:
    """bf16 experts are prepacked (and so take the token path) on a CPU with native bf16 kernels, laid
    out for the row kernel (RMSNorms too) wherever it runs, and on a CPU without native bf16 (AVX2) they
    take the row layout whatever the load."""
    if fmt == "bf16-rows" and not rows_available():
        pytest.skip(f"the row kernel does not run here: {rows_unavailable_reason()}")
    if fmt == "bf16" and not prepackable(torch.empty(1, dtype=torch.bfloat16)) and not rows_available():
        pytest.skip("no native bf16 kernels nor moekit's: bf16 experts stay grouped and run the forward")


def _forward_step(model: Transformer, token_11: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The model's own forward through the cache (what ``decode_step`` ran for every step before)."""
    with torch.no_grad(), single_token_kernels(1):
        return model(token_11, cache=cache).logits[:, -1]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_token_step_equals_the_forward_bit_for_bit(family: str, fmt: str) -> None:
    """Logits, the cached keys and values and the cache's length equal the forward's after each of 20
    steps (greedy tokens fed back, the prompt's 7 positions first); the token path is the one taken.
    The row layout's C calls: within ``FUSED_TOLERANCE``."""
    _needs_packed_bf16(fmt)
    _steps_as_its_forward(family, fmt)


MOE_FUSED = ["mixtral", "olmoe", "biased", "scaled", "switch"]  # families whose MoE layers take the C call
ROW_FUSED = {  # family: whether its attention halves and its MoE layers take one C call each in the row layout
    "mixtral": (True, True),
    "olmoe": (False, True),  # QK norms
    "qwen2-moe": (True, False),  # a shared expert
    "deepseek-router": (True, False),  # sigmoid scores, groups
    "biased": (True, True),  # biases on the projections and the router
    "gpt-oss": (False, False),  # sinks, windows, clamped SwiGLU, expert biases
}


@pytest.mark.parametrize("family", ROW_FUSED)
def test_the_row_layout_of_each_build_steps_as_its_forward(family: str, kernel_isa: str, monkeypatch) -> None:
    """The same for the row layout under each build of the kernels this CPU runs (a CPU with AVX-512
    checks the AVX2 build's kernels and RMSNorm too). Where a block's attention half or MoE layer takes
    one C call (``fuses_attention``, ``fuses``; ``ROW_FUSED`` says which, and the calls are counted),
    the step equals the forward, within ``FUSED_TOLERANCE`` where a MoE layer takes one; where every
    block takes both, the blocks take one call together (``fuses_every_block``); the others keep the
    one-token path's ops."""
    model = _model(family, "bf16-rows")
    attention, moe = ROW_FUSED[family]
    calls = {"attention": 0, "moe": 0, "blocks": 0}
    kernels = {"attention": ops.attention_token_bf16, "moe": ops.moe_token_bf16, "blocks": ops.blocks_token_bf16}
    for name, kernel in kernels.items():
        monkeypatch.setattr(ops, kernel.__name__, functools.partial(_counted, kernel, calls, name))
    _steps_as_its_forward(family, "bf16-rows")
    steps, blocks, moe_layers = 20, len(model.blocks), len(model.moe_layers())
    whole = attention and moe and moe_layers == blocks
    assert calls == {
        "attention": 0 if whole else steps * blocks * attention,
        "moe": 0 if whole else steps * moe_layers * moe,
        "blocks": steps * whole,
    }


@pytest.mark.parametrize(
    ("family", "fmt"), [(f, "bf16-rows") for f, fused in ROW_FUSED.items() if all(fused)] + [("mixtral", "int8")]
)
def test_the_blocks_in_one_call_equal_their_calls_one_by_one(
    family: str, fmt: str, kernel_isa: str, monkeypatch
) -> None:
    """``blocks_token_bf16`` (one C call for every block) against the same step with each block's attention
    half and MoE layer called one by one (each held to the forward above): logits, cache and each
    layer's tokens per expert bit for bit over 12 steps, the tokens fed back; int8 weights too."""
    _needs_int8_calls(fmt, norms=True)
    model = _model(family, fmt)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    logits, cache = prefill(model, prompt)
    one_by_one = copy.deepcopy(cache)
    token = logits.argmax(-1, keepdim=True)
    with single_token_kernels(1), torch.inference_mode():
        for _ in range(12):
            x = model.embed(token)
            assert ops.fuses_every_block(model, x, cache)
            loads, want_loads = [], []
            got = token_step(model, token, cache, loads)
            with monkeypatch.context() as patch:
                patch.setattr(ops, "ONE_CALL", False)
                want = token_step(model, token, one_by_one, want_loads)
            assert torch.equal(got, want) and cache.length == one_by_one.length
            for mine, theirs in zip([*cache.keys, *cache.values], [*one_by_one.keys, *one_by_one.values], strict=True):
                assert torch.equal(mine, theirs)
            assert len(loads) == len(model.moe_layers()) and all(map(torch.equal, loads, want_loads))
            token = got.argmax(-1, keepdim=True)


def test_what_keeps_the_blocks_apart(kernel_isa: str, monkeypatch) -> None:
    """The one call for every block skips the modules it replaces: a forward pre-hook or hook on a
    feed-forward RMSNorm, a replaced RMSNorm forward, a block's forward pre-hook (it runs between blocks),
    a dense feed-forward block, or ``ONE_CALL`` off sends the step back to a call per block half."""
    model = _model("mixtral", "bf16-rows")
    _, cache = prefill(model, torch.zeros(1, 3, dtype=torch.long))
    with torch.inference_mode():
        x = model.embed(torch.zeros(1, 1, dtype=torch.long))
        assert ops.fuses_every_block(model, x, cache)
        norm = model.blocks[1].ffn_norm
        for hook in (
            norm.register_forward_pre_hook,
            norm.register_forward_hook,
            model.blocks[2].register_forward_pre_hook,
        ):
            handle = hook(lambda *_: None)
            assert not ops.fuses_every_block(model, x, cache)
            handle.remove()
        with monkeypatch.context() as patch:
            patch.setattr(norm, "forward", norm.forward)
            assert not ops.fuses_every_block(model, x, cache)
        moe, model.blocks[0].ffn = model.blocks[0].ffn, torch.nn.Identity()
        assert not ops.fuses_every_block(model, x, cache)
        model.blocks[0].ffn = moe
        with monkeypatch.context() as patch:
            patch.setattr(ops, "ONE_CALL", False)
            assert not ops.fuses_every_block(model, x, cache)
        assert ops.fuses_every_block(model, x, cache)


def _needs_int8_calls(fmt: str, norms: bool = False) -> None:
    """int8 weights take the C calls where the int8 row kernel runs (the AVX2 build), and an int8 model's
    RMSNorms are the row layout's (which the attention call and the blocks' call need) where the CPU has
    no native bf16."""
    if fmt == "int8" and rows_isa() not in INT8_ROW_KERNEL_ISAS:
        pytest.skip(f"int8 takes the C calls in the {', '.join(INT8_ROW_KERNEL_ISAS)} build, not {rows_isa()}")
    if fmt == "int8" and norms and native_16bit(torch.bfloat16):
        pytest.skip("an int8 model keeps torch's RMSNorm on a CPU with native bf16")


def _counted(kernel, calls: dict[str, int], name: str, *args):
    calls[name] += 1
    return kernel(*args)


@pytest.mark.parametrize(("family", "fmt"), [(f, "bf16-rows") for f in MOE_FUSED] + [("mixtral", "int8")])
def test_a_fused_moe_layer_equals_its_ops(family: str, fmt: str) -> None:
    """Each MoE layer's one C call (``_fused_moe``) against the one-token path's ops (``_moe``) on random
    rows large enough that the experts' output is all there is (a zero residual): the same picks, and
    each output within a bf16 unit of the largest (a rounding the C sums tip); Mixtral's, OLMoE's top 3
    of 8, a router bias (``biased``), unnormalised weights times a route scale (``scaled``), top 1
    (``switch``), every family's selection biases drawn large; int8 experts too."""
    _needs_int8_calls(fmt)
    model = _model(family, fmt)
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for moe in model.moe_layers():
            for _ in range(8):
                h = torch.randn(1, 1, model.cfg.d_model, generator=g).bfloat16()
                zero = torch.zeros_like(h)
                assert fuses(moe, h)
                picked, want_picked = [], []
                got, want = ops._fused_moe(moe, h, zero, picked), ops._moe(moe, h, want_picked)
                assert torch.equal(picked[0], want_picked[0])
                assert bool(((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs().max()).all())


def _steps_as_its_forward(family: str, fmt: str) -> None:
    """20 steps of ``decode_step`` against the forward, each fed the forward's greedy token: bit for bit,
    logits and cache; where a block takes the row layout's C calls (``_fused``), within ``FUSED_TOLERANCE``."""
    model = _model(family, fmt)
    if fmt == "bf16-rows":  # the row kernel's layout, not oneDNN's, and its RMSNorm where the model has one
        assert all(type(moe.experts) is RowExperts for moe in model.moe_layers())
        assert (type(model.norm) is RowRMSNorm) == (model.cfg.norm == "rmsnorm")
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    logits, cache = prefill(model, prompt)
    reference = copy.deepcopy(cache)
    token = logits.argmax(-1, keepdim=True)
    for _ in range(20):
        assert takes(model, token)
        same = _close if _moe_fused(model) else torch.equal
        got, want = decode_step(model, token, cache), _forward_step(model, token, reference)
        assert same(got, want)
        assert cache.length == reference.length
        for mine, theirs in zip([*cache.keys, *cache.values], [*reference.keys, *reference.values], strict=True):
            assert same(mine, theirs)
        token = want.argmax(-1, keepdim=True)


# NOTE: the MoE layer's C call (infer/token_step.py) sums the router's fp32 logits in its own order and
# takes silu's and the softmax's exp from the C library: where that tips a bf16 rounding (a combine
# weight, an activation: 2^-8 of one term), the step and its cache part from the forward's by a few
# such units (Mixtral's family here: up to 0.006 of the largest logit over 40 steps); each layer's call
# is held to a bf16 unit of its ops by test_a_fused_moe_layer_equals_its_ops. The attention's call
# rounds as the forward does and must equal it.
FUSED_TOLERANCE = 2.0**-5


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got.float() - want.float()).abs().max() <= FUSED_TOLERANCE * want.float().abs().max())


@torch.inference_mode()
def _moe_fused(model: Transformer) -> bool:
    """Whether any MoE layer of this step takes its C call."""
    one_token = torch.zeros(1, 1, model.cfg.d_model, dtype=torch.bfloat16)
    return any(fuses(moe, one_token) for moe in model.moe_layers())


def test_what_a_token_step_hands_back_is_outside_inference_mode() -> None:
    """The one-token path runs in inference mode (its blocks' pre-hooks see it); what leaves it does
    not: its logits are written in place, and a forward with autograd through the same cache after it
    records its graph (a rollout decoded, then scored for learning)."""
    model = _model("mixtral", "fp32")
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    logits, cache = prefill(model, prompt)
    token = logits.argmax(-1, keepdim=True)
    assert takes(model, token)
    modes: list[bool] = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: modes.append(torch.is_inference_mode_enabled()))
    got = decode_step(model, token, cache)
    hook.remove()
    assert modes == [True]  # the step ran in inference mode
    assert not got.is_inference() and not any(t.is_inference() for t in [*cache.keys, *cache.values])
    got.add_(1.0)
    model.embed.weight.requires_grad_(True)
    scored = model(got.argmax(-1, keepdim=True), cache=cache)
    assert scored.logits.requires_grad and cache.length == 7


@pytest.mark.parametrize("family", ["qwen2-moe", "olmoe", "gpt-oss", "deepseek-router"])
def test_token_steps_follow_the_uncached_forward(family: str) -> None:
    """Independently of the cache's path: fp32, each step's logits within 1e-5 (relative) of the model run
    over every token so far without a cache."""
    model = _model(family, "fp32")
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    logits, cache = prefill(model, tokens)
    for _ in range(12):
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        logits = decode_step(model, tokens[:, -1:], cache)
        with torch.no_grad():
            full = model(tokens).logits[:, -1]
        assert float((logits - full).abs().amax()) <= 1e-5 * float(full.abs().amax())


def test_a_serving_step_of_one_sequence_equals_the_forward_and_counts_its_picks() -> None:
    """Through the serving engine's paged cache (``PagedStep``, blocks of 4, so steps cross blocks): the
    logits and the pool's keys and values equal the forward's, and each MoE layer's tokens per expert
    equal the forward's routing statistics."""
    from moekit.serve.kv import Chunk, KVPool, PagedStep

    _needs_packed_bf16("bf16")
    model = _model("gpt-oss", "bf16")
    pool = KVPool(model.cfg, 8, 4, torch.device("cpu"), torch.bfloat16)
    blocks = pool.allocate(6)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(prompt, cache=PagedStep(pool, [Chunk(blocks, 0, 6)], torch.device("cpu"))).logits[:, -1]
    reference = copy.deepcopy(pool)
    for position in range(6, 20):
        token = logits.argmax(-1, keepdim=True)
        loads: list[torch.Tensor] = []
        with torch.no_grad(), single_token_kernels(1):
            logits = token_step(model, token, PagedStep(pool, [Chunk(blocks, position, 1)], pool.keys[0].device), loads)
            out = model(token, cache=PagedStep(reference, [Chunk(blocks, position, 1)], pool.keys[0].device))
        assert torch.equal(logits, out.logits[:, -1])
        assert [torch.equal(a, b.tokens_per_expert) for a, b in zip(loads, out.moe_stats, strict=True)] == [True] * 3
        for mine, theirs in zip([*pool.keys, *pool.values], [*reference.keys, *reference.values], strict=True):
            assert torch.equal(mine, theirs)


def test_steps_it_cannot_compute_exactly_are_left_to_the_forward() -> None:
    """Two sequences, training mode, experts not computed one at a time (plain grouped weights),
    expert-choice routing and MLA: ``takes`` says no; a model whose experts are swapped between steps
    is checked again at the next."""
    model = _model("mixtral", "fp32")
    one = torch.tensor([[3]])
    assert takes(model, one)
    assert not takes(model, torch.tensor([[3], [4]]))
    assert not takes(model.train(), one)
    model.eval()

    def refused(overrides: dict[str, str]) -> bool:
        cfg = runconfig.resolve("tiny", {"model.n_layers": "2", **overrides})
        return not takes(prepack_(Transformer(cfg.model, cfg.moe).eval()), one)

    assert refused({"moe.router": "expert_choice"})
    assert refused({"moe.router": "hash"})
    assert refused({"model.attention": "mla", "model.q_lora_rank": "8"})

    plain = Transformer(model.cfg, model.moe_cfg).eval()
    logits, cache = prefill(plain, torch.tensor([[1, 2]]))
    assert not takes(plain, one)
    reference = copy.deepcopy(cache)
    token = logits.argmax(-1, keepdim=True)
    assert torch.equal(decode_step(plain, token, cache), _forward_step(plain, token, reference))
    prepack_(plain)  # its experts swapped for prepacked ones: the next step takes the token path
    assert takes(plain, token)
    assert torch.equal(decode_step(plain, token, cache), _forward_step(plain, token, reference))


def test_blocks_forward_pre_hooks_run_before_each_block_and_other_hooks_leave_the_step() -> None:
    """The serving engine stops between layers through blocks' forward pre-hooks: the token path runs
    them, in order, with the forward's arguments (one raising stops the step there); a block whose
    pre-hook returns new arguments runs its forward on them. A hook on any module the path does not
    call, a module in training mode, a forward of its own or a compiled module leaves the step to the
    forward."""
    model = _model("mixtral", "fp32")
    logits, cache = prefill(model, torch.tensor([[1, 2, 3]]))
    token = logits.argmax(-1, keepdim=True)
    seen: list[tuple[int, int]] = []
    hooks = [
        block.register_forward_pre_hook(lambda block, args: seen.append((args[3], args[0].shape[-1])))
        for block in model.blocks
    ]
    assert takes(model, token)
    decode_step(model, token, cache)
    assert seen == [(i, model.cfg.d_model) for i in range(len(model.blocks))]

    class Stopped(Exception):
        pass

    def stop(block, args):
        raise Stopped

    seen.clear()
    hooks.append(model.blocks[1].register_forward_pre_hook(stop))
    with pytest.raises(Stopped):
        decode_step(model, token, cache)
    assert seen == [(0, model.cfg.d_model), (1, model.cfg.d_model)]
    for hook in hooks:
        hook.remove()
    # a pre-hook giving new arguments (the residual stream doubled at block 2): that block runs its own
    # forward on them, and the step still equals the model's forward with the same hook
    reference = copy.deepcopy(cache)
    with model.blocks[2].register_forward_pre_hook(lambda block, args: (2 * args[0], *args[1:])):
        assert torch.equal(decode_step(model, token, cache), _forward_step(model, token, reference))
    skipped = (model, model.drop, model.blocks[1].drop, model.blocks[1].attn, model.blocks[1].ffn)
    for module in (*skipped, model.blocks[1].ffn.router, model.blocks[1].ffn.experts):
        with module.register_forward_hook(lambda module, args, out: None):
            assert not takes(model, token)
    with model.blocks[0].register_forward_pre_hook(lambda block, args, kwargs: None, with_kwargs=True):
        assert not takes(model, token)
    model.blocks[1].ffn.router.train()  # a module left in training mode: its noise or random dispatch
    assert not takes(model, token)
    model.eval()
    block = model.blocks[0]
    block.forward = functools.partial(type(block).forward, block)  # a forward of its own, as torch.compile sets
    assert not takes(model, token)
    del block.forward
    model.blocks[1].ffn.compile()  # compiled on its first call, which the token path would not make
    assert not takes(model, token)
    model.blocks[1].ffn._compiled_call_impl = None
    assert takes(model, token)
