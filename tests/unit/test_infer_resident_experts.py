"""Experts quantized in memory (``moekit generate --expert-format int8|int4`` without a budget) against a
reference written out here: each expert's weights quantized by the formats' own definitions (int8: per
output channel, absmax / 127; int4: groups of 32 along the input, absmax / 7, codes -8..7), the FFN
``silu(x @ gate) * (x @ up) @ down`` per token in float64 on rows rounded to bf16 (what the kernels
take). Tolerance: bf16 rounding of each product's output and of the scales, relative to ``|x| @ |w|``.
"""

from __future__ import annotations

import pytest
import torch

from moekit.config import MoEConfig
from moekit.experts.matmul import (
    packed_linear,
    plain_fp32,
    prepack,
    prepackable,
    single_token_kernels,
    unpacked_linear,
)
from moekit.infer.resident_experts import (
    PackedExperts,
    PackedLinear,
    QuantizedExperts,
    RowExperts,
    RowLinear,
    RowRMSNorm,
    UpcastLinear,
    prepack_,
    quantize_experts_,
)
from moekit.kernels import rows_available
from moekit.layer import MoE


def _dequantized(w_KN: torch.Tensor, fmt: str) -> torch.Tensor:
    w = w_KN.double()
    if fmt == "int8":
        scale = (w.abs().amax(dim=0) / 127).float().bfloat16().double()  # per output column
        codes = torch.round(w / (w.abs().amax(dim=0) / 127)).clamp(-127, 127)
        return codes * scale
    K, N = w.shape
    groups = w.reshape(K // 32, 32, N)
    exact = groups.abs().amax(dim=1, keepdim=True) / 7
    codes = torch.round(groups / exact).clamp(-8, 7)
    return (codes * exact.float().bfloat16().double()).reshape(K, N)


def _reference(moe: MoE, x_TD: torch.Tensor, fmt: str) -> torch.Tensor:
    experts = moe.experts
    routing = moe.router(x_TD)
    y = torch.zeros(x_TD.shape, dtype=torch.float64)
    for t, e, w in zip(routing.token_idx.tolist(), routing.expert_idx.tolist(), routing.weights.tolist(), strict=True):
        x = x_TD[t].bfloat16().double()
        h = x @ _dequantized(experts.w_in[e], fmt)
        gate, up = h.chunk(2)
        act = (gate * torch.sigmoid(gate) * up).float().bfloat16().double()  # rows reach the kernel in bf16
        y[t] += w * (act @ _dequantized(experts.w_out[e], fmt))
    return y


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_quantized_experts_equal_a_written_out_reference(fmt: str, tokens: int) -> None:
    torch.manual_seed(tokens)
    moe = MoE(MoEConfig(d_model=64, d_ff=96, num_experts=4, top_k=2)).eval()
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        ref = _reference(moe, x, fmt)
        quantize_experts_(_Holder(moe), fmt)
        assert isinstance(moe.experts, QuantizedExperts)
        got = moe(x).double()
    magnitude = ref.abs().amax()
    assert float((got - ref).abs().amax()) <= 2.0**-6 * float(magnitude), "within bf16 rounding of the reference"


class _Holder(torch.nn.Module):
    """A model of one MoE layer (``quantize_experts_`` walks ``moe_layers()``)."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def moe_layers(self) -> list[MoE]:
        return [self.moe]


def _ffn_reference(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """The MoE layer per token in float64 from its own (bf16) weights."""
    experts, routing = moe.experts, moe.router(x_TD)
    y = torch.zeros(x_TD.shape, dtype=torch.float64)
    for t, e, w in zip(routing.token_idx.tolist(), routing.expert_idx.tolist(), routing.weights.tolist(), strict=True):
        gate, up = (x_TD[t].double() @ experts.w_in[e].double()).chunk(2)
        y[t] += w * ((gate * torch.sigmoid(gate) * up) @ experts.w_out[e].double())
    return y


@pytest.mark.parametrize("few_rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 2, 5, 30])
def test_prepacked_experts_and_linears_equal_the_plain_arithmetic(dtype, tokens: int, few_rows: bool) -> None:
    """``prepack_`` swaps the experts and the attention / head projections for oneDNN's packed kernels
    where they take the dtype (fp32; 16 bits where the CPU has native kernels), and leaves the model
    as it is elsewhere: the MoE layer stays within the dtype's rounding of a float64 per-token
    reference, the whole model's logits within it of the same model unpacked. ``few_rows``: bf16
    weights stay plain for the row kernel where it runs (one row; more by oneDNN), and on a CPU without
    native bf16 whatever ``few_rows`` says (fewer than 32 rows by the row kernel, more in fp32); fp32 weights
    plain for the fp32 row kernel on a CPU without AVX-512 (up to 16 rows; more by oneDNN, reordered)."""
    from moekit import runconfig
    from moekit.model import Transformer

    cfg = runconfig.resolve("tiny", {"model.n_layers": "2", "moe.num_experts": "4", "model.tie_embeddings": "false"})
    torch.manual_seed(tokens)
    model = Transformer(cfg.model, cfg.moe).to(dtype).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (1, tokens))
    moe = model.moe_layers()[0]
    x = torch.randn(tokens, cfg.model.d_model).to(dtype)
    bf16_rows = (few_rows or not prepackable(model.lm_head.weight)) and dtype == torch.bfloat16 and rows_available()
    rows = bf16_rows or (dtype == torch.float32 and plain_fp32())  # fp32 too on a CPU without AVX-512
    packs = prepackable(model.lm_head.weight) and not rows
    upcasts = not packs and not rows and dtype != torch.float32  # 16 bits without native kernels (fp16 on most CPUs)
    eps = 2.0**-20 if dtype == torch.float32 else 2.0**-6
    with torch.no_grad():
        plain_logits, ref = model(ids).logits.double(), _ffn_reference(moe, x)
        prepack_(model, few_rows)
        assert isinstance(moe.experts, PackedExperts) == packs and isinstance(model.lm_head, PackedLinear) == packs
        assert isinstance(model.blocks[0].attn.qkv, PackedLinear) == packs
        assert isinstance(model.blocks[0].attn.qkv, UpcastLinear) == upcasts
        assert isinstance(moe.experts, RowExperts) == rows and isinstance(model.lm_head, RowLinear) == rows
        assert isinstance(model.norm, RowRMSNorm) == bf16_rows
        assert isinstance(model.blocks[1].ffn_norm, RowRMSNorm) == bf16_rows
        got = moe(x).double()
        logits = model(ids).logits.double()
    assert float((got - ref).abs().amax()) <= eps * float(ref.abs().amax())
    assert float((logits - plain_logits).abs().amax()) <= 2 * eps * float(plain_logits.abs().amax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 40, 512])
def test_an_unpacked_weight_takes_the_packed_kernel_bit_for_bit(dtype, rows: int) -> None:
    """``unpacked_linear`` (what offloaded experts multiply their slots by) equals ``packed_linear`` over
    the weight ``prepack``-ed, exactly, for a weight stored [out, in] or [in, out] (seen transposed):
    2048 inputs, where oneDNN's one-row sums are ordered otherwise than ATen's (shown beside); up to a
    prefill's 512 rows, where a CPU with other kernels (AMX) could pick another 16-bit layout."""
    if not prepackable(torch.empty(1, dtype=dtype)):
        pytest.skip(f"this CPU's oneDNN has no native {dtype} kernels")
    torch.manual_seed(rows)
    w_NK, x_MK = torch.randn(512, 2048).to(dtype), torch.randn(rows, 2048).to(dtype)
    packed = packed_linear(x_MK, prepack(w_NK))
    assert torch.equal(unpacked_linear(x_MK, w_NK), packed)
    assert torch.equal(unpacked_linear(x_MK, w_NK.t().contiguous().t()), packed)
    if rows == 1 and dtype == torch.float32:
        with single_token_kernels(1):
            assert not torch.equal(torch.mm(x_MK, w_NK.t()), packed), "ATen's sums round alike: the test shows nothing"


@pytest.mark.parametrize("eps", [None, 1e-5, 0.5])
def test_the_row_rms_norm_equals_torchs(eps: float | None) -> None:
    """``RowRMSNorm`` computes what the ``nn.RMSNorm`` it replaces computes (torch 2.13's), each output
    within one bf16 unit of torch's: rows of values around 0.01, whose mean square (1e-4) an eps of bf16's
    epsilon (0.0078) would swamp, so the epsilon torch adds without one shows; and rows of around 100
    under a large eps."""
    if not rows_available():
        pytest.skip("the row kernels do not run here")
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(64, eps=eps).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
        x = (torch.randn(3, 2, 64) * torch.tensor([0.01, 100.0]).view(1, 2, 1)).bfloat16()
        want, got = norm(x).double(), RowRMSNorm(norm)(x).double()
    assert bool(((got - want).abs() <= 2.0**-7 * want.abs()).all())


_WITHOUT_NATIVE_BF16 = """
import sys
import torch
from moekit import kernels, runconfig
from moekit.infer.resident_experts import RowExperts, RowLinear, RowRMSNorm, UpcastLinear, prepack_
from moekit.model import Transformer
kernels_on, few_rows = sys.argv[1] != "torch", sys.argv[1] == "rows, batch 1"
overrides = {"model.n_layers": "2", "moe.num_experts": "4", "model.tie_embeddings": "false"}
cfg = runconfig.resolve("tiny", {**overrides, "model.context_length": "128"})
torch.manual_seed(0)
model = Transformer(cfg.model, cfg.moe).bfloat16().eval()
prompts = [torch.randint(0, cfg.model.vocab_size, (1, n)) for n in (1, 2, 31, 32, 80)]
with torch.no_grad():
    plain = [model(ids).logits.double() for ids in prompts]
    prepack_(model, few_rows)
    linear, experts = (RowLinear, RowExperts) if kernels_on else (UpcastLinear, torch.nn.Module)
    assert isinstance(model.lm_head, linear) and isinstance(model.blocks[0].attn.qkv, linear)
    assert isinstance(model.moe_layers()[0].experts, experts)
    assert isinstance(model.norm, RowRMSNorm) == kernels_on
    assert kernels.rows_isa() == ("avx2" if kernels_on else None)
    got = [model(ids).logits.double() for ids in prompts]
print(max(float((g - p).abs().amax() / p.abs().amax()) for g, p in zip(got, plain)))
"""


@pytest.mark.parametrize(
    "layout",
    [pytest.param("torch", marks=pytest.mark.slow), pytest.param("rows", marks=pytest.mark.slow), "rows, batch 1"],
)
def test_a_cpu_without_native_bf16_keeps_the_logits(layout: str) -> None:
    """oneDNN limited to AVX2, as on a CPU without native bf16. Without moekit's kernels
    (``MOEKIT_MAX_CPU_ISA=none``) nothing is prepacked and the linears upcast their products to fp32;
    with their AVX2 build the weights stay plain whether or not the load is for a batch-1 decode
    (``few_rows``): fewer than 32 rows by the AVX2 row kernel, more upcast. The logits of prompts of 1, 2,
    31, 32 and 80 tokens (the experts' rows of 80 upcast too) stay within bf16 rounding of the plain
    model's."""
    import os
    import subprocess
    import sys

    from moekit import kernels

    if layout != "torch" and "avx2" not in kernels.runnable_isas():
        pytest.skip("this CPU does not run the AVX2 build")
    isa = "none" if layout == "torch" else "avx2"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", MOEKIT_MAX_CPU_ISA=isa)
    argv = [sys.executable, "-c", _WITHOUT_NATIVE_BF16, layout]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) <= 2.0**-5


FAMILIES = {
    # gpt-oss: biases on q/k/v, attention output and experts, clamped SwiGLU, a sliding window, an untied head
    "biases": {
        "model.qkv_bias": "true",
        "model.attn_out_bias": "true",
        "moe.expert_ffn_bias": "true",
        "moe.activation": "clamped_swiglu",
        "model.sliding_window": "8",
        "model.tie_embeddings": "false",
    },
    # Qwen2-MoE-like: a gated shared expert, a dense first block, 4 query heads over 1 key/value head
    "shared": {
        "moe.num_shared_experts": "1",
        "moe.shared_expert_gate": "true",
        "model.first_dense_layers": "1",
        "model.n_heads": "4",
        "model.n_kv_heads": "1",
    },
    "tied": {"model.tie_embeddings": "true"},
}


def _randomise_biases(model: torch.nn.Module) -> None:
    """Biases drawn large (initialised to zeros, a dropped one would not show)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prepacked_models_of_every_shape_keep_their_logits(dtype, family: str) -> None:
    """Biases (randomised: a dropped one shows), GQA, shared experts behind their gate, dense blocks, a
    tied head (left unpacked, still the embedding): prefill and cached decode logits within the dtype's
    rounding of the unpacked model's. The packed model counts the same resident bytes (what
    ``--memory-budget`` reports): no weight or bias is dropped from the count or held twice."""
    from moekit import runconfig
    from moekit.infer.generate import decode_step, prefill
    from moekit.infer.offload import model_bytes
    from moekit.model import Transformer

    cfg = runconfig.resolve("tiny", {"model.n_layers": "3", "moe.num_experts": "4", **FAMILIES[family]})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    _randomise_biases(model)
    model = model.to(dtype)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12))

    def logits() -> list[torch.Tensor]:
        first, cache = prefill(model, ids)
        return [first.double(), decode_step(model, first.argmax(-1, keepdim=True), cache).double()]

    with torch.no_grad():
        plain, plain_bytes = logits(), model_bytes(model)
        prepack_(model)
        packed = logits()
    assert model_bytes(model) == plain_bytes
    if prepackable(model.embed.weight):  # prepacked, or kept plain for a row kernel
        assert any(isinstance(m, PackedLinear | RowLinear) for m in model.modules())
        assert (type(model.lm_head) is torch.nn.Linear) == cfg.model.tie_embeddings
        if cfg.model.tie_embeddings:
            assert model.lm_head.weight is model.embed.weight
    eps = 2.0**-20 if dtype == torch.float32 else 2.0**-5
    for got, ref in zip(packed, plain, strict=True):
        assert float((got - ref).abs().amax()) <= eps * float(ref.abs().amax())


DENSE_FAMILIES = {
    **FAMILIES,
    # DeepSeek's latent attention: its projections stay (the absorbed decode reads their weights)
    "mla": {"model.attention": "mla", "model.n_heads": "2", "model.q_lora_rank": "8", "model.tie_embeddings": "false"},
}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", sorted(DENSE_FAMILIES))
def test_quantized_dense_weights_equal_a_written_out_reference(fmt: str, family: str) -> None:
    """``--dense-format``: every linear weight outside the routed experts (attention's projections with
    their biases, the shared expert and the dense block, an untied head: int8 under int4) becomes a
    ``QuantizedLinear`` whose products equal the written-out reference (``_dequantized``) over rows
    rounded to bf16, within bf16 rounding; the experts, the routers, the shared expert's gate and a tied
    head keep their weights, and prefill and cached decode still run (then prepacked, as
    ``load_for_inference`` does)."""
    from moekit import runconfig
    from moekit.experts import DenseFFN
    from moekit.infer.generate import decode_step, prefill
    from moekit.infer.resident_experts import QuantizedLinear, quantize_dense_
    from moekit.model import Transformer
    from moekit.model.transformer import Attention

    cfg = runconfig.resolve("tiny", {"model.n_layers": "3", "moe.num_experts": "4", **DENSE_FAMILIES[family]})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    _randomise_biases(model)
    experts = [moe.experts for moe in model.moe_layers()]
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    linears = [(parent, name, child) for parent, name, child in linears if type(child) is torch.nn.Linear]
    dense = {
        (parent, name): (child.weight.detach().clone(), child.bias)
        for parent, name, child in linears
        if isinstance(parent, Attention | DenseFFN) or (parent is model and not cfg.model.tie_embeddings)
    }
    kept = [child for parent, name, child in linears if (parent, name) not in dense]
    ffns = sum(isinstance(m, DenseFFN) for m in model.modules())
    attention = 2 * cfg.model.n_layers if cfg.model.attention == "mha" else 0
    assert len(dense) == attention + 3 * ffns + (not cfg.model.tie_embeddings)
    with torch.no_grad():
        quantize_dense_(model, fmt)
        for (parent, name), (w_NK, bias) in dense.items():
            linear = getattr(parent, name)
            assert isinstance(linear, QuantizedLinear) and linear.q.element_size() == 1
            assert linear.fmt == ("int8" if parent is model else fmt), "the head in int8 under int4"
            x = torch.randn(5, w_NK.shape[1])
            if linear.fmt == "int8":  # the codes themselves: a weight left unquantized would pass the bound below
                exact = w_NK.double().abs().amax(dim=1, keepdim=True) / 127
                assert torch.equal(linear.q, torch.round(w_NK.double() / exact).clamp(-127, 127).to(torch.int8))
            ref = x.bfloat16().double() @ _dequantized(w_NK.t(), linear.fmt)
            ref = ref if bias is None else ref + bias.double()
            got = linear(x).double()
            bound = (x.abs().double() @ w_NK.t().abs().double()).amax()
            assert float((got - ref).abs().amax()) <= 2.0**-7 * float(bound), f"{name} within bf16 rounding"
        assert [moe.experts for moe in model.moe_layers()] == experts
        assert all(type(child) is torch.nn.Linear for child in kept) and len(kept) >= cfg.model.n_layers  # routers
        assert all(any(child is getattr(p, n) for p, n, _ in linears) for child in kept), "still in place"
        if cfg.model.tie_embeddings:
            assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.embed.weight
        prepack_(model)
        ids = torch.randint(0, cfg.model.vocab_size, (2, 12))
        first, cache = prefill(model, ids)
        step = decode_step(model, first.argmax(-1, keepdim=True), cache)
    assert torch.isfinite(first).all() and torch.isfinite(step).all()


def test_dense_formats_are_refused_where_untested(tmp_path) -> None:
    """A bad name, int4 where torch's packing cannot take a weight (an input width not a multiple of 32,
    an output width not a multiple of 16), and an offloaded model (its dense weights count in the memory
    budget as stored): each a one-line OptionError."""
    from moekit import runconfig
    from moekit.errors import OptionError
    from moekit.infer.offload import OffloadOptions
    from moekit.infer.resident_experts import quantize_dense_
    from moekit.model import Transformer
    from moekit.model_dir import load_for_inference

    cfg = runconfig.resolve("tiny", {"model.n_layers": "1", "moe.num_experts": "4", "model.d_model": "48"})
    model = Transformer(cfg.model, cfg.moe).eval()
    with pytest.raises(OptionError, match="choose from fp, int8, int4"):
        quantize_dense_(model, "int3")
    with pytest.raises(OptionError, match=r"input widths in multiples of 32 .*\(qkv: 48 ->"):
        quantize_dense_(model, "int4")
    narrow = {"model.n_layers": "1", "moe.num_experts": "4", "model.n_heads": "8", "model.n_kv_heads": "1"}
    cfg = runconfig.resolve("tiny", narrow)  # d 32, 8 heads of 4 over 1 key/value head: qkv 40 wide
    with pytest.raises(OptionError, match=r"output widths in multiples of 16 \(qkv: 32 -> 40\)"):
        quantize_dense_(Transformer(cfg.model, cfg.moe).eval(), "int4")
    with pytest.raises(OptionError, match="offloaded models keep their dense weights"):
        load_for_inference(tmp_path, offload=OffloadOptions(1 << 20), dense_format="int8")
