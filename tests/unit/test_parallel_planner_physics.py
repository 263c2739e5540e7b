"""The planner's schedule physics (FSDP prefetch, pipeline depth, tp at its shapes) against values worked
by hand: the tiny model at 4 layers (d_model 32, 2 heads of 16, 4 SwiGLU experts of 64, top 2, tied
vocabulary of 256, fp32) on the toy cluster (4 devices a node at 1 TFLOP/s; 10 GB/s and 10 us inside a
node)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_spec, toy_cluster

from moekit.parallel.planner import (
    Candidate,
    Techniques,
    candidates,
    estimate,
    fsdp_collectives,
    fsdp_exposed,
    fsdp_state_bytes,
)
from moekit.parallel.planner.stages import busiest_stage
from moekit.parallel.planner.tensor import shape_factor

CLUSTER = toy_cluster()
# Non-expert parameters of the tiny model: 4 blocks of attention (32 x 96 QKV + 32 x 32 out = 4096), two
# norms (64) and a router (32 x 4 = 128); the tied embedding 256 x 32 = 8192; the final norm 32.
DENSE = 4 * (4096 + 64 + 128) + 8192 + 32  # 25376
EXPERTS = 4 * 4 * 3 * 32 * 64  # 4 layers of 4 SwiGLU experts: 98304
EMBED = 256 * 32
# One FSDP unit's gather over 4 ranks of a node: 5 units (4 blocks, the root), each a fifth of the dense
# weights in fp32: 3 ring steps of 10 us and 3/4 of 25376 * 4 / 5 bytes at 10 GB/s.
G = 3 * 10e-6 + 25376 * 4 / 5 * 3 / 4 / 10e9


def test_fsdp_prefetch_leaves_the_first_gathers_and_the_last_reduce() -> None:
    """dp 4 = ep 4 (experts whole, not sharded): 5 units, 3 collectives each of ``G`` seconds, 15 G in all.
    Compute far longer: only the forward's first gather, the backward's first gather and its last
    reduce-scatter show, 3 G. No compute: all 15 G. Communication-bound, the forward's unit taking G / 2
    and the backward's G (compute 7.5 G over 5 units, a third forward): forward G + 4 (G - G/2) = 3 G,
    backward (a gather and a reduce-scatter beside each unit's G) G + 4 (2 G - G) + G = 6 G."""
    spec, cand = tiny_spec(), Candidate(4, 4, 1, 1, 1)
    assert fsdp_exposed(spec, cand, CLUSTER, 1.0) == pytest.approx((3 * G, 12 * G))
    assert fsdp_exposed(spec, cand, CLUSTER, 0.0) == pytest.approx((15 * G, 0.0))
    assert fsdp_exposed(spec, cand, CLUSTER, 7.5 * G) == pytest.approx((9 * G, 6 * G))
    # Full recomputation reruns the forward on the backward's gather: the same 15 G on the wire, and the
    # same forward (compute 10 G, a quarter forward: G / 2 a unit) with 3/4 of it beside the backward's
    # collectives (1.5 G a unit): forward 3 G, backward G + 4 (2 G - 1.5 G) + G = 4 G.
    full = dataclasses.replace(cand, recompute="full")
    assert fsdp_exposed(spec, full, CLUSTER, 10 * G) == pytest.approx((7 * G, 8 * G))
    # CPU ranks run their collectives in line: all exposed whatever the compute.
    assert fsdp_exposed(spec, cand, dataclasses.replace(CLUSTER, cores=4), 1.0) == pytest.approx((15 * G, 0.0))


def test_fsdp_terms_in_the_estimate() -> None:
    """Through ``estimate``, 2 micro-batches with compute far longer than the collectives (a 1 MFLOP/s
    device): ``fsdp`` is 2 x 3 G a step, 2 x 12 G hidden, and the hidden part's contention (0.25 of it) is
    its own term, ``fsdp_contention``: 2 x 3 G."""
    slow = dataclasses.replace(CLUSTER, peak_tflops=1e-6, overlap_contention=0.25)
    est = estimate(tiny_spec(), Candidate(4, 4, 1, 1, 2), slow)
    assert est.terms["fsdp"] == pytest.approx(2 * 3 * G)
    assert est.hidden["fsdp"] == pytest.approx(2 * 12 * G)
    assert est.terms["fsdp_contention"] == pytest.approx(2 * 3 * G)
    assert sum(est.terms.values()) == pytest.approx(est.step_s)


def test_fsdp_memory_is_the_shards_three_gathered_blocks_and_the_root() -> None:
    """16 bytes a parameter over the 4 ranks (experts over the ep 4 ranks holding them), three blocks'
    non-expert weights gathered in fp32 (the running one, the prefetched one, the running one's gradient),
    and the root (the tied embedding) gathered for the step. With ep 2 < dp 4 FSDP shards the experts too:
    a block's 98304 / 4 expert weights over ep 2 join each gathered block."""
    spec = tiny_spec()
    block = (DENSE - EMBED) / 4
    state = DENSE * 16 / 4 + EXPERTS * 16 / 4
    assert fsdp_state_bytes(spec, Candidate(4, 4, 1, 1, 1)) == pytest.approx([state + 3 * block * 4 + EMBED * 4])
    sharded = fsdp_state_bytes(spec, Candidate(4, 2, 1, 1, 1))
    assert sharded == pytest.approx([state + 3 * (block + EXPERTS / 4 / 2) * 4 + EMBED * 4])
    # Two stages: each rank's state over all 8 ranks; the first holds the embedding, the last the tied head.
    piped = fsdp_state_bytes(spec, Candidate(4, 4, 1, 2, 2))
    one = DENSE * 16 / 8 + EXPERTS * 16 / 8 + 3 * block * 4 + EMBED * 4
    assert piped == pytest.approx([one, one])


# One ring pass of the tp collectives over 2 ranks of a node: 256 tokens (16 sequences of 32, 2
# micro-batches) x 32 x 4 bytes, half of it sent, after one 10 us step.
R = 10e-6 + 256 * 32 * 4 / 2 / 10e9
# The attention's first GEMM (QKV, 32 x 96 = 3072 weights, over tp 2) on 256 tokens at 1 TFLOP/s.
QKV = 2 * 256 * 3072 / 2 / 1e12


def test_tp_backward_collectives_run_beside_the_first_gemm() -> None:
    """tp 2, sequence parallel, dp 1 (no FSDP), 4 MoE blocks without shared experts, 2 micro-batches. The
    attention region: forward gather + reduce-scatter 2 R, backward the gradient's gather R, then the
    input's re-gather beside the QKV data-gradient GEMM and the gradient's reduce-scatter beside its
    weight-gradient GEMM, each exposed R - QKV: 3 R + 2 (R - QKV), 2 QKV hidden. The MoE region has no tp
    GEMM to hide behind: 5 R. A step: 2 x 4 x (10 R - 2 QKV). Without sp: forward all-reduce 2 R,
    backward the input gradient's all-reduce beside the weight gradient 2 R - QKV; the MoE region 4 R:
    2 x 4 x (8 R - QKV)."""
    spec = tiny_spec()
    sp = estimate(spec, Candidate(1, 1, 2, 1, 2, sp=True), CLUSTER)
    assert sp.terms["tp"] == pytest.approx(2 * 4 * (10 * R - 2 * QKV))
    assert sp.hidden["tp"] == pytest.approx(2 * 4 * 2 * QKV)
    assert sp.sync_s == pytest.approx(2 * 4 * (10 * R - 2 * QKV))
    plain = estimate(spec, Candidate(1, 1, 2, 1, 2), CLUSTER)
    assert plain.terms["tp"] == pytest.approx(2 * 4 * (8 * R - QKV))
    # GEMMs far slower: the attention region hides all of its 2 R; 0.5 of that hidden time is contention.
    slow = dataclasses.replace(CLUSTER, peak_tflops=1e-6, overlap_contention=0.5)
    est = estimate(spec, Candidate(1, 1, 2, 1, 2, sp=True), slow)
    assert est.terms["tp"] == pytest.approx(2 * 4 * 8 * R)
    assert est.terms["tp_contention"] == pytest.approx(2 * 4 * 0.5 * 2 * R)
    # CPU ranks run them in line: 2 x 4 x 10 R.
    inline = estimate(spec, Candidate(1, 1, 2, 1, 2, sp=True), dataclasses.replace(CLUSTER, cores=4))
    assert inline.terms["tp"] == pytest.approx(2 * 4 * 10 * R)


def test_small_gemms_run_below_the_large_gemm_rate() -> None:
    """``gemm_half_work`` 1e10 multiply-adds: against the reference GEMM (8192 x 4096 x 9216 =
    3.0924e11 multiply-adds, 3.0924e11 / 3.1924e11 = 0.96868 of the asymptote, where ``efficiency`` is
    measured), a GEMM of 1e10 runs at 0.5 / 0.96868 = 0.51617 of it, one of 1e13 at 1 (capped)."""
    c = dataclasses.replace(CLUSTER, gemm_half_work=1e10)
    assert shape_factor(1e10, c) == pytest.approx(0.5 / 0.968675, rel=1e-5)
    assert shape_factor(1e13, c) == 1.0
    assert shape_factor(1e3, CLUSTER) == 1.0  # no curve: every GEMM at the large-GEMM rate
    # The tiny model at tp 2, gemm_half_work 1e5 (reference at 1 / (1 + 1e5 / 3.0924e11) ~ 1 - 3.2e-7),
    # one micro-batch of 256 tokens: a MoE block's QKV (1536 weights a rank), output projection (512) and
    # router (32 x 4 / 2 = 64) of 256 x 1536, 256 x 512 and 256 x 64 multiply-adds; each GEMM's 3 passes
    # over 4 blocks take 1 / s - 1 more than at the large rate, s = w / (w + 1e5) / 0.99999968.
    c = dataclasses.replace(CLUSTER, gemm_half_work=1e5)
    ref = 1 / (1 + 1e5 / (8192 * 4096 * 9216))
    extra = sum(3 * 4 * 2 * 256 * p / 1e12 * (ref * (256 * p + 1e5) / (256 * p) - 1) for p in (1536, 512, 64))
    est = estimate(tiny_spec(), Candidate(1, 1, 2, 1, 1, sp=True), c)
    assert est.terms["gemm_shape"] == pytest.approx(extra)


def test_the_first_and_last_stages_own_work() -> None:
    """At 1 GB/s of elementwise work: the embedding's gradient, 256 x 32 entries x 12 bytes, 98.304 us a
    micro-batch on the first stage; the loss over 128 tokens x 256 logits x 36 bytes, 1179.648 us, on the
    last; the head, 3 x 2 x 128 x 32 x 256 FLOPs at 1 TFLOP/s, 6.291456 us. Without a pipeline one rank
    pays all three. pp 2, vp 1: the last stage (loss and head) is the busier, the embedding off the
    critical path."""
    spec = tiny_spec()
    c = dataclasses.replace(CLUSTER, hbm_gbps=1.0)
    embedding, loss, head = 256 * 32 * 12 / 1e9, 128 * 256 * 36 / 1e9, 3 * 2 * 128 * 32 * 256 / 1e12
    flat = estimate(spec, Candidate(4, 1, 1, 1, 1), c)
    assert (flat.terms["embedding"], flat.terms["loss"], flat.terms["head"]) == pytest.approx((embedding, loss, head))
    piped = estimate(spec, Candidate(2, 1, 1, 2, 2), c)  # 2 micro-batches of 128 tokens
    assert (piped.terms["embedding"], piped.terms["loss"], piped.terms["head"]) == pytest.approx(
        (0.0, 2 * loss, 2 * head)
    )
    # The first stage the busier (blocks, embedding) when the embedding outweighs the loss and head.
    blocks_s, ends = 2.0, {"head": 0.5, "loss": 0.25, "embedding": 1.0}
    assert busiest_stage(blocks_s, ends, 2, spec, Candidate(2, 1, 1, 2, 2)) == (
        3.0,
        {"head": 0.0, "loss": 0.0, "embedding": 1.0},
    )
    assert busiest_stage(blocks_s, ends, 4, spec, Candidate(2, 1, 1, 1, 1))[0] == 3.75


def test_pipeline_depth_costs_a_fixed_time_a_chunk_and_the_fills_sends() -> None:
    """pp 4, vp 2, 4 micro-batches, 100 us a chunk pass: 2 chunks x forward and backward = 400 us a
    micro-batch (``pp_schedule``, 1600 us over 4 and 400 us x 3/2 in the bubble's slots). The fill's
    critical path crosses 2 x 3 stage boundaries, each a send of 128 tokens (16 x 32 over 4) x 32 x 4 bytes in the node:
    6 x (10 us + 16384 / 10 GB/s) a step (``pp_fill``); plain 1F1B has none (its sends are waited for
    every micro-batch, in its bubble already)."""
    spec = tiny_spec()
    c = dataclasses.replace(CLUSTER, stage_pass_us=100.0)
    est = estimate(spec, Candidate(1, 1, 1, 4, 4, vp=2), c)
    assert est.terms["pp_schedule"] == pytest.approx(4 * 400e-6)
    assert est.terms["pp_fill"] == pytest.approx(6 * (10e-6 + 128 * 32 * 4 / 10e9))
    assert sum(est.terms.values()) == pytest.approx(est.step_s)
    assert estimate(spec, Candidate(1, 1, 1, 4, 4), c).terms["pp_fill"] == 0.0


def test_the_dense_gemm_curve_against_the_measured_dense_table() -> None:
    """The H100 dense GEMM table (benchmarks/measured/h100-device-rates.json, 7 shapes at 8192 rows): the
    reference size is its median one, and the grouped GEMMs' curve (the preset's gemm_half_work) gives its
    two smallest shapes' rates over the table's median rate within 4%."""
    import json
    import statistics
    from pathlib import Path

    from moekit.parallel.planner import load_cluster
    from moekit.parallel.planner.tensor import DENSE_REFERENCE_WORK

    table = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/measured/h100-device-rates.json").read_text())
    works = [8192 * g["k"] * g["n"] for g in table["gemms"]]
    assert statistics.median(works) == DENSE_REFERENCE_WORK
    median_rate = statistics.median(g["tflops"] for g in table["gemms"])
    c = load_cluster("dgx-h100")
    for work, gemm in sorted(zip(works, table["gemms"], strict=True), key=lambda x: x[0])[:2]:
        assert shape_factor(work, c) == pytest.approx(gemm["tflops"] / median_rate, rel=0.04)


def test_fsdp_shards_over_the_batch_ranks_cp_included() -> None:
    """dp 2 x cp 2 = 4 batch ranks, ep 2: the units' gathers ring over all 4 (the ``G`` above), and the
    experts, which the 2 ep ranks split and FSDP shards over the other 2, gather a layer's 98304 / 4 / 2
    weights in fp32 over 2 ranks 2 apart in the node: 3 collectives a unit (5) and a MoE layer (4)."""
    expert = 10e-6 + EXPERTS / 4 / 2 * 4 / 2 / 10e9
    wire, count = fsdp_collectives(tiny_spec(), Candidate(2, 2, 1, 1, 1, cp=2), CLUSTER)
    assert (wire, count) == pytest.approx((15 * G + 12 * expert, 15 + 12))


def test_the_distributed_optimizer_switch_costs_each_layout_both_ways() -> None:
    """With ``overlapped_grads`` every enumerated layout comes twice, under the distributed optimizer and
    under FSDP; without it under FSDP alone."""
    spec = tiny_spec()
    fsdp_only = candidates(spec, CLUSTER, Techniques())
    both = candidates(spec, CLUSTER, Techniques(overlapped_grads=True))
    assert {k.grad_sync for k in fsdp_only} == {"fsdp"}
    assert sorted(both, key=repr) == sorted(
        [*fsdp_only, *(dataclasses.replace(k, grad_sync="overlapped") for k in fsdp_only)], key=repr
    )
