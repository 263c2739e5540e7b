"""Inference matmuls on the CPU (``moekit.experts.matmul``) against a float64 product of the same numbers.

Every layout and kernel choice (output-major or not, oneDNN on or off for one token, upcast or native)
must give ``x @ w`` within the rounding of the output's dtype: the reference is ``x.double() @
w.double()`` (the inputs are exactly representable), the tolerance the output dtype's half ulp at the
magnitude of ``|x| @ |w|`` plus the 16-bit products' own accumulation error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moekit.experts.matmul import inference_layout, mm, native_16bit, single_token_kernels, upcasts

EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _check(x, w, y) -> None:
    ref = x.double() @ w.double()
    scale = x.double().abs() @ w.double().abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.double() - ref).abs()
    # NOTE: the output is rounded once to its dtype (half an ulp, at most EPS * |ref|); the products are
    # accumulated in at least fp32, adding ~K * 2^-24 of the absolute sum.
    bound = EPS[x.dtype] * ref.abs() + 64 * 2.0**-24 * scale + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inference_layout_keeps_the_values_and_stores_16_bits_output_major(dtype) -> None:
    w = torch.randn(3, 16, 24)
    laid = inference_layout(w, dtype)
    assert laid.shape == w.shape and torch.equal(laid, w.to(dtype))
    if dtype == torch.float32:
        assert laid.is_contiguous()
    else:
        assert laid.mT.is_contiguous() and not laid.is_contiguous(), "[E, N, K] storage under an [E, K, N] view"
    assert inference_layout(laid, dtype) is laid, "already laid out: no copy"
    meta = inference_layout(torch.empty(3, 16, 24, device="meta"), dtype)
    assert meta.is_meta and meta.stride() == laid.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 17])
@pytest.mark.parametrize("output_major", [True, False])
def test_mm_equals_a_float64_product_in_every_layout_and_kernel(dtype, rows, output_major) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(96, 80, generator=g).to(dtype)
    if output_major:
        w = w.t().contiguous().t()
    for tokens in (rows, 1):  # single_token_kernels switches oneDNN off for a one-token forward
        with single_token_kernels(tokens):
            _check(x, w, mm(x, w))
            out = torch.full((rows + 2, 80), float("nan"), dtype=dtype)
            mm(x, w, out=out[1 : rows + 1])
            _check(x, w, out[1 : rows + 1])
            assert out[0].isnan().all() and out[-1].isnan().all(), "wrote outside out"


def test_single_token_kernels_restore_onednn() -> None:
    before = torch._C._get_mkldnn_enabled()
    with single_token_kernels(1):
        assert not torch._C._get_mkldnn_enabled() or not torch.backends.mkldnn.is_available()
    with single_token_kernels(2):
        assert torch._C._get_mkldnn_enabled() == before
    with pytest.raises(RuntimeError), single_token_kernels(1):
        raise RuntimeError("a failed forward")
    assert torch._C._get_mkldnn_enabled() == before


def test_overlapping_one_token_forwards_on_two_threads_restore_onednn() -> None:
    """Thread A enters, B enters, A leaves, B leaves: oneDNN is back on (a save/restore per block left it
    off for good: B saved A's 'off')."""
    import threading

    before = torch._C._get_mkldnn_enabled()
    a_in, b_in, a_left = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with single_token_kernels(1):
            a_in.set()
            b_in.wait()
        a_left.set()

    def b() -> None:
        a_in.wait()
        with single_token_kernels(1):
            b_in.set()
            a_left.wait()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch._C._get_mkldnn_enabled() == before


_WITHOUT_NATIVE_BF16 = """
import torch
from moekit.experts.matmul import mm, native_16bit, upcasts
assert not native_16bit(torch.bfloat16), "ONEDNN_MAX_CPU_ISA=AVX2 leaves no native bf16"
x = torch.randn(9, 64).bfloat16(); w = torch.randn(64, 40).bfloat16().t().contiguous().t()
assert upcasts(x, w) and not upcasts(x[:1], w)
ref = (x.double() @ w.double()).to(torch.bfloat16)
y = mm(x, w)
print(float((y.double() - ref.double()).abs().max()), float(ref.double().abs().max()))
"""


@pytest.mark.slow
def test_a_cpu_without_native_bf16_upcasts_many_rows_and_stays_exact_to_rounding() -> None:
    """oneDNN limited to AVX2 (no AVX512-BF16, no AMX), as on many laptops: ``native_16bit`` says so and
    ``mm`` upcasts; its result is the float64 product rounded to bf16, within one bf16 ulp."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", _WITHOUT_NATIVE_BF16], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    err, magnitude = map(float, out.stdout.split())
    assert err <= magnitude * 2.0**-7


def test_upcast_rule_follows_rows_and_native_support() -> None:
    x1, x8 = torch.randn(1, 8, dtype=torch.float16), torch.randn(8, 8, dtype=torch.float16)
    w = torch.randn(8, 8, dtype=torch.float16)
    assert not upcasts(x1, w)
    assert upcasts(x8, w) == (not native_16bit(torch.float16))
    assert not upcasts(x8.float(), w.float())
