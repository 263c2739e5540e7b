"""``moekit.kernels``: the row kernel against float64 sums written out here, in each build this CPU runs
(AVX512-BF16, AVX2), and its build: cached per source, instruction set and compiler, refused with the
compiler's own words, absent where it cannot run or where ``$MOEKIT_MAX_CPU_ISA`` says none.

Tolerance: the kernel sums in fp32 and rounds to bf16 once, so a result is within half a bf16 unit of
the exact sum (2^-8 of it, relative) plus fp32's accumulated error (K units of 2^-24 of ``|x| @ |w|``);
sums of small integers are exact in fp32, so there the result must be the exact sum rounded to bf16
(to nearest, ties to even).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from moekit import kernels
from moekit.kernels import ISAS, AttentionWeights, MoEWeights, build, rows_available, rows_bf16, rows_unavailable_reason

needs_rows = pytest.mark.skipif(
    not rows_available(), reason=f"the row kernel does not run here: {rows_unavailable_reason()}"
)
COMPILER = os.environ.get("CC", "cc")
HAS_COMPILER = shutil.which(COMPILER.split()[0]) is not None
can_build = pytest.mark.skipif(
    not rows_available(), reason=f"the row kernel was not built: {rows_unavailable_reason()}"
)


@pytest.mark.skipif(not kernels.runnable_isas() or not HAS_COMPILER, reason="no AVX2 or AVX-512 CPU with a compiler")
def test_the_kernel_runs_where_it_can() -> None:
    """On a CPU that runs a build and has a compiler, a failed build is a failure, not a skipped test: the
    best build the CPU runs, landed in the test run's own cache directory (tests/conftest.py), not the
    user's."""
    assert rows_available(), rows_unavailable_reason()
    assert kernels.rows_isa() == kernels.runnable_isas()[0]
    cache = Path(os.environ["MOEKIT_CACHE"]) / "kernels"
    assert len(list(cache.glob(f"decode-{kernels.rows_isa()}-*.so"))) == 1


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        *[(1, 1, 1), (1, 37, 70), (2, 130, 1024), (3, 5, 33), (5, 64, 32), (1, 4, 31), (7, 33, 1000)],
        *[(16, 130, 48), (5, 301, 4100), (3, 4, 0), (4, 9, 15)],
    ],
)
def test_rows_equal_the_exact_sums_rounded(M: int, N: int, K: int, threads: int, kernel_isa: str) -> None:
    """Random bf16 rows and weights: within the bound above; integer ones (sums exact in fp32, of any
    size up to 2^24): the exact sum rounded to bf16, bit for bit. Row counts past two and odd weight
    widths take the kernel's remainder paths (K not a multiple of 16 or 32: the AVX2 build's scalar tail,
    the AVX-512 build's masked loads); three threads split 130 rows unevenly; 301 rows of 4100 span
    several of the AVX2 build's chunks of weight rows; no columns, or fewer than 16, from three rows."""
    assert kernels.rows_isa() == kernel_isa
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
        x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
        exact = x.double() @ w.double().t()
        bound = 2.0**-8 * exact.abs() + K * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        assert bool(((rows_bf16(x, w).double() - exact).abs() <= bound).all())
        xi = torch.randint(-40, 41, (M, K), generator=g).bfloat16()  # |sum| < 40 * 40 * 1024 < 2^24
        wi = torch.randint(-40, 41, (N, K), generator=g).bfloat16()
        assert torch.equal(rows_bf16(xi, wi), (xi.double() @ wi.double().t()).bfloat16())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(threads: int, kernel_isa: str) -> None:
    """A serving step's sequence, one row among many, gets what it would alone (a batch-1 decode): from
    three rows the AVX2 build widens them once and takes two weight rows at a time, the sums in the same
    order. Every count of rows up to 8 (each remainder of the tiles of three) and 31, over an odd count of
    weight rows and a K with a scalar tail, in one chunk of weight rows and in several (K = 4100: 14 rows
    a chunk, the next one prefetched)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for N, K in ((37, 1000), (301, 4100)):
            x, w = torch.randn(31, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
            alone = torch.cat([rows_bf16(x[i : i + 1], w) for i in range(len(x))])
            for M in [*range(2, 9), 31]:
                assert torch.equal(rows_bf16(x[:M], w).view(torch.int16), alone[:M].view(torch.int16)), (N, M)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("M", "N", "K"), [(1, 1, 1), (1, 37, 70), (4, 130, 1024), (7, 33, 1000), (5, 301, 4100), (3, 4, 0)]
)
def test_fp32_rows_equal_the_exact_sums(M: int, N: int, K: int, threads: int, kernel_isa: str) -> None:
    """The fp32 row kernel: random rows within fp32's summation bound of the float64 sums; integer ones
    (exact in fp32) equal them. Remainders of its tiles of four rows by three weight rows, a K with a
    scalar tail, several chunks of weight rows (301 of 4100), no columns."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        exact = x.double() @ w.double().t()
        bound = (K + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        assert bool(((kernels.rows_f32(x, w).double() - exact).abs() <= bound).all())
        xi, wi = (
            torch.randint(-40, 41, (M, K), generator=g).float(),
            torch.randint(-40, 41, (N, K), generator=g).float(),
        )
        assert torch.equal(kernels.rows_f32(xi, wi), (xi.double() @ wi.double().t()).float())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_fp32_row_gets_the_same_bits_whatever_rows_come_with_it(threads: int, kernel_isa: str) -> None:
    """As the bf16 kernel: each output summed in one order at every count of rows (1 to 9, 16), in one
    chunk of weight rows and in several."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for N, K in ((37, 1000), (301, 4100)):
            x, w = torch.randn(16, K, generator=g), torch.randn(N, K, generator=g)
            alone = torch.cat([kernels.rows_f32(x[i : i + 1], w) for i in range(len(x))])
            for M in [*range(2, 10), 16]:
                assert torch.equal(kernels.rows_f32(x[:M], w), alone[:M]), (N, M)
    finally:
        torch.set_num_threads(before)


def test_a_nan_or_inf_reaches_only_its_own_row(kernel_isa: str) -> None:
    x, w = torch.ones(3, 40, dtype=torch.bfloat16), torch.ones(6, 40, dtype=torch.bfloat16)
    x[1, 7], x[2, 39] = float("nan"), float("inf")
    y = rows_bf16(x, w)
    assert bool((y[0] == 40).all()) and bool(y[1].isnan().all()) and bool((y[2] == float("inf")).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("M", "N", "K"), [(1, 37, 70), (2, 130, 1024), (3, 5, 33), (1, 16, 15)])
def test_int8_rows_equal_the_dequantized_sums(M: int, N: int, K: int, dtype, kernel_isa: str) -> None:
    """``rows_int8`` against float64 sums of the rows times the weight dequantized (``q * scale[n]``, the
    scales spread over four decades, so a scale applied to the wrong output shows): within half a bf16
    unit plus fp32's error; integer rows and unit scales: the exact sum rounded to bf16, bit for bit. K
    not a multiple of 16 takes the scalar tail; three rows a pair and a single."""
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.logspace(-3, 1, N)[torch.randperm(N, generator=g)]
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    bound = 2.0**-8 * exact.abs() + K * 2.0**-24 * (x.double().abs() @ (q.double().abs() * scale.double()[:, None]).t())
    got = kernels.rows_int8(x, q, scale)
    assert got.dtype == torch.bfloat16 and bool(((got.double() - exact).abs() <= bound).all())
    xi = torch.randint(-40, 41, (M, K), generator=g).to(dtype)  # |sum| < 40 * 127 * 1024 < 2^24
    assert torch.equal(kernels.rows_int8(xi, q, torch.ones(N)), (xi.double() @ q.double().t()).bfloat16())
    with pytest.raises(ValueError, match="an int8 weight \\[N, K\\] and scales \\[N\\]"):
        kernels.rows_int8(x, q.float(), scale)


@pytest.mark.parametrize("shape", [(1, 1, 1024), (3, 5, 64), (20, 33), (17, 8)])
@pytest.mark.parametrize("eps", [1e-6, 0.25])
def test_rms_norm_equals_the_written_out_formula(shape: tuple[int, ...], eps: float, kernel_isa: str) -> None:
    """``rms_norm_bf16`` against ``x / sqrt(mean(x^2) + eps) * w`` in float64 over bf16 inputs: within half
    a bf16 unit of each output plus fp32's error (D units of 2^-24); rows of very different sizes, so a
    norm shared between rows shows; 20 and 17 rows split between threads (from 16 rows).
    A NaN reaches its own row alone; a large eps changes the scale (an eps left out would show)."""
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-2] if len(shape) > 1 else 1).unsqueeze(-1)
    x, w = x.bfloat16(), torch.randn(shape[-1], generator=g).bfloat16()
    ref = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.double()
    got = kernels.rms_norm_bf16(x, w, eps)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert bool(((got.double() - ref).abs() <= (2.0**-8 + shape[-1] * 2.0**-24) * ref.abs()).all())
    rows = x.reshape(-1, shape[-1]).clone()
    rows[0, 0] = float("nan")
    nan = kernels.rms_norm_bf16(rows, w, eps).isnan()
    assert bool(nan[0].all()) and not bool(nan[1:].any())
    with pytest.raises(ValueError, match=r"bf16 rows \[..., 64\] and weight \[64\], not torch.float32"):
        kernels.rms_norm_bf16(torch.ones(2, 64), torch.ones(64, dtype=torch.bfloat16), eps)


def _in_format(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A bf16 weight [..., N, K] as the one-token calls take it in ``fmt`` (bf16, or int8 with absmax / 127
    scales per output) and as the references multiply it (int8: dequantised with its scales rounded to
    bf16, as the kernels round them)."""
    if fmt == "bf16":
        return w, None, w
    scale = w.float().abs().amax(-1) / 127
    q = torch.round(w.float() / scale.unsqueeze(-1)).to(torch.int8)
    return q, scale, q.double() * scale.bfloat16().double().unsqueeze(-1)


def _moe_token_reference(x, residual, router, router_bias, selection_bias, top_k, normalize, scale, w_in, w_out):
    """One token through softmax top-k routing and SwiGLU experts, written out in float64 with the
    kernel's bf16 roundings: the picks (ascending) and ``residual + sum_k bf16(w_k) y_k``."""
    logits = x.double() @ router.double().t() + (0 if router_bias is None else router_bias.double())
    probs = torch.softmax(logits, -1)
    picked = sorted((probs + selection_bias.double()).argsort(descending=True)[:top_k].tolist())
    weights = probs[picked]  # the unbiased scores: the selection bias picks, it does not weigh
    if normalize and top_k > 1:
        weights = weights / weights.sum()
    total = torch.zeros(x.shape[0], dtype=torch.float64)
    for e, weight in zip(picked, weights * scale, strict=True):
        gate, up = (x.double() @ w_in[e].double().t()).bfloat16().double().chunk(2)
        a = ((gate * torch.sigmoid(gate)).bfloat16().double() * up).bfloat16()
        y = (a.double() @ w_out[e].double().t()).bfloat16()
        total += (y.double() * weight.bfloat16().double()).bfloat16().double()
    return picked, residual.double() + total.bfloat16().double()


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("D", "F", "E", "top_k", "normalize", "scale", "biased"),
    [(64, 48, 8, 2, True, 1.0, False), (70, 40, 6, 3, False, 2.5, True), (32, 16, 4, 1, True, 1.0, True)],
)
def test_a_moe_token_equals_the_written_out_routing_and_experts(
    D: int,
    F: int,
    E: int,
    top_k: int,
    normalize: bool,
    scale: float,
    biased: bool,
    threads: int,
    fmt: str,
    kernel_isa: str,
) -> None:
    """``moe_token_bf16`` against ``_moe_token_reference``: the same picks, and each output within a bf16
    unit of the reference (the fp32 sums, in their order, may tip a rounding of the products or of the
    activation: 2^-7 of the size of their sum, plus 2^-8 of the result for its own rounding). A
    router bias and a selection bias that forces the weakest expert in (weighed by its own score,
    ``biased``); D = 70 takes the products' scalar tail; three threads split the rows unevenly; the
    experts in bf16 and in int8 (``_in_format``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(D * 100 + E * 10 + top_k)
        x, residual = torch.randn(D, generator=g).bfloat16(), torch.randn(D, generator=g).bfloat16()
        router = torch.randn(E, D, generator=g) * D**-0.5
        router_bias = torch.randn(E, generator=g) if biased else None
        selection_bias = torch.zeros(E)
        if biased:  # the weakest expert by score is picked all the same
            logits = x.float() @ router.t() + router_bias
            selection_bias[int(logits.argmin())] = 10.0
        w_in, w_in_scale, w_in_ref = _in_format((torch.randn(E, 2 * F, D, generator=g) * D**-0.5).bfloat16(), fmt)
        w_out, w_out_scale, w_out_ref = _in_format((torch.randn(E, D, F, generator=g) * F**-0.5).bfloat16(), fmt)
        args = (x, residual, router, router_bias, selection_bias, top_k, normalize, scale)
        out, picked = kernels.moe_token_bf16(x, residual, MoEWeights(*args[2:], w_in, w_out, w_in_scale, w_out_scale))
        want_picked, want = _moe_token_reference(*args, w_in_ref, w_out_ref)
        assert picked.tolist() == want_picked
        if biased:
            assert int(selection_bias.argmax()) in want_picked
        terms = (want - residual.double()).abs()
        assert bool(((out.double() - want).abs() <= 2.0**-7 * terms + 2.0**-8 * want.abs()).all())
    finally:
        torch.set_num_threads(before)


def test_what_the_moe_token_kernel_refuses(kernel_isa: str) -> None:
    x = torch.ones(8, dtype=torch.bfloat16)
    w_in, w_out = torch.ones(4, 6, 8, dtype=torch.bfloat16), torch.ones(4, 8, 3, dtype=torch.bfloat16)
    router, bias = torch.ones(4, 8), torch.zeros(4)
    with pytest.raises(ValueError, match=r"w_in \[E, 2F, 8\] and w_out \[E, 8, F\], not \[4, 6, 8\]"):
        kernels.moe_token_bf16(x, x, MoEWeights(router, None, bias, 2, True, 1.0, w_in, w_out[:, :4]))
    with pytest.raises(
        ValueError, match=r"w_out: a bf16 weight, or int8 with fp32 scales per output, not torch.float32"
    ):
        kernels.moe_token_bf16(x, x, MoEWeights(router, None, bias, 2, True, 1.0, w_in, w_out.float()))
    with pytest.raises(ValueError, match=r"w_in: .*, not torch.int8 \[4, 6, 8\] and \[4, 8\] scales"):
        kernels.moe_token_bf16(
            x, x, MoEWeights(router, None, bias, 2, True, 1.0, w_in.to(torch.int8), w_out, torch.ones(4, 8))
        )
    with pytest.raises(ValueError, match=r"an fp32 router \[4, 8\], biases \[4\] and 1 to 4 picks, not 5"):
        kernels.moe_token_bf16(x, x, MoEWeights(router, None, bias, 5, True, 1.0, w_in, w_out))
    with pytest.raises(ValueError, match=r"biases \[4\]"):  # a bias too short would be read past its end
        kernels.moe_token_bf16(x, x, MoEWeights(router, bias[:1], bias, 2, True, 1.0, w_in, w_out))
    with pytest.raises(ValueError, match="one token's bf16"):
        kernels.moe_token_bf16(x, x.float(), MoEWeights(router, None, bias, 2, True, 1.0, w_in, w_out))
    with pytest.raises(ValueError, match="one token's bf16"):
        kernels.moe_token_bf16(x[:4], x, MoEWeights(router, None, bias, 2, True, 1.0, w_in, w_out))


def _attention_token_reference(x, norm, eps, qkv, qkv_bias, rope, keys, values, position, heads, out, out_bias):
    """One token through RMSNorm, the grouped qkv projection, RoPE on (x[2j], x[2j+1]) pairs, attention
    over the cached positions and this one, the output projection and the residual, in float64 with the
    kernel's bf16 roundings: the block's output and this position's key and value per group."""
    G, _, d = keys.shape
    Q = heads // G
    normed = (x.double() / (x.double().pow(2).mean() + eps).sqrt() * norm.double()).bfloat16()
    h = (normed.double() @ qkv.double().t()).bfloat16()
    if qkv_bias is not None:
        h = (h.double() + qkv_bias.double()).bfloat16()
    cos, sin = rope.double().unbind(-1)

    def rotate(v):  # [n, d]
        a, b = v.double().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).bfloat16()

    groups = h.view(G, Q + 2, d)
    q = rotate(groups[:, :Q]).view(heads, d)
    k_new, v_new = rotate(groups[:, Q]), groups[:, Q + 1]
    k = torch.cat([keys[:, :position], k_new.unsqueeze(1)], 1).double()  # [G, position + 1, d]
    v = torch.cat([values[:, :position], v_new.unsqueeze(1)], 1).double()
    kh, vh = k.repeat_interleave(Q, 0), v.repeat_interleave(Q, 0)
    weights = torch.softmax((q.double().unsqueeze(1) * kh).sum(-1) * d**-0.5, -1)  # [heads, position + 1]
    attended = (weights.unsqueeze(-1) * vh).sum(1).bfloat16().view(-1)
    y = (attended.double() @ out.double().t()).bfloat16()
    if out_bias is not None:
        y = (y.double() + out_bias.double()).bfloat16()
    return (x.double() + y.double()).bfloat16(), y.double(), k_new, v_new


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("heads", "G", "d", "biased"), [(4, 2, 32, False), (6, 3, 64, True), (2, 1, 128, False)])
def test_an_attention_token_equals_the_written_out_block_half(
    heads: int, G: int, d: int, biased: bool, threads: int, fmt: str, kernel_isa: str
) -> None:
    """``attention_token_bf16`` against ``_attention_token_reference``: its output within a bf16 unit of
    the reference (2^-8 of it, plus 2^-6 of the attention's part for a rounding the fp32 sums tip on the
    way); this position's key and value written in place within a unit (a rounding the sums tip), the
    other positions left as they were. Query heads grouped over their key/value heads; biases on both
    projections; three threads split the rows and the heads unevenly; the projections in bf16 and in
    int8 (``_in_format``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(heads * 100 + d)
        D, S, position = 96, 9, 5
        x, norm = torch.randn(D, generator=g).bfloat16(), (1 + torch.randn(D, generator=g) / 4).bfloat16()
        qkv, qkv_scale, qkv_ref = _in_format(
            (torch.randn((heads + 2 * G) * d, D, generator=g) * D**-0.5).bfloat16(), fmt
        )
        out, out_scale, out_ref = _in_format(
            (torch.randn(D, heads * d, generator=g) * (heads * d) ** -0.5).bfloat16(), fmt
        )
        qkv_bias = torch.randn((heads + 2 * G) * d, generator=g).bfloat16() if biased else None
        out_bias = torch.randn(D, generator=g).bfloat16() if biased else None
        angles = torch.rand(d // 2, generator=g) * 6.28
        rope = torch.stack([angles.cos(), angles.sin()], -1)
        keys, values = torch.randn(2, G, S, d, generator=g).bfloat16().unbind(0)
        keys, values = keys.contiguous(), values.contiguous()
        cache = (rope, keys.clone(), values.clone(), position, heads)
        want, part, k_new, v_new = _attention_token_reference(
            x, norm, 1e-5, qkv_ref, qkv_bias, *cache, out_ref, out_bias
        )
        weights = AttentionWeights(
            norm, 1e-5, qkv, qkv_bias, cache[1], cache[2], heads, out, out_bias, qkv_scale, out_scale
        )
        got = kernels.attention_token_bf16(x, rope, position, weights)
        bound = 2.0**-8 * want.double().abs() + 2.0**-6 * part.abs().max()
        assert bool(((got.double() - want.double()).abs() <= bound).all())
        written_k, written_v = cache[1], cache[2]
        for written, new in ((written_k, k_new), (written_v, v_new)):
            assert bool(((written[:, position].double() - new.double()).abs() <= 2.0**-8 * new.double().abs()).all())
        others = [p for p in range(S) if p != position]
        assert torch.equal(written_k[:, others], keys[:, others]) and torch.equal(
            written_v[:, others], values[:, others]
        )
    finally:
        torch.set_num_threads(before)


def test_what_the_attention_token_kernel_refuses(kernel_isa: str) -> None:
    x, qkv, out = (
        torch.ones(64, dtype=torch.bfloat16),
        torch.ones(256, 64, dtype=torch.bfloat16),
        torch.ones(64, 128, dtype=torch.bfloat16),
    )
    keys, rope = torch.zeros(2, 8, 32, dtype=torch.bfloat16), torch.zeros(16, 2)
    weights = AttentionWeights(x, 1e-5, qkv, None, keys, keys.clone(), 4, out, None)
    kernels.attention_token_bf16(x, rope, 7, weights)  # 4 heads of 32 over 2 groups, the last position
    with pytest.raises(ValueError, match="at a cached position: 8"):
        kernels.attention_token_bf16(x, rope, 8, weights)
    with pytest.raises(ValueError, match="bf16 weights for 3 heads over 2 groups of 32"):
        kernels.attention_token_bf16(x, rope, 0, weights._replace(heads=3))
    with pytest.raises(ValueError, match="bf16 weights for 4 heads over 2 groups of 32"):  # a bias too short
        kernels.attention_token_bf16(x, rope, 0, weights._replace(out_bias_D=x[:8]))
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        strided = keys.transpose(0, 1).contiguous().transpose(0, 1)
        kernels.attention_token_bf16(x, rope, 0, weights._replace(keys_GSd=strided))
    with pytest.raises(ValueError, match=r"one token's bf16 activations \[D\], not torch.float32"):
        kernels.attention_token_bf16(x.float(), rope, 0, weights)


def _block(g: torch.Generator, D: int, heads: int, G: int, F: int, E: int, top_k: int, S: int) -> dict:
    """A block's random bf16 weights, a cache of ``S`` positions and a norm for each half."""
    d = 32
    return {
        "norm": (1 + torch.randn(D, generator=g) / 4).bfloat16(),
        "qkv": (torch.randn((heads + 2 * G) * d, D, generator=g) * D**-0.5).bfloat16(),
        "keys": torch.randn(G, S, d, generator=g).bfloat16(),
        "values": torch.randn(G, S, d, generator=g).bfloat16(),
        "heads": heads,
        "out": (torch.randn(D, heads * d, generator=g) * (heads * d) ** -0.5).bfloat16(),
        "ffn_norm": (1 + torch.randn(D, generator=g) / 4).bfloat16(),
        "router": torch.randn(E, D, generator=g) * D**-0.5,
        "selection_bias": torch.zeros(E),
        "top_k": top_k,
        "w_in": (torch.randn(E, 2 * F, D, generator=g) * D**-0.5).bfloat16(),
        "w_out": (torch.randn(E, D, F, generator=g) * F**-0.5).bfloat16(),
    }


def _weights(b: dict) -> kernels.BlockWeights:
    attention = AttentionWeights(b["norm"], 1e-5, b["qkv"], None, b["keys"], b["values"], b["heads"], b["out"], None)
    moe = MoEWeights(b["router"], None, b["selection_bias"], b["top_k"], True, 1.0, b["w_in"], b["w_out"])
    return kernels.BlockWeights(attention, b["ffn_norm"], 1e-5, moe)


@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_in_one_call_equal_the_written_out_blocks(threads: int, kernel_isa: str) -> None:
    """``blocks_token_bf16`` over three blocks of different shapes (query heads 4/2/6 over 2/1/3 groups, 8
    experts of 40 / 6 of 24 / 4 of 64, top 2/3/1: the scratch is the largest block's) against
    ``_attention_token_reference``, a written-out RMSNorm and ``_moe_token_reference`` chained block after
    block in float64 with the kernels' bf16 roundings: the same picks in each layer, the output within
    2^-6 of its largest value (a rounding the fp32 sums tip in one block moves the next block's input by
    a bf16 unit), each cache's new position written and the others left as they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(7)
        D, S, position = 96, 9, 6
        shapes = [(4, 2, 40, 8, 2), (2, 1, 24, 6, 3), (6, 3, 64, 4, 1)]
        blocks = [_block(g, D, heads, G, F, E, top_k, S) for heads, G, F, E, top_k in shapes]
        angles = torch.rand(16, generator=g) * 6.28
        rope = torch.stack([angles.cos(), angles.sin()], -1)
        x = torch.randn(D, generator=g).bfloat16()
        before_keys = [b["keys"].clone() for b in blocks]
        got, picks = kernels.blocks_token_bf16(x, [_weights(b) for b in blocks], rope, position)
        want, want_picks = x, []
        for b, keys in zip(blocks, before_keys, strict=True):
            mid, _, k_new, _ = _attention_token_reference(
                want, b["norm"], 1e-5, b["qkv"], None, rope, keys, b["values"], position, b["heads"], b["out"], None
            )
            assert bool(
                ((b["keys"][:, position].double() - k_new.double()).abs() <= 2.0**-7 * k_new.double().abs()).all()
            )
            others = [p for p in range(S) if p != position]
            assert torch.equal(b["keys"][:, others], keys[:, others])
            normed = (mid.double() / (mid.double().pow(2).mean() + 1e-5).sqrt() * b["ffn_norm"].double()).bfloat16()
            args = (b["router"], None, b["selection_bias"], b["top_k"], True, 1.0, b["w_in"], b["w_out"])
            picked, out = _moe_token_reference(normed, mid, *args)
            want_picks.append(picked)
            want = out.bfloat16()
        assert [p.tolist() for p in picks] == want_picks
        assert float((got.double() - want.double()).abs().max()) <= 2.0**-6 * float(want.double().abs().max())
    finally:
        torch.set_num_threads(before)


def test_what_the_blocks_call_refuses(kernel_isa: str) -> None:
    g = torch.Generator().manual_seed(3)
    block = _block(g, 64, 4, 2, 16, 4, 2, 8)
    rope, x = torch.zeros(16, 2), torch.ones(64, dtype=torch.bfloat16)
    kernels.blocks_token_bf16(x, [_weights(block)], rope, 7)
    with pytest.raises(ValueError, match=r"the MoE layer's RMSNorm takes a bf16 weight \[64\]"):
        kernels.blocks_token_bf16(x, [_weights(block)._replace(norm_D=block["ffn_norm"][:32])], rope, 0)
    with pytest.raises(ValueError, match=r"a MoE layer's call takes w_in \[E, 2F, 64\]"):  # experts of another width
        narrow = _weights(block).moe._replace(w_in_END=block["w_in"][:, :, :32].contiguous())
        kernels.blocks_token_bf16(x, [_weights(block)._replace(moe=narrow)], rope, 0)
    with pytest.raises(ValueError, match="an attention half's call takes bf16 weights"):  # a token of another width
        kernels.blocks_token_bf16(x[:32], [_weights(block)], rope, 0)
    with pytest.raises(ValueError, match="at a cached position: 8"):
        kernels.blocks_token_bf16(x, [_weights(block)], rope, 8)
    with pytest.raises(ValueError, match="one token's bf16 activations"):
        kernels.blocks_token_bf16(x.float(), [_weights(block)], rope, 0)


@needs_rows
def test_what_the_kernel_refuses() -> None:
    w = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bf16 rows \[M, K\] and a bf16 weight \[N, K\], not torch.float32"):
        rows_bf16(torch.ones(1, 8), w)
    with pytest.raises(ValueError, match="not torch.bfloat16 \\[1, 9\\]"):
        rows_bf16(torch.ones(1, 9, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="contiguous weight"):
        rows_bf16(torch.ones(1, 4, dtype=torch.bfloat16), w.t())
    with pytest.raises(RuntimeError, match="records no gradient"):
        rows_bf16(torch.ones(1, 8, dtype=torch.bfloat16, requires_grad=True), w)
    fp32_and_bf16 = r"rows_f32 takes fp32 rows \[M, K\] and an fp32 weight \[N, K\], not torch.float32 \[1, 8\] and"
    with pytest.raises(ValueError, match=fp32_and_bf16):
        kernels.rows_f32(torch.ones(1, 8), w)
    with pytest.raises(ValueError, match="rows_f32 takes a contiguous weight"):
        kernels.rows_f32(torch.ones(1, 4), torch.ones(4, 8).t())


@pytest.mark.slow
@can_build
def test_a_build_is_kept_per_source_isa_and_compiler(tmp_path: Path) -> None:
    """Built once, then found: the same file, untouched, readable by others; another compiler command
    builds its own file, and so do an edited source and another instruction set (the digest and the
    name cover all three; a CPU need not run a build for it to compile)."""
    isa = kernels.rows_isa()
    first = build(kernels.SOURCE, tmp_path, COMPILER, isa)
    stamp = first.stat().st_mtime_ns
    assert build(kernels.SOURCE, tmp_path, COMPILER, isa) == first and first.stat().st_mtime_ns == stamp
    assert first.stat().st_mode & 0o055 == 0o055 & ~_umask(), "group and others may read and load it"
    other = build(kernels.SOURCE, tmp_path, f"{COMPILER} -g0", isa)
    edited = tmp_path / "src" / "decode.c"
    edited.parent.mkdir()
    edited.write_text(kernels.SOURCE.read_text() + "\n/* edited */\n")
    third = build(edited, tmp_path, COMPILER, isa)
    fourth = build(kernels.SOURCE, tmp_path, COMPILER, next(i for i in ISAS if i != isa))
    assert len({first, other, third, fourth}) == 4 and all(f.exists() for f in (other, third, fourth))
    built = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert built == sorted(f.name for f in (first, other, third, fourth)), "no partial file left"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@can_build
def test_build_failures_name_the_compiler_and_its_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="no-such-compiler-here: No such file"):
        build(kernels.SOURCE, tmp_path, "no-such-compiler-here", "avx2")
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undeclared; }\n")
    with pytest.raises(OSError, match="could not build broken.c: .*undeclared"):
        build(broken, tmp_path / "out", COMPILER, "avx2")
    assert not any((tmp_path / "out").iterdir()), "a failed build leaves no file behind"


@pytest.mark.slow
def test_without_the_kernel_the_row_layout_falls_back_to_onednn(tmp_path: Path) -> None:
    """A process whose compiler is missing: the kernels say why, and a batch-1 load keeps oneDNN's packed
    layout (run in a child, as the library is found once per process)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from moekit import kernels, runconfig\n"
        "from moekit.model import Transformer\n"
        "from moekit.infer.resident_experts import prepack_\n"
        "print(kernels.rows_available(), kernels.rows_unavailable_reason())\n"
        "cfg = runconfig.resolve('tiny', {'model.n_layers': '1'})\n"
        "model = prepack_(Transformer(cfg.model, cfg.moe).bfloat16().eval(), few_rows=True)\n"
        "print(type(model.moe_layers()[0].experts).__name__)\n"
    )
    env = {**os.environ, "CC": "no-such-compiler-here", "MOEKIT_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    availability, experts = out.strip().splitlines()
    if kernels.runnable_isas():
        assert availability == "False no-such-compiler-here: No such file or directory"
    else:
        assert availability.startswith("False this CPU lacks")
    from moekit.experts.matmul import prepackable

    packs = prepackable(torch.empty(1, dtype=torch.bfloat16))
    assert experts == ("PackedExperts" if packs else "GroupedExperts")


def test_the_flags_name_what_the_kernel_needs() -> None:
    """Each build asks for exactly the instruction sets its part of the source checks for at run time."""
    source = kernels.SOURCE.read_text()
    avx512, avx2 = source.split("#elif defined(__AVX2__) && defined(__FMA__)")
    for part, isa in ((avx512, "avx512_bf16"), (avx2, "avx2")):
        checked = set(re.findall(r'__builtin_cpu_supports\("(\w+)"\)', part))
        assert checked == {flag.removeprefix("-m") for flag in ISAS[isa][0]}
        assert checked == {name.replace("_", "") for name in ISAS[isa][1]}, "/proc/cpuinfo's names of the same"


def test_the_isa_setting_caps_and_names_what_runs(monkeypatch) -> None:
    """``$MOEKIT_MAX_CPU_ISA``: none turns the kernels off (not a failure a user must hear of), a name that
    is no build is a failure naming the variable, and a build caps the choice at it."""
    try:
        monkeypatch.setenv(kernels.ISA_VARIABLE, "none")
        kernels._library.cache_clear()
        assert not rows_available() and rows_unavailable_reason() == "MOEKIT_MAX_CPU_ISA=none"
        assert kernels.rows_build_failure() == "" and kernels.rows_isa() is None
        monkeypatch.setenv(kernels.ISA_VARIABLE, "avx9000")
        kernels._library.cache_clear()
        assert not rows_available()
        assert kernels.rows_build_failure() == "MOEKIT_MAX_CPU_ISA=avx9000 is none of avx512_bf16, avx2, none"
        monkeypatch.setenv(kernels.ISA_VARIABLE, "AVX2")
        isa, why = kernels.chosen_isa()
        if "avx2" in kernels.runnable_isas():
            assert (isa, why) == ("avx2", "")
        else:
            assert isa is None and why.startswith("this CPU lacks")
    finally:
        monkeypatch.undo()
        kernels._library.cache_clear()
