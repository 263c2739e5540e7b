"""The planner's memory terms against hand-computed values: each block's kept activations
(Korthikanti et al.'s counts), the micro-batches in flight per pipeline rank, and the optimizer
state of the distributed optimizer."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_spec, toy_cluster

from moekit import runconfig
from moekit.parallel.planner import (
    Candidate,
    ModelSpec,
    Shape,
    Workload,
    block_activation_bytes,
    estimate,
    in_flight,
    memory_bytes,
    param_counts,
)

CLUSTER = toy_cluster()


def test_weighted_activation_keeps_no_expert_output() -> None:
    """Gate weights in the activation: each of the 2 routed copies drops its 32 x 4-byte expert output."""
    spec = tiny_spec()
    base = Candidate(4, 1, 1, 1, 1)
    weighted = dataclasses.replace(base, weighted_activation=True)
    assert block_activation_bytes(spec, weighted, True) == pytest.approx(768 + 2304 - 2 * 128)
    assert block_activation_bytes(spec, weighted, False) == block_activation_bytes(spec, base, False)


def test_block_activations_follow_korthikanti() -> None:
    """Kept bytes per token of one block (D 32, q 32, K + V 64, experts F 64 SwiGLU top-2, 4-byte values):
    attention 4 (D + D + q + q + kv) = 768, the MoE layer 4 (D + D) + 2 x 4 (D + 2F + F + D) = 2304."""
    spec = tiny_spec()
    base = Candidate(4, 1, 1, 1, 1)
    assert block_activation_bytes(spec, base, True) == pytest.approx(768 + 2304)
    sp = Candidate(2, 1, 2, 1, 1, sp=True)  # everything split over tp
    assert block_activation_bytes(spec, sp, True) == pytest.approx((768 + 2304) / 2)
    tp = dataclasses.replace(sp, sp=False)  # norms' tensors and routed rows repeated on both tp ranks
    assert block_activation_bytes(spec, tp, True) == pytest.approx(256 + 512 / 2 + 2304)
    # fp8: the kept GEMM inputs (norm outputs, attention output, permuted rows, activation outputs) at 1 byte.
    fp8 = dataclasses.replace(base, fp8=True)
    assert block_activation_bytes(spec, fp8, True) == pytest.approx((128 + 32 + 32 + 384) + 160 + 2 * 736)
    sel = dataclasses.replace(base, recompute="selective")  # no norm outputs, no expert activation outputs
    assert block_activation_bytes(spec, sel, True) == pytest.approx((128 + 128 + 384) + 128 + 2 * 768)
    assert block_activation_bytes(spec, dataclasses.replace(base, recompute="experts"), True) == pytest.approx(
        768 + 256 + 2 * 128
    )
    assert block_activation_bytes(spec, dataclasses.replace(base, recompute="full"), True) == pytest.approx(128)
    # Korthikanti's GPT block (GELU FFN of 4D, 2-byte values): sbh(34 + 5as/h) less the s^2 terms flash
    # attention drops and the two dropout masks, 32 sbh; with tp alone 8 sbh repeated and 24 sbh / t.
    cfg = runconfig.resolve("tiny", {"model.mlp_activation": "gelu", "model.d_ff": "128"})
    gpt = ModelSpec("gpt", cfg.model, cfg.moe, Workload(global_batch=16, dtype_bytes=2))
    assert block_activation_bytes(gpt, base, False) == pytest.approx(32 * 32)
    assert block_activation_bytes(gpt, tp, False) == pytest.approx((8 + 24 / 2) * 32)


def test_pipeline_ranks_in_flight() -> None:
    """1F1B: the first rank holds pp micro-batches, the last 1; interleaved, Korthikanti's pp (1 + (pp - 1) /
    (pp vp)) on the first."""
    assert in_flight(Candidate(2, 1, 1, 1, 4)) == (1.0, 1.0)
    assert in_flight(Candidate(2, 1, 1, 4, 8)) == (4.0, 1.0)
    assert in_flight(Candidate(2, 1, 1, 4, 8, vp=2)) == (4 * (1 + 3 / 8), 5 / 2)
    assert in_flight(Candidate(2, 1, 1, 4, 1)) == (1.0, 1.0)  # fewer micro-batches than stages
    # all-to-alls overlapped in both passes: one more warm-up chunk (Megatron's combined 1F1B) on every rank
    assert in_flight(Candidate(2, 2, 1, 4, 8, "flat", "both", vp=2)) == ((2 * 3 + 4 + 1 + 1) / 2, (4 + 1 + 1) / 2)
    assert in_flight(Candidate(2, 2, 1, 1, 4, "flat", "both")) == (2.0, 2.0)


def test_distributed_optimizer_memory_per_pipeline_rank() -> None:
    """pp 2, dp 2 on 4 ranks, tied embedding on the first rank: 4-byte weights and 4-byte grads kept,
    12 bytes over 2 data ranks; the first rank holds 2 micro-batches of 2 blocks, the last 1 and the
    fp32 logits of 128 tokens x 256 entries."""
    spec = tiny_spec()
    cand = Candidate(2, 1, 1, 2, 2, grad_sync="overlapped")
    dense, experts = param_counts(spec)
    body = (dense - 256 * 32) / 2
    routed = experts / 2 * (8 + 12 / 2)
    first = (body + 256 * 32) * (8 + 12 / 2) + routed + 2 * 3072 * 128 * 2
    last = body * (8 + 12 / 2) + routed + 2 * 3072 * 128 + 128 * 256 * 4
    assert memory_bytes(spec, cand) == pytest.approx(max(first, last))
    one = Candidate(4, 1, 1, 1, 1, grad_sync="overlapped")  # one stage holds everything
    state = (dense + experts) * (8 + 12 / 4)
    assert memory_bytes(spec, one) == pytest.approx(state + 4 * 3072 * 128 + 128 * 256 * 4)
    # fp8: Transformer Engine's cached fp8 weight and its transpose (Hopper's dgrad GEMM), 2 more bytes each.
    fp8 = dataclasses.replace(one, fp8=True)
    state = (dense + experts) * (4 + 4 + 2 + 12 / 4)
    kept = 4 * 128 * block_activation_bytes(spec, fp8, True)
    assert memory_bytes(spec, fp8) == pytest.approx(state + kept + 128 * 256 * 4)


def test_mla_up_projection_recompute_keeps_the_latents() -> None:
    """Tiny MLA (D 32, 2 heads of 16 + 4 rotary, value heads 16, latents 8 + 8): Q 2 x 20 = 40 wide, K + V
    40 + 32 = 72; recomputing the up-projections keeps the 8 + 8 + 4 = 20 latent values instead, and redoes
    their forward: 8 x 40 + 8 x 2 x (16 + 16) = 832 weights, 2 FLOPs each, per token and block."""
    cfg = runconfig.resolve("tiny", {"model.n_layers": "4"})
    shape = Shape(q_lora_rank=8, kv_lora_rank=8, qk_rope_dim=4, v_head_dim=16, head_dim=16)
    mla = ModelSpec("mla", cfg.model, cfg.moe, Workload(global_batch=16, dtype_bytes=4), shape)
    base = Candidate(4, 1, 1, 1, 1)
    up = dataclasses.replace(base, recompute="mla_up_proj")
    assert block_activation_bytes(mla, base, False) - block_activation_bytes(mla, up, False) == pytest.approx(
        4 * (40 + 72 - 20)
    )
    redone = 128 * 4 * 2 * 832  # 128 tokens a rank, 4 blocks
    assert estimate(mla, up, CLUSTER).terms["gemm"] - estimate(mla, base, CLUSTER).terms["gemm"] == pytest.approx(
        redone / 1e12
    )
    with pytest.raises(ValueError, match="recompute=mla_up_proj: model tiny has no latent attention"):
        block_activation_bytes(tiny_spec(), up, True)
