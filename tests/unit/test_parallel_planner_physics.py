"""The planner's schedule physics (FSDP prefetch, pipeline depth, tp at its shapes) against values worked
by hand: the tiny model at 4 layers (d_model 32, 2 heads of 16, 4 SwiGLU experts of 64, top 2, tied
vocabulary of 256, fp32) on the toy cluster (4 devices a node at 1 TFLOP/s; 10 GB/s and 10 us inside a
node)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import toy_cluster

from moekit import runconfig
from moekit.parallel.planner import Candidate, ModelSpec, Workload, estimate, fsdp_exposed, fsdp_state_bytes

CLUSTER = toy_cluster()
# Non-expert parameters of the tiny model: 4 blocks of attention (32 x 96 QKV + 32 x 32 out = 4096), two
# norms (64) and a router (32 x 4 = 128); the tied embedding 256 x 32 = 8192; the final norm 32.
DENSE = 4 * (4096 + 64 + 128) + 8192 + 32  # 25376
EXPERTS = 4 * 4 * 3 * 32 * 64  # 4 layers of 4 SwiGLU experts: 98304
EMBED = 256 * 32
# One FSDP unit's gather over 4 ranks of a node: 5 units (4 blocks, the root), each a fifth of the dense
# weights in fp32: 3 ring steps of 10 us and 3/4 of 25376 * 4 / 5 bytes at 10 GB/s.
G = 3 * 10e-6 + 25376 * 4 / 5 * 3 / 4 / 10e9


def _tiny() -> ModelSpec:
    cfg = runconfig.resolve("tiny", {"model.n_layers": "4"})
    return ModelSpec("tiny", cfg.model, cfg.moe, Workload(global_batch=16, dtype_bytes=4))


def test_fsdp_prefetch_leaves_the_first_gathers_and_the_last_reduce() -> None:
    """dp 4 = ep 4 (experts whole, not sharded): 5 units, 3 collectives each of ``G`` seconds, 15 G in all.
    Compute far longer: only the forward's first gather, the backward's first gather and its last
    reduce-scatter show, 3 G. No compute: all 15 G. Communication-bound, the forward's unit taking G / 2
    and the backward's G (compute 7.5 G over 5 units, a third forward): forward G + 4 (G - G/2) = 3 G,
    backward (a gather and a reduce-scatter beside each unit's G) G + 4 (2 G - G) + G = 6 G."""
    spec, cand = _tiny(), Candidate(4, 4, 1, 1, 1)
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
    est = estimate(_tiny(), Candidate(4, 4, 1, 1, 2), slow)
    assert est.terms["fsdp"] == pytest.approx(2 * 3 * G)
    assert est.hidden["fsdp"] == pytest.approx(2 * 12 * G)
    assert est.terms["fsdp_contention"] == pytest.approx(2 * 3 * G)
    assert sum(est.terms.values()) == pytest.approx(est.step_s)


def test_fsdp_memory_is_the_shards_three_gathered_blocks_and_the_root() -> None:
    """16 bytes a parameter over the 4 ranks (experts over the ep 4 ranks holding them), three blocks'
    non-expert weights gathered in fp32 (the running one, the prefetched one, the running one's gradient),
    and the root (the tied embedding) gathered for the step. With ep 2 < dp 4 FSDP shards the experts too:
    a block's 98304 / 4 expert weights over ep 2 join each gathered block."""
    spec = _tiny()
    block = (DENSE - EMBED) / 4
    state = DENSE * 16 / 4 + EXPERTS * 16 / 4
    assert fsdp_state_bytes(spec, Candidate(4, 4, 1, 1, 1)) == pytest.approx([state + 3 * block * 4 + EMBED * 4])
    sharded = fsdp_state_bytes(spec, Candidate(4, 2, 1, 1, 1))
    assert sharded == pytest.approx([state + 3 * (block + EXPERTS / 4 / 2) * 4 + EMBED * 4])
    # Two stages: each rank's state over all 8 ranks; the first holds the embedding, the last the tied head.
    piped = fsdp_state_bytes(spec, Candidate(4, 4, 1, 2, 2))
    one = DENSE * 16 / 8 + EXPERTS * 16 / 8 + 3 * block * 4 + EMBED * 4
    assert piped == pytest.approx([one, one])
