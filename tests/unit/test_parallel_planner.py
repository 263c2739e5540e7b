"""The planner's cost model against hand-computed values, its enumeration and memory check."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_spec, toy_cluster

from moekit.model import Transformer
from moekit.parallel.planner import (
    Candidate,
    Cluster,
    all_to_all_time,
    candidates,
    estimate,
    fsdp_collectives,
    layer_flops,
    load_cluster,
    load_model,
    members_per_node,
    p2p_time,
    param_counts,
    plan,
    rescore,
    ring_time,
)

CLUSTER = toy_cluster()
TWO_BLOCKS = {"model.n_layers": "2"}  # the tiny preset's own depth


@pytest.mark.parametrize(
    "overrides",
    [{}, {"model.n_kv_heads": "1", "moe.num_shared_experts": "1", "model.first_dense_layers": "1", "moe.d_ff": "48"}],
)
def test_param_counts_equal_the_built_model(overrides: dict[str, str]) -> None:
    spec = tiny_spec(**TWO_BLOCKS, **overrides)
    model = Transformer(spec.model, spec.moe)
    dense, experts = param_counts(spec)
    assert dense + experts == model.num_params()
    assert experts == sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters())


def test_layer_flops_hand_computed() -> None:
    spec = tiny_spec(**TWO_BLOCKS)  # D=32, 2 heads of 16, ctx 32, 4 experts of F=64 (SwiGLU), top-2
    f = layer_flops(spec, moe_layer=True)
    assert f["attention"] == 2 * 32 * 16 * 6 + 2 * 32 * 32
    assert f["core"] == 2 * (32 + 32) * 16  # QK^T and AV over 32 query dims, causal: 16 keys on average
    assert f["experts"] == 2 * (2 * 3 * 32 * 64)
    assert f["dense"] == 2 * 32 * 4  # the router


def test_collective_times_hand_computed() -> None:
    c = CLUSTER
    assert members_per_node(8, 1, 4) == 4 and members_per_node(4, 4, 4) == 1 and members_per_node(2, 2, 4) == 2
    # Within a node of devices: 3 messages posted together (one latency, 10 us), 3/4 of 1 MB at 10 GB/s.
    assert all_to_all_time(1e6, 4, 1, c) == pytest.approx(10e-6 + 0.75e6 / 10e9)
    # 8 ranks over 2 nodes, flat: the node's path (10 us, 3/8 of 1 MB at 10 GB/s: 47.5 us) beside the
    # network's (4 remote messages in flight at once, 100 us, half the bytes at 1 GB/s: 600 us).
    assert all_to_all_time(1e6, 8, 1, c) == pytest.approx(100e-6 + 0.5e6 / 1e9)
    # With a fast network (1 us, 100 GB/s: 6 us) the node's path is the slower one and sets the time.
    fast = dataclasses.replace(c, inter_latency_us=1.0, inter_gbps=100.0)
    assert all_to_all_time(1e6, 8, 1, fast) == pytest.approx(10e-6 + 0.375e6 / 10e9)
    # 32 ranks over 8 nodes: 28 remote peers cost one latency, not 28 (2.8 ms); 7/8 of 1 MB at 1 GB/s.
    assert all_to_all_time(1e6, 32, 1, c) == pytest.approx(100e-6 + 0.875e6 / 1e9)
    two = 10e-6 + 0.75e6 / 10e9 + 100e-6 + 0.5e6 / 1e9  # within the node, then across: one after the other
    assert all_to_all_time(1e6, 8, 1, c, two_level=True) == pytest.approx(two)
    # CPU ranks (4 sharing 2 cores, as benchmarks/planner_calibration.py runs them): one latency a peer.
    cpu = dataclasses.replace(c, nodes=1, cores=2)
    assert all_to_all_time(1e6, 4, 1, cpu) == pytest.approx(3 * 10e-6 + 0.75e6 / 10e9)
    cpu_nodes = dataclasses.replace(c, cores=2)
    assert all_to_all_time(1e6, 8, 1, cpu_nodes) == pytest.approx(4 * 100e-6 + 0.5e6 / 1e9)
    assert ring_time(1e6, 4, 1, c) == pytest.approx(2 * (3 * 10e-6 + 0.75e6 / 10e9))
    assert ring_time(1e6, 2, 4, c, passes=1) == pytest.approx(100e-6 + 0.5e6 / 1e9)
    assert p2p_time(1e6, 4, c) == pytest.approx(100e-6 + 1e6 / 1e9)
    # A pipeline of 8 stages 1 rank apart spans 2 nodes of 4: its one inter-node hop paces it.
    assert p2p_time(1e6, 1, c, 4) == pytest.approx(10e-6 + 1e6 / 10e9)
    assert p2p_time(1e6, 1, c, 8) == pytest.approx(100e-6 + 1e6 / 1e9)


def test_imbalance_slows_the_step_and_overlap_hides_exchanges() -> None:
    spec, c = tiny_spec(**TWO_BLOCKS), CLUSTER
    ep4 = Candidate(4, 4, 1, 1, 1, "flat", "none")
    assert estimate(spec, ep4, c, 2.0).step_s > estimate(spec, ep4, c).step_s
    overlapped = Candidate(4, 4, 1, 1, 1, "flat", "forward")
    # Latency-bound exchanges: chunks only add messages.
    assert estimate(spec, overlapped, c).a2a_s > estimate(spec, ep4, c).a2a_s
    # Bandwidth-bound exchanges beside slow GEMMs: half of the shorter one is hidden.
    slow = Cluster("slow", 1, 4, 1e-3, 1.0, 1.0, 0.1, 0.01, 0.1, 0.01, overlap=1.0)
    plain, hidden = estimate(spec, ep4, slow), estimate(spec, overlapped, slow)
    assert hidden.step_s < plain.step_s
    # Where exchanges and GEMMs compete for the same cores (overlap 0), chunking hides nothing.
    busy = dataclasses.replace(slow, overlap=0.0)
    assert estimate(spec, overlapped, busy).a2a_s > estimate(spec, ep4, busy).a2a_s


def test_overlap_hides_only_the_forward_exchanges_hand_computed() -> None:
    """The dispatcher overlaps the forward's dispatch and combine with the forward's expert GEMMs; the
    backward's exchanges run in the autograd thread, fully exposed."""
    spec = tiny_spec(
        **{"model.n_layers": "2"}
    )  # 2 MoE blocks of 4 experts, D=32, F=64 (SwiGLU), top-2, ctx 32, global batch 16, fp32
    # ep=4, one micro-batch: 16 * 32 / 4 = 128 tokens per rank, 128 * 2 picks * 32 * 4 bytes = 32768 bytes
    # per exchange; each overlap chunk sends half. One rank's expert FLOPs, forward and backward:
    # 128 tokens * 3 * 2 blocks * 2 picks * (2 * 3 * 32 * 64).
    expert_flops = 128 * 3 * 2 * 2 * (2 * 3 * 32 * 64)
    flat, ovl = Candidate(4, 4, 1, 1, 1, "flat", "none"), Candidate(4, 4, 1, 1, 1, "flat", "forward")
    # Within one node of 4: 3 messages posted together (10 us), 3/4 of the bytes at 10 GB/s; 2 blocks x 2 chunks.
    chunked = 2 * 2 * (10e-6 + 0.75 * 16384 / 10e9)  # the 2 blocks' dispatches (or combines), in chunks
    whole = 2 * (10e-6 + 0.75 * 32768 / 10e9)
    # GEMMs much slower than exchanges (1 MFLOP/s): the forward's two exchanges are hidden but for one
    # chunk (half of them), the backward's two are paid in full.
    slow = dataclasses.replace(CLUSTER, peak_tflops=1e-6, overlap=1.0)
    expert_s = expert_flops / 1e6
    got = estimate(spec, ovl, slow)
    assert got.compute_s == pytest.approx(estimate(spec, flat, slow).compute_s)  # overlap adds no FLOPs
    assert got.a2a_s < 1e-3 * expert_s  # the regime asked for
    assert got.a2a_s == pytest.approx(2 * chunked / 2 + 2 * chunked)
    assert estimate(spec, flat, slow).a2a_s == pytest.approx(4 * whole)
    # GEMMs much faster (1 PFLOP/s): the forward's GEMMs hide in its exchanges but for one chunk,
    # everything else is paid: a2a_s = (2 exchanges + forward GEMMs / 2) + 2 exchanges + backward GEMMs
    # - all expert GEMMs.
    fast = dataclasses.replace(CLUSTER, peak_tflops=1e3, overlap=1.0)
    forward_s = expert_flops / 1e15 / 3
    assert estimate(spec, ovl, fast).a2a_s == pytest.approx(4 * chunked - forward_s / 2)
    # Half of it hidden (cluster.overlap 0.5): half of what full overlap hides.
    half = dataclasses.replace(fast, overlap=0.5)
    assert estimate(spec, ovl, half).a2a_s == pytest.approx(4 * chunked - forward_s / 4)


def test_pass_overhead_and_fsdp_are_paid_per_micro_batch() -> None:
    # CPU ranks (4 cores for 4 ranks: no queue): FSDP's collectives run in line with the compute, all exposed.
    spec, c = tiny_spec(**TWO_BLOCKS), dataclasses.replace(CLUSTER, cores=4)  # 2 blocks, both MoE
    with_overhead = dataclasses.replace(c, pass_overhead_us=100.0)
    for micro in (1, 4):
        dp4 = Candidate(4, 1, 1, 1, micro, "flat", "none")
        added = estimate(spec, dp4, with_overhead).step_s - estimate(spec, dp4, c).step_s
        assert added == pytest.approx(micro * 2 * 100e-6)
    # FSDP over 4 ranks of one node: 3 collectives per unit (2 blocks + the root) and per MoE
    # layer's experts, every micro-batch.
    dense_p, expert_p = param_counts(spec)
    one = 3 * 3 * ring_time(dense_p * 4 / 3, 4, 1, c, passes=1) + 3 * 2 * ring_time(expert_p * 4 / 2, 4, 1, c, passes=1)
    for micro in (1, 4):
        assert estimate(spec, Candidate(4, 1, 1, 1, micro, "flat", "none"), c).sync_s == pytest.approx(micro * one)
    # Overlapped dispatch computes the experts chunk by chunk inside one call: FSDP's collectives are
    # the same as without overlap (tests/dist/test_parity.py counts them on real ranks).
    assert fsdp_collectives(spec, Candidate(4, 1, 1, 1, 1, "flat", "forward"), c) == fsdp_collectives(
        spec, Candidate(4, 1, 1, 1, 1, "flat", "none"), c
    )


def test_enumeration_and_memory_rejection() -> None:
    spec = load_model("mixtral-8x7b")
    h100 = load_cluster("dgx-h100", nodes=1)
    every = candidates(spec, h100)
    assert every and all(c.dp * c.tp * c.pp == 8 and c.dp % c.ep == 0 for c in every)
    assert not any(estimate(spec, c, h100).fits for c in every), "46.7B parameters x 16 bytes > 8 x 85.5 GB"
    assert plan(spec, h100) == []
    rows = plan(spec, load_cluster("dgx-h100", nodes=4), top=5)
    assert rows and all(r.fits and r.memory_gb <= 85.5 * 0.9 for r in rows)
    assert [r.step_s for r in rows] == sorted(r.step_s for r in rows)


def test_rescore_with_skewed_loads_prefers_placement() -> None:
    spec, c = tiny_spec(**TWO_BLOCKS), CLUSTER
    rows = [estimate(spec, Candidate(4, 4, 1, 1, 1, "flat", "none"), c)]
    skewed = [[70.0, 20.0, 8.0, 2.0]] * 2
    (r,) = rescore(spec, c, rows, skewed, remaining_steps=100)
    assert r.placed.step_s <= r.estimate.step_s
    # ep=4 over 4 experts: every rank has one expert whatever the placement, so nothing to gain.
    assert r.placed.step_s == pytest.approx(r.estimate.step_s) and not r.switch
    ep2 = rescore(spec, c, [estimate(spec, Candidate(4, 2, 1, 1, 1, "flat", "none"), c)], skewed, 100)[0]
    assert ep2.placed.step_s < ep2.estimate.step_s


def test_dgx_h100_rates_are_the_measured_ones() -> None:
    """The DGX-H100 preset's device rates are the H100 measurements in benchmarks/measured (written by
    benchmarks/device_rates.py and benchmarks/expert_gemm_rates.py), as rounded in the preset."""
    import json
    import sys
    from pathlib import Path

    measured = Path(__file__).resolve().parents[2] / "benchmarks" / "measured"
    sys.path.insert(0, str(measured.parent))
    try:
        from expert_gemm_rates import fit_size_factor, large_gemm_efficiency
    finally:
        sys.path.remove(str(measured.parent))
    c = load_cluster("dgx-h100")
    rates = json.loads((measured / "h100-device-rates.json").read_text())
    assert "H100" in rates["device"] and rates["peak_tflops"] == c.peak_tflops
    for name in ("efficiency", "attention_efficiency", "fp8_speedup"):
        assert getattr(c, name) == round(rates[name], 2), name
    assert (c.hbm_gbps, c.optimizer_gbps) == (round(rates["hbm_gbps"]), round(rates["optimizer_gbps"]))
    points = []
    for path in sorted(measured.glob("h100-expert-gemm-*.json")):
        table = json.loads(path.read_text())
        points += [dict(p, experts=table["experts"]) for p in table["points"]]
    half_rows, half_work, _ = fit_size_factor(points)
    assert (c.gemm_half_rows, c.gemm_half_work) == (round(half_rows), float(f"{half_work:.1g}"))
    assert c.expert_efficiency == round(large_gemm_efficiency(points, c.peak_tflops), 2)
