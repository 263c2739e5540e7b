"""The planner's switchable terms (techniques of published runs) against hand-computed values."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_spec, toy_cluster

from moekit.parallel.planner import (
    MEMORY_USABLE,
    OVERLAP_CHUNKS,
    Candidate,
    candidates,
    deduplicated_time,
    elementwise_bytes,
    estimate,
    fp8_cast_values,
    gradient_sync_time,
    layer_flops,
    least_recompute,
    load_model,
    memory_bytes,
    model_flops_per_token,
    paired_share,
    param_counts,
    parse_techniques,
    remote_nodes,
    route_reach,
)
from moekit.parallel.planner.stages import with_head

CLUSTER = toy_cluster()


def test_model_flops_follow_megatrons_count() -> None:
    """Qwen3-30B-A3B: 6 x (attention projections + causal scores + 8 routed SwiGLU experts + head)
    per block, which is what Megatron-Bridge's table divides by (121 TFLOP/s / 5275 tokens/s)."""
    q, kv, D, s = 32 * 128, 4 * 128, 2048, 4096
    attn = D * (q + 2 * kv) + q * D + (q + q) * s / 2
    want = 6 * (48 * (attn + D * 3 * 8 * 768) + D * 151936)
    assert model_flops_per_token(load_model("qwen3-30b-a3b")) == pytest.approx(want)
    assert pytest.approx(want, rel=0.005) == 121e12 / 5275
    # gpt-oss under Megatron-Bridge 25.11's count: no window term, two matrices per (non-SiLU) GLU.
    oss = load_model("gpt-oss-120b")
    q, kv, D = 64 * 64, 8 * 64, 2880
    old = 6 * (36 * (D * (q + 2 * kv) + q * D + 2 * q * 2048 + D * 2 * 4 * 2880) + D * 201088)
    assert model_flops_per_token(oss, windowed=False, gated=False) == pytest.approx(old)
    assert pytest.approx(old, rel=0.005) == 153e12 / 5630


def test_interleaving_shrinks_the_bubble_and_spreads_the_head() -> None:
    """4 blocks: 2 a stage, 1 a virtual stage with vp=2; the bubble shrinks from 1 slot to 1/2. Plain 1F1B
    puts the whole head (3 x 128 tokens x 2 D V FLOPs) on the last rank; interleaved, a head far
    smaller than a block stays there too: moving a whole block off would cost more
    (``test_the_head_balances_against_whole_blocks``)."""
    spec = tiny_spec()
    one, two = (Candidate(2, 1, 1, 2, 2, vp=v) for v in (1, 2))
    head_s = 3 * 128 * 2 * 32 * 256 / 1e12
    slot_one = estimate(spec, one, CLUSTER).compute_s / (2 + 1)
    assert estimate(spec, two, CLUSTER).compute_s / (2 + 1 / 2) == pytest.approx(slot_one)
    assert estimate(spec, two, CLUSTER).terms["head"] == pytest.approx(2 * head_s)  # 2 micro-batches


def test_the_head_balances_against_whole_blocks() -> None:
    """pp 2, vp 2, 4 blocks of 1 s: a head of 0.5 s leaves the last rank 2 blocks (2.5 s, the other rank
    2 s), not the even 2.25 s of fractional blocks; a head of 2 s balances exactly (1 block, 3 s each)."""
    spec, cand = tiny_spec(), Candidate(2, 1, 1, 2, 2, vp=2)
    assert with_head(2.0, 0.5, 2, spec, cand) == pytest.approx(2.5)
    assert with_head(2.0, 2.0, 2, spec, cand) == pytest.approx(3.0)
    assert with_head(2.0, 0.5, 2, spec, Candidate(2, 1, 1, 2, 2)) == pytest.approx(2.5)  # 1F1B: head on top


def test_tp_exchanges_are_not_hidden_by_the_fitted_overlap() -> None:
    """The fitted ``overlap`` hides none of the tp exchanges (what their schedule hides:
    test_parallel_planner_physics.py)."""
    spec = tiny_spec()
    cand = Candidate(1, 1, 2, 1, 2, sp=True)
    none, all_ = (estimate(spec, cand, dataclasses.replace(CLUSTER, overlap=x)).sync_s for x in (0.0, 1.0))
    assert none == pytest.approx(all_)


def test_recomputation_adds_forward_flops() -> None:
    spec = tiny_spec()
    base = Candidate(4, 1, 1, 1, 1)
    tokens = 16 * 32 / 4
    experts = tokens * 4 * layer_flops(spec, True)["experts"]
    added = estimate(spec, dataclasses.replace(base, recompute="experts"), CLUSTER).compute_s
    assert added - estimate(spec, base, CLUSTER).compute_s == pytest.approx(experts / 1e12)
    assert estimate(spec, dataclasses.replace(base, recompute="selective"), CLUSTER).compute_s == pytest.approx(
        estimate(spec, base, CLUSTER).compute_s
    )
    full = memory_bytes(spec, dataclasses.replace(base, recompute="full"))
    assert full < memory_bytes(spec, dataclasses.replace(base, recompute="experts")) < memory_bytes(spec, base)


def test_fp8_speeds_only_the_gemms() -> None:
    spec = tiny_spec()
    fast = dataclasses.replace(CLUSTER, fp8_speedup=2.0)
    bf16, fp8 = Candidate(4, 1, 1, 1, 1), Candidate(4, 1, 1, 1, 1, fp8=True)
    tokens = 16 * 32 / 4
    moe = layer_flops(spec, True)
    gemms = 3 * tokens * 4 * (moe["attention"] + moe["dense"] + moe["experts"])
    saved = estimate(spec, bf16, fast).compute_s - estimate(spec, fp8, fast).compute_s
    assert saved == pytest.approx(gemms / 1e12 / 2)


# 4 blocks of d 32 (the first dense, SwiGLU of 48; 3 MoE, top-3 GELU experts of 40 and a GELU shared
# expert of 24), 4 query heads of 8 and 1 KV head: q and v 32, K and V 16; 4-byte values.
UNEVEN = {
    "model.n_layers": "4", "model.n_heads": "4", "model.n_kv_heads": "1", "model.first_dense_layers": "1",
    "model.d_ff": "48", "moe.d_ff": "40", "moe.top_k": "3", "moe.num_experts": "6", "moe.activation": "gelu",
    "moe.num_shared_experts": "1", "moe.shared_d_ff": "24",
}  # fmt: skip
# tp 2 with sp, etp 4, full recomputation, 256 attention tokens (128 rows), load imbalance 1.5 | tp 2
# without sp, pp 2 (2 blocks a stage, 1.5 of them MoE on average), recomputed experts, 256 tokens and rows.
SP_FULL = Candidate(4, 2, 2, 1, 1, etp=4, sp=True, recompute="full", fp8=True)
PP_EXPERTS = Candidate(1, 1, 2, 2, 2, recompute="experts", fp8=True)


def test_fp8_casts_cost_memory_traffic() -> None:
    """Values cast into fp8 a micro-batch, tensor by tensor (forward | backward): attention's output
    projection input 256 x 32 / 2 | QKV's output gradients 256 x (32 + 16) / 2 and the output
    projection's D a row; the dense FFN's second input 256 x 48 / 2 | its first output gradient 256 x 2 x
    48 / 2 and D a row; the shared expert's input D a row and its second input 256 x 24 / 2 | 256 x 1 x 24
    / 2 and D a row; each routed copy's etp x D and 40 | 1 x 40 and etp x D. Recomputed forwards cast
    again. The elementwise term pays 4 bytes each at hbm_gbps."""
    spec = tiny_spec(**UNEVEN)
    rows, copies = 128, 128 * 3 * 1.5
    attention = (256 * 32 / 2, 256 * (32 + 16) / 2 + rows * 32)
    dense = (256 * 48 / 2, 256 * 2 * 48 / 2 + rows * 32)
    shared = (rows * 32 + 256 * 24 / 2, 256 * 24 / 2 + rows * 32)
    routed = (copies * (4 * 32 + 40), copies * (40 + 4 * 32))
    want = sum(n * (2 * fwd + bwd) for (fwd, bwd), n in ((attention, 4), (dense, 1), (shared, 3), (routed, 3)))
    assert fp8_cast_values(spec, SP_FULL, 256, 1.5) == pytest.approx(want)

    rows, copies = 256, 256 * 3
    attention = (256 * 32 / 2, 256 * (32 + 16) / 2 + rows * 32)
    dense = (256 * 48 / 2, 256 * 2 * 48 / 2 + rows * 32)
    shared = (rows * 32 + 256 * 24 / 2, 256 * 24 / 2 + rows * 32)
    routed = (copies * (32 + 40), copies * (40 + 32))
    want = 2 * sum(attention) + 0.5 * sum(dense) + 1.5 * sum(shared) + 1.5 * (2 * routed[0] + routed[1])
    assert fp8_cast_values(spec, PP_EXPERTS, 256) == pytest.approx(want)

    c = dataclasses.replace(CLUSTER, hbm_gbps=1.0)
    bf16 = dataclasses.replace(PP_EXPERTS, fp8=False)
    extra = estimate(spec, PP_EXPERTS, c).terms["elementwise"] - estimate(spec, bf16, c).terms["elementwise"]
    tokens = 16 * 32 / (1 * 2)  # a micro-batch's tokens; 2 micro-batches a step
    assert extra == pytest.approx(2 * 4 * fp8_cast_values(spec, PP_EXPERTS, tokens) / 1e9)


def test_elementwise_bytes_by_hand() -> None:
    """4-byte values, forward then twice in the backward, recomputed forwards again: per block the norms
    and residuals 8 x 32 a row; the dense SwiGLU 3 x 48 / 2 a token; the shared GELU 2 x 24 / 2 a token;
    each routed copy's permutes and combine 4 x 32 (the routed activation is in the experts' rate)."""
    spec = tiny_spec(**UNEVEN)
    dense = 4 * 128 * 8 * 32 + 1 * 256 * 3 * 48 / 2 + 3 * 256 * 2 * 24 / 2
    routed = 3 * 128 * 3 * 1.5 * 4 * 32
    assert elementwise_bytes(spec, SP_FULL, 256, 1.5) == pytest.approx(4 * (4 * dense + 4 * routed))
    dense = 2 * 256 * 8 * 32 + 0.5 * 256 * 3 * 48 / 2 + 1.5 * 256 * 2 * 24 / 2
    routed = 1.5 * 256 * 3 * 4 * 32
    assert elementwise_bytes(spec, PP_EXPERTS, 256) == pytest.approx(4 * (3 * dense + 4 * routed))
    # selective (norms and routed activations again), tp 2 with sp, etp 4: the norms 4 x 32 a row of 128 in
    # 4 blocks; each routed copy's GELU 2 x 40 / 4, 3 x 1.5 copies a row in 3 MoE blocks
    selective = dataclasses.replace(SP_FULL, recompute="selective")
    dense = 4 * 128 * 8 * 32 + 1 * 256 * 3 * 48 / 2 + 3 * 256 * 2 * 24 / 2
    routed = 3 * 128 * 3 * 1.5 * 4 * 32
    redone = 4 * 128 * 4 * 32 + 3 * 128 * 3 * 1.5 * 2 * 40 / 4
    assert elementwise_bytes(spec, selective, 256, 1.5) == pytest.approx(4 * (3 * dense + 3 * routed + redone))


def test_attention_and_expert_gemms_at_their_own_rates() -> None:
    """attention_efficiency and expert_efficiency replace efficiency for the attention scores (3 x 128
    tokens x 4 blocks x their forward FLOPs a step) and the routed experts' GEMMs (3 x 128 rows x 4 blocks
    x theirs); the other GEMMs keep efficiency's; 0 falls back to it."""
    spec, cand = tiny_spec(), Candidate(4, 1, 1, 1, 1)
    half = dataclasses.replace(CLUSTER, efficiency=0.5)
    own = estimate(spec, cand, dataclasses.replace(half, attention_efficiency=0.25, expert_efficiency=0.125))
    flops = layer_flops(spec, True)
    assert own.terms["attention"] == pytest.approx(3 * 128 * 4 * flops["core"] / (0.25 * 1e12))
    assert own.terms["gemm_experts"] == pytest.approx(3 * 128 * 4 * flops["experts"] / (0.125 * 1e12))
    fallback = estimate(spec, cand, half)
    assert fallback.terms["attention"] == pytest.approx(own.terms["attention"] / 2)
    assert fallback.terms["gemm_experts"] == pytest.approx(own.terms["gemm_experts"] / 4)
    assert own.terms["gemm"] == pytest.approx(fallback.terms["gemm"])


def test_the_optimizer_step_once_a_step_on_each_ranks_shard() -> None:
    """An AdamW step moves 28 bytes a parameter, every parameter updated once over all the ranks, at
    optimizer_gbps; in compute, not in the exchanges."""
    spec, c = tiny_spec(), dataclasses.replace(CLUSTER, optimizer_gbps=1.0)
    for cand in (Candidate(4, 1, 1, 1, 2), Candidate(2, 2, 1, 2, 4, grad_sync="overlapped")):
        est, base = estimate(spec, cand, c), estimate(spec, cand, CLUSTER)
        want = 28 * sum(param_counts(spec)) / 4 / 1e9
        assert est.terms["optimizer"] == pytest.approx(want)
        assert est.step_s - base.step_s == pytest.approx(want)
        assert est.compute_s - base.compute_s == pytest.approx(want) and est.sync_s == base.sync_s


def test_overlapped_gradients_once_a_step() -> None:
    spec = tiny_spec()
    cand = Candidate(16, 1, 1, 1, 2, grad_sync="overlapped")
    dense_p, expert_p = param_counts(spec)
    # 16 ranks over 4 nodes: ring of 15 inter-node steps; reduce-scatter and all-gather, dense and experts.
    ring = sum(15 * 100e-6 + p * 4 * 15 / 16 / 1e9 for p in (dense_p, expert_p))
    assert gradient_sync_time(spec, cand, CLUSTER) == pytest.approx(2 * ring)
    exposed = estimate(spec, cand, CLUSTER).sync_s
    assert exposed == pytest.approx(2 * ring)  # overlap 0: all of it
    hidden = estimate(spec, cand, dataclasses.replace(CLUSTER, overlap=1.0, peak_tflops=1e-6))
    assert hidden.sync_s == pytest.approx(0.0, abs=1e-12)  # slow compute beside it hides all
    assert hidden.hidden["grads"] == pytest.approx(2 * ring)  # and says so
    assert estimate(spec, cand, CLUSTER).hidden["grads"] == 0.0
    # bf16 gradient buffers: the reduce-scatter moves half the bytes, the all-gather the same.
    half = dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, grad_bytes=2))
    rs = sum(15 * 100e-6 + p * 2 * 15 / 16 / 1e9 for p in (dense_p, expert_p))
    assert gradient_sync_time(half, cand, CLUSTER) == pytest.approx(ring + rs)
    assert memory_bytes(spec, cand) - memory_bytes(half, cand) == pytest.approx(2 * (dense_p + expert_p))
    # Distributed optimizer memory: bf16 weights + fp32 grads whole, fp32 master and moments over 16.
    state = (dense_p + expert_p) * (4 + 4 + 12 / 16)
    # FSDP: all of it sharded, 16 bytes a parameter over 16 ranks; three blocks (dense weights and experts,
    # which dp 16 > ep 1 shards) and the tied embedding gathered, 4 bytes each.
    embed = 256 * 32
    fsdp = (dense_p + expert_p) * 16 / 16 + 3 * (dense_p - embed + expert_p) / 4 * 4 + embed * 4
    assert memory_bytes(spec, cand) - memory_bytes(spec, dataclasses.replace(cand, grad_sync="fsdp")) == pytest.approx(
        state - fsdp
    )


def test_all_to_all_overlap_in_both_passes() -> None:
    """4 micro-batches, no pipeline: the first forward and the last backward run alone, so 3 of 4 are
    paired and half of theirs is hidden (compute far longer than the exchanges): 1 - 3/4 x 1/2 = 5/8 left."""
    spec = tiny_spec()
    plain, both = Candidate(4, 4, 1, 1, 4), Candidate(4, 4, 1, 1, 4, overlap="both")
    half = dataclasses.replace(CLUSTER, overlap=0.5, peak_tflops=1e-6)
    assert estimate(spec, both, half).a2a_s == pytest.approx(estimate(spec, plain, half).a2a_s * 5 / 8)
    # What it takes off the step is what it reports hidden: the other 3/8.
    assert estimate(spec, both, half).hidden["a2a"] == pytest.approx(estimate(spec, plain, half).a2a_s * 3 / 8)
    assert "a2a" not in estimate(spec, plain, half).hidden
    one = Candidate(4, 4, 1, 1, 1, overlap="both")  # a single micro-batch has nothing to pair with
    assert estimate(spec, one, half).a2a_s == pytest.approx(estimate(spec, Candidate(4, 4, 1, 1, 1), half).a2a_s)


def test_paired_share_leaves_out_warm_up_chunks() -> None:
    """Interleaved pp 4, vp 2, 8 micro-batches: 16 chunks, 2 x 3 + 1 x 4 = 10 warm-up ones; no pipeline:
    the first of 4."""
    assert paired_share(Candidate(1, 2, 1, 4, 8, overlap="both", vp=2)) == pytest.approx(6 / 16)
    assert paired_share(Candidate(4, 2, 1, 1, 4, overlap="both")) == pytest.approx(3 / 4)
    assert paired_share(Candidate(1, 2, 1, 4, 4, overlap="both", vp=2)) == 0.0


def test_both_pass_overlap_is_refused_where_megatron_refuses_it() -> None:
    """overlap_moe_expert_parallel_comm asserts virtual stages on a pipeline and no full recomputation."""
    spec = tiny_spec()
    with pytest.raises(ValueError, match="overlap=both: needs virtual pipeline stages"):
        estimate(spec, Candidate(1, 1, 1, 4, 4, overlap="both"), CLUSTER)
    with pytest.raises(ValueError, match="overlap=both: not with recompute=full"):
        estimate(spec, Candidate(4, 4, 1, 1, 4, overlap="both", recompute="full"), CLUSTER)
    with pytest.raises(ValueError, match="needs virtual pipeline stages"):
        memory_bytes(spec, Candidate(1, 1, 1, 4, 4, overlap="both"))


def test_both_pass_overlap_enumerated_only_where_megatron_runs_it() -> None:
    """tiny: 4 layers, 16 sequences on 16 devices. With the overlap switched on, a pipeline without virtual
    stages exchanges unoverlapped; no pipeline, or virtual stages, overlap in both passes."""
    spec = tiny_spec(**{"moe.num_experts": "8"})
    every = [c for c in candidates(spec, CLUSTER, parse_techniques("a2a_overlap,interleave")) if c.ep > 1]
    assert {c.overlap for c in every if c.pp > 1 and c.vp == 1} == {"none"}
    assert {c.overlap for c in every if c.pp == 1 or c.vp > 1} == {"both"}
    assert any(c.pp > 1 and c.vp == 1 for c in every) and any(c.pp > 1 and c.vp > 1 for c in every)


def test_full_recomputation_turns_the_both_pass_overlap_off() -> None:
    """A device too small for anything less than full recomputation: the layout comes back with full
    recomputation and its all-to-alls unoverlapped; one that fits without it keeps the overlap."""
    spec, tech = tiny_spec(), parse_techniques("recompute,a2a_overlap")
    both = Candidate(4, 4, 1, 1, 4, overlap="both")
    full = memory_bytes(spec, dataclasses.replace(both, recompute="full", overlap="none"))
    experts = memory_bytes(spec, dataclasses.replace(both, recompute="experts"))
    assert full < experts
    small = dataclasses.replace(CLUSTER, memory_gb=(full + experts) / 2 / 1e9 / MEMORY_USABLE)
    picked = least_recompute(spec, both, small, tech, 1.0)
    assert (picked.recompute, picked.overlap) == ("full", "none")
    roomy = dataclasses.replace(CLUSTER, memory_gb=1e3)
    assert least_recompute(spec, both, roomy, tech, 1.0) == both


def test_deduplicated_dispatch_crosses_nodes_once_a_node() -> None:
    """8 experts top-2 over ep 8 = 2 nodes of 4: a token's 2 copies land on 2 x (1 - 1/2^2) = 1.5 distinct
    nodes, the other node 1/2 of the time: 0.75 rows cross instead of 2 x 4/8 = 1. With 2 expert groups,
    1 a token, one group a node, it reaches one node: 0.5."""
    assert remote_nodes(2, 2, 2) == pytest.approx(0.75)
    assert remote_nodes(8, 8, 4) == pytest.approx(7 / 8 * 4 * (1 - 6561 / 65536))  # DeepSeek-V3 over ep 64
    spec = tiny_spec(**{"moe.num_experts": "8"})
    grouped = tiny_spec(**{"moe.num_experts": "8", "moe.n_group": "2", "moe.topk_group": "1"})
    assert (route_reach(spec, 2), route_reach(grouped, 2), route_reach(grouped, 4), route_reach(grouped, 3)) == (
        2,
        1,
        2,
        3,
    )
    # 32 rows of 32 x 4 bytes a rank: across 0.75 x 4096 bytes at 1 GB/s; within 2 x 3/4 x 4096 bytes at
    # 10 GB/s (shorter, pipelined); one latency in the node, one across (each stage's messages posted together).
    one = 10e-6 + 100e-6 + 0.75 * 4096 / 1e9
    assert deduplicated_time(32, 128, 2, 8, 1, CLUSTER, 2) == pytest.approx(one)
    # dp 16, one micro-batch of 32 tokens, 4 MoE blocks: dispatch + combine, forward and backward.
    dedup = Candidate(16, 8, 1, 1, 1, "deduplicated")
    assert estimate(spec, dedup, CLUSTER).terms["a2a"] == pytest.approx(4 * 2 * 2 * one)
    limited = 10e-6 + 100e-6 + 0.5 * 4096 / 1e9
    assert estimate(grouped, dedup, CLUSTER).terms["a2a"] == pytest.approx(4 * 2 * 2 * limited)
    # Every copy, 3/8 of them within the node beside half of them across (the slower path, one latency).
    flat = max(10e-6 + 8192 * 3 / 8 / 10e9, 100e-6 + 8192 * 4 / 8 / 1e9)
    flat_s = estimate(spec, dataclasses.replace(dedup, all_to_all="flat"), CLUSTER).terms["a2a"]
    assert flat_s == pytest.approx(16 * flat)


def test_deduplicated_dispatch_is_enumerated_only_across_nodes() -> None:
    spec = tiny_spec(**{"moe.num_experts": "8"})
    every = candidates(spec, CLUSTER, parse_techniques("deduplicated_dispatch"))
    forms = {(c.ep, c.tp, c.all_to_all) for c in every}
    # ep 4 of tp 1 fills one node of 4; ep 8, or ep 4 two ranks a node (tp 2), spans two.
    assert (4, 1, "deduplicated") not in forms and (4, 1, "flat") in forms
    assert {(8, 1, "deduplicated"), (8, 1, "flat"), (4, 2, "deduplicated")} <= forms
    assert not any(c.all_to_all == "deduplicated" for c in candidates(spec, CLUSTER))


def test_context_parallel_only_where_each_share_is_long() -> None:
    """cp splits a sequence only into shares of 2048 tokens or more; a shorter sequence still gets cp 1."""
    tech = parse_techniques("all")
    assert {k.cp for k in candidates(tiny_spec(), CLUSTER, tech)} == {1}  # 32 tokens
    long = tiny_spec(**{"model.context_length": "8192"})
    assert {k.cp for k in candidates(long, CLUSTER, tech)} == {1, 2, 4}


def test_context_parallel_ring_hides_behind_the_attention_scores() -> None:
    """With all of an overlappable exchange hidable, cp's ring hides behind the attention scores beside it
    (3 x 128 tokens x 4 blocks x their forward FLOPs, at attention_efficiency), up to all of itself."""
    spec, cand = tiny_spec(), Candidate(2, 1, 1, 1, 1, cp=2)
    exposed = estimate(spec, cand, CLUSTER).terms["cp"]
    for rate in (1e-3, 1e2):
        c = dataclasses.replace(CLUSTER, overlap=1.0, attention_efficiency=rate)
        scores = 3 * 128 * 4 * layer_flops(spec, True)["core"] / (rate * 1e12)
        assert estimate(spec, cand, c).hidden["cp"] == pytest.approx(min(exposed, scores))


def test_parse_techniques() -> None:
    assert parse_techniques("moekit").names() == []
    assert parse_techniques("fp8, interleave").names() == ["interleave", "fp8"]
    with pytest.raises(ValueError, match="unknown nope"):
        parse_techniques("nope")


def test_terms_add_up_to_the_step() -> None:
    """The named terms a table shows are the step, nothing left out or counted twice."""
    spec = tiny_spec()
    c = dataclasses.replace(CLUSTER, overlap=0.5, pass_overhead_us=5.0, hbm_gbps=100.0, cores=2)
    for cand in (
        Candidate(2, 2, 2, 2, 4, "flat", "both", vp=2, sp=True, grad_sync="overlapped"),
        Candidate(4, 4, 1, 1, 2, "flat", "forward"),
    ):
        est = estimate(spec, cand, c)
        assert sum(est.terms.values()) == pytest.approx(est.step_s)


def test_only_the_expert_gemms_slow_down_when_small() -> None:
    """128 tokens a rank, top-2 of 4 experts, all local: 64 rows an expert, half rate at gemm_half_rows 64;
    one grouped GEMM does 4 experts x 64 rows x 32 x 64 multiply-adds, half rate at gemm_half_work of
    that; both: a quarter. The dense GEMMs (all 128 rows against the model width) keep the large-GEMM rate."""
    spec, cand = tiny_spec(), Candidate(4, 1, 1, 1, 1)
    work = 4 * 64 * 32 * 64
    base = estimate(spec, cand, CLUSTER)
    for rows, half_work, slower in ((64, 0, 2), (0, work, 2), (64, work, 4), (64, 3 * work, 8)):
        small = estimate(spec, cand, dataclasses.replace(CLUSTER, gemm_half_rows=rows, gemm_half_work=half_work))
        assert small.terms["gemm"] == pytest.approx(base.terms["gemm"])
        assert small.terms["gemm_experts"] == pytest.approx(slower * base.terms["gemm_experts"])


def test_interleaved_pipeline_sends_hide_plain_ones_wait() -> None:
    """pp 2 of dp 2 in one node: 128 tokens x 32 x 4 bytes a send, one each way a virtual stage a
    micro-batch. Interleaved, they run beside the next chunk's compute, whatever the cluster's overlap
    fraction: hidden behind far longer compute, shown in full beside next to none; 1F1B waits."""
    spec = tiny_spec()
    slow = dataclasses.replace(CLUSTER, overlap=0.0, peak_tflops=1e-6)
    fast = dataclasses.replace(CLUSTER, overlap=0.0, peak_tflops=1e12)
    send = 10e-6 + 128 * 32 * 4 / 10e9
    assert estimate(spec, Candidate(2, 1, 1, 2, 2), slow).terms["pp"] == pytest.approx(2 * 2 * send)
    assert estimate(spec, Candidate(2, 1, 1, 2, 2, vp=2), slow).terms["pp"] == pytest.approx(0.0, abs=1e-12)
    assert estimate(spec, Candidate(2, 1, 1, 2, 2, vp=2), slow).hidden["pp"] == pytest.approx(2 * 2 * 2 * send)
    assert estimate(spec, Candidate(2, 1, 1, 2, 2), slow).hidden["pp"] == 0.0
    assert estimate(spec, Candidate(2, 1, 1, 2, 2, vp=2), fast).terms["pp"] == pytest.approx(2 * 2 * 2 * send)


def test_ranks_sharing_cores_queue_and_their_bubble_is_free() -> None:
    """4 ranks a node on 2 cores: every step takes twice as long, except that a pipeline's bubble (its
    idle ranks give their cores away) costs nothing. Against 4 cores (CPU ranks, no queue)."""
    spec = tiny_spec()
    shared, own = dataclasses.replace(CLUSTER, cores=2), dataclasses.replace(CLUSTER, cores=4)
    flat = Candidate(4, 1, 1, 1, 2)
    assert estimate(spec, flat, shared).step_s == pytest.approx(2 * estimate(spec, flat, own).step_s)
    piped = Candidate(2, 1, 1, 2, 2)
    slot = estimate(spec, piped, own).step_s / (2 + 1)  # 2 micro-batches and the bubble's one slot
    assert estimate(spec, piped, shared).step_s == pytest.approx(2 * 2 * slot)


def test_each_overlap_chunk_pays_its_fixed_cost() -> None:
    spec = tiny_spec()  # 4 MoE blocks
    ovl = Candidate(4, 4, 1, 1, 1, "flat", "forward")
    added = estimate(spec, ovl, dataclasses.replace(CLUSTER, chunk_overhead_us=100.0)).a2a_s
    assert added - estimate(spec, ovl, CLUSTER).a2a_s == pytest.approx((OVERLAP_CHUNKS - 1) * 4 * 100e-6)
