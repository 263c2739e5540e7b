"""The MoE layer on a CUDA device against the per-token reference, computed on the CPU in float64.

fp32 on the GPU is held to 2e-5 (cuBLAS fp32 matmuls, no TF32, differ from float64 by rounding only);
bf16 autocast, the training path, to a relative error (in norm) of 2e-2 (bf16 operands carry 8 bits of mantissa,
accumulation stays fp32). The router runs in fp32 under autocast, so routing equals the reference's.
Routers that draw random numbers (noisy top-k, GShard's random second expert) are left out: the
CUDA generator's draws differ from the CPU's."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ROUTER_CASES

from moekit import MoE, MoEConfig
from moekit.experts.gemm import grouped_matmul, resolve_backend
from moekit.reference import moe_per_token

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FP32_ATOL = 2e-5
BF16_REL = 2e-2
# Routers that draw random numbers differ between the CUDA and CPU generators: left out.
CASES = {name: case for name, case in ROUTER_CASES.items() if name not in ("noisy_topk", "gshard")}


def build(**overrides) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**(dict(d_model=32, d_ff=48, num_experts=6, top_k=2) | overrides)))
    for name, p in moe.named_parameters():
        if name.endswith("bias"):  # zero-initialised biases would test nothing
            torch.nn.init.normal_(p, std=0.5)
    return moe


def outputs_and_grads(moe: MoE, fn, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``fn(x)`` and the gradients of a fixed random projection of it, on x and every parameter (on the CPU)."""
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y.double() * probe.to(y.device)).sum().backward()
    params = moe.named_parameters()
    grads = {"x": x.grad} | {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params}
    return y.detach().double().cpu(), {n: g.double().cpu() for n, g in grads.items()}


def reference(moe: MoE, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(moe).to("cpu", torch.float64)
    return outputs_and_grads(ref, lambda x: moe_per_token(ref, x, token_ids.cpu())[0], x.cpu().double())


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(4, 33, 32, generator=g), torch.randint(0, 50, (4, 33), generator=g)


@pytest.mark.parametrize("gemm", ["per_expert_mm", "grouped_mm"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_the_float64_reference(case: str, gemm: str) -> None:
    moe = build(**CASES[case], gemm=gemm).cuda().train()
    x, ids = inputs()
    y, grads = outputs_and_grads(moe, lambda x: moe(x, token_ids=ids.cuda()), x.cuda())
    y_ref, grads_ref = reference(moe, x, ids)
    torch.testing.assert_close(y, y_ref, atol=FP32_ATOL, rtol=0)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], atol=FP32_ATOL, rtol=0, msg=lambda m, n=name: f"grad {n}: {m}")


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: a norm, not the worst element, which a clamp (gpt-oss's SwiGLU) can flip
    between its two sides when bf16 rounding moves a value across the limit."""
    return float((a - b).norm() / b.norm())


BF16_CASES = {name: CASES[name] for name in ("topk-softmax", "capacity", "shared+gelu")}
# gpt-oss's own clamp: at CASES' 0.8 (chosen there to clamp often) bf16 rounding moves ~1% of the
# pre-activations across the limit, whose gradients then flip between zero and not (7% in norm on x).
BF16_CASES["gpt-oss"] = CASES["gpt-oss"] | dict(swiglu_limit=7.0)


@pytest.mark.parametrize("gemm", ["auto", "per_expert_mm", "grouped_mm"])
@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_autocast_matches_the_float64_reference(case: str, gemm: str) -> None:
    """Training's path: fp32 master weights, bf16 autocast; ``auto`` is grouped_mm on compute capability 9.0+."""
    moe = build(**BF16_CASES[case], gemm=gemm).cuda().train()
    x, ids = inputs()

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return moe(x, token_ids=ids.cuda())

    y, grads = outputs_and_grads(moe, forward, x.cuda())
    y_ref, grads_ref = reference(moe, x, ids)
    assert rel_error(y, y_ref) < BF16_REL
    for name, g in grads.items():
        assert rel_error(g, grads_ref[name]) < BF16_REL, name
    assert all(p.grad.dtype == torch.float32 for p in moe.parameters() if p.grad is not None)


def test_auto_picks_grouped_mm_for_bf16_on_hopper() -> None:
    w = torch.randn(4, 8, 8, device="cuda", requires_grad=True)
    x = torch.randn(10, 8, device="cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert resolve_backend("auto", x.bfloat16(), w.bfloat16()) == ("grouped_mm" if hopper else "per_expert_mm")
    assert resolve_backend("auto", x, w) == "per_expert_mm"


def test_bf16_weights_forward_backward() -> None:
    """Weights held in bf16 (inference of a bf16 checkpoint, or training without fp32 masters)."""
    moe = build(gemm="auto").cuda().to(torch.bfloat16)
    x, ids = inputs()
    y, grads = outputs_and_grads(moe, lambda x: moe(x, token_ids=ids.cuda()), x.cuda().bfloat16())
    y_ref, grads_ref = reference(moe, x.bfloat16(), ids)
    assert rel_error(y, y_ref) < BF16_REL
    assert rel_error(grads["x"], grads_ref["x"]) < 5 * BF16_REL  # bf16 gradients chained through two GEMMs


@pytest.mark.parametrize("gemm", ["grouped_mm", "per_expert_mm"])
def test_grouped_gemm_at_uneven_counts_against_float64(gemm: str) -> None:
    """bf16 expert GEMMs at the counts where grouped kernels have broken: experts with no rows (their
    weight gradient must be exactly zero), one row, partial and whole 128-row tiles, and many rows.
    Reference: a float64 loop over the experts on the CPU, from the same bf16 values."""
    counts = torch.tensor([0, 1, 127, 0, 128, 129, 700, 5])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(int(counts.sum()), 256, generator=g).bfloat16()
    w = (torch.randn(len(counts), 256, 384, generator=g) / 16).bfloat16()
    probe = torch.randn(int(counts.sum()), 384, generator=g, dtype=torch.float64)
    xg, wg = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    y = grouped_matmul(xg, wg, counts.cuda(), gemm)
    (y.double() * probe.cuda()).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rows = torch.split(torch.arange(len(x)), counts.tolist())
    y64 = torch.cat([x64[r] @ w64[e] for e, r in enumerate(rows)])
    (y64 * probe).sum().backward()
    assert rel_error(y.detach().double().cpu(), y64.detach()) < 1e-2
    assert rel_error(xg.grad.double().cpu(), x64.grad) < 1e-2
    for e, n in enumerate(counts.tolist()):
        got = wg.grad[e].double().cpu()
        if n == 0:
            assert torch.count_nonzero(got) == 0, f"expert {e} has no rows but a weight gradient"
        else:
            assert rel_error(got, w64.grad[e]) < 1e-2, e
