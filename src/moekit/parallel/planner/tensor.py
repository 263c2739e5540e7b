"""Tensor parallelism at its cost: the dense GEMMs at the shapes tp leaves them, and the tp collectives
with sequence parallelism, with what of them runs beside a GEMM.

A GEMM's rate falls with its size: ``Cluster.gemm_half_work`` is the multiply-adds at which a GEMM
reaches half the large-GEMM rate, measured on grouped expert GEMMs (``benchmarks/expert_gemm_rates.py
--fit``). NOTE: applied to the dense GEMMs it is derived, not measured on them: the dense table of
``benchmarks/device_rates.py`` (7 shapes at 8192 rows, ``efficiency`` their median rate) reaches down
only to 8.6e10 multiply-adds, where it agrees: its two smallest GEMMs (8192 x 2048 x 5120 and 8192 x 2880
x 5120) run at 0.93 and 0.92 of the median rate, the curve says 0.93 and 0.95. A GEMM of ``w``
multiply-adds runs at ``s(w) / s(reference)`` of ``efficiency``, at most 1, ``s(w) = w / (w +
gemm_half_work)``, the reference the table's median size (``DENSE_REFERENCE_WORK``).

Each tp region of a block (attention; the dense FFN or shared experts) gathers its input and
reduce-scatters its output in the forward (sequence parallel; without it one all-reduce, the same
bytes). In the backward (Megatron's and Transformer Engine's linear layers): with sequence parallelism
the output gradient's gather is waited for, then the region's first GEMM re-gathers its input beside its
data-gradient GEMM and reduce-scatters the input gradient beside its weight-gradient GEMM; without it
the input gradient's all-reduce runs beside the weight-gradient GEMM. Only what outlasts the GEMM beside
it shows; what it hides costs ``overlap_contention`` of itself. CPU ranks run them in line, all exposed.
A fully recomputed block's forward runs its forward collectives again.
"""

from __future__ import annotations

from moekit.parallel.planner.comm import ring_time
from moekit.parallel.planner.flops import _mult, attention_dims
from moekit.parallel.planner.layout import RECOMPUTE_GEMMS, Candidate, stage_blocks
from moekit.parallel.planner.presets import Cluster, ModelSpec

# The median shape of benchmarks/device_rates.py's dense GEMMs, where ``efficiency`` is measured:
# 8192 rows x 4096 x 9216, in multiply-adds.
DENSE_REFERENCE_WORK = 8192 * 4096 * 9216


def shape_factor(work: float, c: Cluster) -> float:
    """The share of ``c.flops`` a dense GEMM of ``work`` multiply-adds reaches (1 without ``gemm_half_work``)."""
    if not c.gemm_half_work:
        return 1.0
    s = work / (work + c.gemm_half_work)
    return min(1.0, s / (DENSE_REFERENCE_WORK / (DENSE_REFERENCE_WORK + c.gemm_half_work)))


def region_gemms(spec: ModelSpec, cand: Candidate, moe_layer: bool) -> list[tuple[float, float]]:
    """A block's dense GEMMs on a tp rank: the attention projections into the heads and out of them, then
    the dense FFN's (MoE blocks: the router and the shared experts') first GEMMs and its last, each as
    ``(weights, first)``: the weights it multiplies a token by, and whether it opens its tp region (the
    column-parallel GEMM, whose backward the region's collectives run beside)."""
    m, e, a = spec.model, spec.moe, attention_dims(spec)
    D, tp = m.d_model, cand.tp
    out_proj = a["v"] * D
    gemms = [((a["weights"] - out_proj) / tp, True), (out_proj / tp, False)]
    width, act = (e.shared_hidden, e.activation) if moe_layer else (m.d_ff, m.mlp_activation)
    if moe_layer:
        gemms.append((D * e.num_experts / tp, False))  # the router
    if width:
        gemms += [((_mult(act) - 1) * D * width / tp, True), (D * width / tp, False)]
    return gemms


def dense_gemm_seconds(
    spec: ModelSpec, cand: Candidate, c: Cluster, tokens: float, rate: float, blocks: int, n_moe: float
) -> tuple[float, float, list[float]]:
    """One micro-batch's dense GEMMs on a rank, forward + backward (and a recomputed forward): (seconds
    at ``rate``, seconds at their shapes, the forward seconds of each block's region-opening GEMMs at
    their shapes: [attention's, the FFN's] of a MoE block, then of a dense one)."""
    extra = RECOMPUTE_GEMMS[cand.recompute][0]
    large = shaped = 0.0
    opening: list[float] = []
    for moe_layer, count in ((True, n_moe), (False, blocks - n_moe)):
        firsts = []
        for params, first in region_gemms(spec, cand, moe_layer):
            seconds = 2 * tokens * params / rate
            large += (3 + extra) * count * seconds
            shaped += (3 + extra) * count * seconds / shape_factor(tokens * params, c)
            if first:
                firsts.append(seconds / shape_factor(tokens * params, c))
        opening += (firsts + [0.0, 0.0])[:2]
    return large, shaped, opening


def tp_exchanges(
    spec: ModelSpec, cand: Candidate, c: Cluster, tokens: float, opening: list[float]
) -> tuple[float, float]:
    """(exposed, hidden) seconds of one micro-batch's tp collectives on a rank: two regions a block,
    ``opening`` the forward seconds of each region's first GEMM (``dense_gemm_seconds``), which its data-
    and weight-gradient GEMMs each take again in the backward."""
    if cand.tp == 1:
        return 0.0, 0.0
    blocks, n_moe = stage_blocks(spec, cand)
    extra = RECOMPUTE_GEMMS[cand.recompute][0]
    r = ring_time(tokens * spec.model.d_model * spec.workload.dtype_bytes, cand.tp, 1, c, passes=1)
    exposed = hidden = 0.0
    for count, gemms in ((n_moe, opening[:2]), (blocks - n_moe, opening[2:])):
        for t in gemms:
            t = 0.0 if c.cores else t  # CPU ranks: in line
            if cand.sp:  # the gradient's gather, then the input's re-gather and the gradient's reduce-scatter
                late = max(0.0, r - t) + max(0.0, r - t)
                exposed += count * (2 * r * (1 + extra) + r + late)
                hidden += count * (2 * r - late)
            else:  # the input gradient's all-reduce beside the weight gradient
                late = max(0.0, 2 * r - t)
                exposed += count * (2 * r * (1 + extra) + late)
                hidden += count * (2 * r - late)
    return exposed, hidden
