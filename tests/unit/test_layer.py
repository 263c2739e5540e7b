"""The MoE layer against the per-token reference (fp32, atol 1e-5), edge cases, dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ROUTER_CASES
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit import MoE, MoEConfig
from moekit.reference import moe_per_token

ATOL = 1e-5


def build(seed: int = 0, **overrides) -> MoE:
    torch.manual_seed(seed)
    cfg = dict(d_model=16, d_ff=24, num_experts=6, top_k=2) | overrides
    moe = MoE(MoEConfig(**cfg))
    if moe.router.__class__.__name__ == "TopKRouter" and moe.router.noise is not None:
        torch.nn.init.normal_(moe.router.noise.weight, std=0.3)  # make the noise matter
    for name, p in moe.named_parameters():
        if name.endswith("bias"):  # zero-initialised biases would test nothing
            torch.nn.init.normal_(p, std=0.5)
    return moe


def run_with_grads(fn, moe: MoE, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and the gradients of a fixed random projection of it w.r.t. x and every parameter."""
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)  # same noise / random dispatch draws for both implementations
    y = fn(x)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * probe).sum().backward()
    grads = {"x": x.grad}
    grads |= {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in moe.named_parameters()}
    return y.detach(), grads


def assert_matches_reference(moe: MoE, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
    y, grads = run_with_grads(lambda x: moe(x, token_ids=token_ids), moe, x, seed=7)
    y_ref, grads_ref = run_with_grads(lambda x: moe_per_token(moe, x, token_ids)[0], moe, x, seed=7)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], atol=ATOL, rtol=0, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("gemm", ["per_expert_mm", "grouped_mm"])
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_matches_per_token_reference(case: str, gemm: str) -> None:
    moe = build(**ROUTER_CASES[case], gemm=gemm)
    moe.train()
    x = torch.randn(3, 11, 16)
    token_ids = torch.randint(0, 50, (3, 11))
    assert_matches_reference(moe, x, token_ids)


def test_reports_dropped_like_reference() -> None:
    moe = build(capacity_factor=0.5)
    x = torch.randn(40, 16)
    _, stats = moe(x, return_stats=True)
    _, dropped = moe_per_token(moe, x)
    assert stats.num_dropped == dropped > 0
    assert int(stats.tokens_per_expert.sum()) == 40 * 2


def test_uneven_load_and_idle_experts() -> None:
    moe = build(num_experts=8)
    with torch.no_grad():  # experts 5..7 never win: they get no token
        moe.router.gate.weight[5:] = -10.0 * moe.router.gate.weight[:3].abs().sum(0)
    x = torch.randn(25, 16).abs()
    _, stats = moe(x, return_stats=True)
    assert stats.tokens_per_expert[5:].sum() == 0
    assert stats.tokens_per_expert.max() > 2 * stats.tokens_per_expert.float().mean()
    assert_matches_reference(moe, x)


@pytest.mark.parametrize("router", ["topk", "noisy_topk", "hash"])
def test_top_k_equal_to_num_experts(router: str) -> None:
    moe = build(router=router, num_experts=4, top_k=4)
    assert_matches_reference(moe, torch.randn(9, 16), torch.arange(9))


@pytest.mark.parametrize("case", ["topk-softmax", "switch", "expert_choice", "capacity"])
def test_single_token(case: str) -> None:
    moe = build(**ROUTER_CASES[case])
    assert_matches_reference(moe, torch.randn(1, 16))


@pytest.mark.parametrize("gemm", ["per_expert_mm", "grouped_mm"])
def test_no_tokens(gemm: str) -> None:
    moe = build(gemm=gemm)
    x = torch.randn(0, 16, requires_grad=True)
    y, stats = moe(x, return_stats=True)
    assert y.shape == (0, 16)
    assert stats.aux_loss.item() == 0 and stats.z_loss.item() == 0 and stats.num_dropped == 0
    (y.sum() + stats.loss).backward()
    assert x.grad.shape == (0, 16)


@pytest.mark.parametrize("tokens", [1, 2, 9])
@pytest.mark.parametrize("case", ["topk-softmax", "capacity", "shared+gelu", "gpt-oss", "expert_choice"])
def test_inference_path_matches_reference(case: str, tokens: int) -> None:
    """Without autograd (decoding) the expert matmuls and SwiGLU skip their autograd.Functions: the
    outputs equal those computed under autograd bit for bit, and the per-token reference's to ATOL;
    stats without losses carry the same counts."""
    moe = build(**ROUTER_CASES[case], gemm="per_expert_mm").eval()
    x = torch.randn(tokens, 16)
    y_recorded, stats = moe(x, return_stats=True)  # the parameters require grad: the Function path
    assert y_recorded.requires_grad
    with torch.no_grad():
        y, counts = moe(x, return_stats=True, losses=False)
        y_ref, _ = moe_per_token(moe, x)
    assert torch.equal(y, y_recorded.detach())
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    assert counts.aux_loss is None and counts.z_loss is None and counts.loss is None
    assert torch.equal(counts.tokens_per_expert, stats.tokens_per_expert)
    assert torch.equal(counts.dropped_per_expert, stats.dropped_per_expert) and counts.num_tokens == tokens


def test_one_expert_top1_equals_dense_ffn() -> None:
    moe = build(num_experts=1, top_k=1)
    x = torch.randn(4, 7, 16)
    w_in, w_out = moe.experts.w_in[0], moe.experts.w_out[0]
    gate, up = (x @ w_in).chunk(2, dim=-1)
    dense = (F.silu(gate) * up) @ w_out
    torch.testing.assert_close(moe(x), dense, atol=ATOL, rtol=0)


def test_gemm_backends_agree_and_survive_zero_stride_grads() -> None:
    x = torch.randn(2, 13, 16)
    outs, grads = [], []
    for gemm in ("per_expert_mm", "grouped_mm"):
        moe = build(gemm=gemm)
        xg = x.clone().requires_grad_()
        y = moe(xg)
        y.sum().backward()  # expanded (zero-stride) incoming gradient
        outs.append(y.detach())
        grads.append((xg.grad, moe.experts.w_in.grad, moe.experts.w_out.grad))
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=0)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("gemm", ["per_expert_mm", "grouped_mm"])
def test_bf16_forward_backward(gemm: str) -> None:
    moe = build(gemm=gemm, num_shared_experts=1)
    x = torch.randn(2, 9, 16)
    y32 = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_auto, stats = moe(x, return_stats=True)
    assert stats.aux_loss.dtype == torch.float32  # router stays in fp32 under autocast
    y_auto.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in moe.experts.parameters())
    torch.testing.assert_close(y_auto.float(), y32, atol=0.05, rtol=0.05)
    moe_bf16 = build(gemm=gemm).to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_()
    yb = moe_bf16(xb)
    assert yb.dtype == torch.bfloat16
    yb.sum().backward()
    assert xb.grad is not None and torch.isfinite(xb.grad.float()).all()


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 20),
    num_experts=st.integers(1, 6),
    data=st.data(),
)
def test_property_shapes_and_k(tokens: int, num_experts: int, data) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    capacity = data.draw(st.sampled_from([None, 0.5, 1.0, 2.0]))
    moe = build(num_experts=num_experts, top_k=top_k, capacity_factor=capacity, d_model=8, d_ff=12)
    x = torch.randn(tokens, 8)
    y, stats = moe(x, return_stats=True)
    assert y.shape == x.shape
    assert int(stats.tokens_per_expert.sum()) == tokens * top_k
    if capacity is None:
        assert stats.num_dropped == 0
    assert_matches_reference(moe, x)
