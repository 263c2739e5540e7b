"""FSDP as it runs: moekit's ``fully_shard`` (FSDP2) on each block and on the root (embedding, head), its
collectives, what of them FSDP2's schedule leaves exposed, and the memory it holds.

Every micro-batch each unit all-gathers its shard before the forward and again before the backward (the
forward resharded it; a fully recomputed block reruns its forward on that same backward gather), then
reduce-scatters its gradient. On devices FSDP2 issues them on their own streams: the next unit's
gather runs beside this unit's forward, and in the backward the next unit's gather and the previous
unit's reduce-scatter run beside this unit's backward (Megatron-FSDP schedules them the same way). What
stays exposed: the first gather of each pass, the last reduce-scatter, and whatever of a unit's
collectives outlasts the compute beside it (communication-bound units). A hidden collective is not
free: its kernels hold some of the device's SMs, slowing the compute beside it by
``Cluster.overlap_contention`` of the collective's hidden time. CPU ranks (``Cluster.cores``) have no
device streams: their collectives run in line with their compute, all exposed.
"""

from __future__ import annotations

from moekit.parallel.planner.comm import ring_time
from moekit.parallel.planner.flops import _blocks, param_counts
from moekit.parallel.planner.layout import RECOMPUTE_GEMMS, Candidate
from moekit.parallel.planner.presets import Cluster, ModelSpec


def fsdp_collectives(spec: ModelSpec, cand: Candidate, c: Cluster) -> tuple[float, float]:
    """moekit's FSDP on one micro-batch of a pipeline stage: (alpha-beta seconds, number of collectives).

    Every micro-batch, each unit (a block, and the root) all-gathers its shard before the forward
    and again before the backward, then reduce-scatters its gradient; sharded experts do the same
    over the batch / ep ranks that hold the same experts (batch ranks: dp x cp), once per MoE layer even when overlapped
    dispatch computes them chunk by chunk."""
    m, w = spec.model, spec.workload
    dense_p, expert_p = param_counts(spec)
    n_moe = len(m.moe_layers())
    units = m.n_layers / cand.pp + 1
    batch = cand.dp * cand.cp  # the batch ranks, cp ones included: what its memory is sharded over
    seconds = count = 0.0
    if batch > 1:
        unit_bytes = dense_p / (cand.tp * cand.pp) * w.dtype_bytes / units
        seconds += 3 * units * ring_time(unit_bytes, batch, cand.tp, c, passes=1)
        count += 3 * units
    if n_moe and batch > cand.ep:
        layer_bytes = expert_p / (cand.ep * n_moe) * w.dtype_bytes
        seconds += 3 * n_moe / cand.pp * ring_time(layer_bytes, batch // cand.ep, cand.tp * cand.ep, c, passes=1)
        count += 3 * n_moe / cand.pp
    return seconds, count


def fsdp_exposed(spec: ModelSpec, cand: Candidate, c: Cluster, compute_s: float) -> tuple[float, float]:
    """(seconds exposed, seconds hidden) of one micro-batch's FSDP collectives beside ``compute_s``, the
    micro-batch's compute on the stage. Each of the stage's ``units`` units gathers ``g`` seconds in each
    pass and reduce-scatters ``g``, its forward taking ``f`` and its backward ``b`` (``compute_s`` split
    as the GEMMs are: 1 forward, 2 backward and the recomputed forward): exposed ``g + (units - 1)
    max(0, g - f)`` in the forward, ``g + (units - 1) max(0, 2 g - b) + g`` in the backward; the fixed
    cost per collective (``fsdp_overhead_us``: copies in and out of the flat buffer) always. Hidden:
    the rest of the wire time."""
    wire, count = fsdp_collectives(spec, cand, c)
    fixed = count * c.fsdp_overhead_us * 1e-6
    if c.cores or wire == 0:
        return wire + fixed, 0.0
    units = spec.model.n_layers / cand.pp + 1
    g = wire / (3 * units)  # one unit's gather (or reduce-scatter), the expert shards' averaged in
    extra = RECOMPUTE_GEMMS[cand.recompute][0]
    f = compute_s / (3 + extra) / units
    b = compute_s * (2 + extra) / (3 + extra) / units
    exposed = g + (units - 1) * max(0.0, g - f) + g + (units - 1) * max(0.0, 2 * g - b) + g
    return exposed + fixed, wire - exposed


def fsdp_state_bytes(spec: ModelSpec, cand: Candidate) -> list[float]:
    """Bytes of the (first, last) pipeline rank's parameters under FSDP: the training state sharded over
    every rank (``state_bytes`` a parameter; experts over the ranks holding the same ones), the root
    unit gathered for the whole step (FSDP2 keeps the root unsharded between forward and backward: the
    embedding on the first rank, the head on the last), and at the backward's peak three blocks gathered
    whole: the block running, the next one prefetched, and the running one's unsharded gradient before
    its reduce-scatter. A block's experts are gathered only where FSDP shards them (dp x cp > ep)."""
    m, w = spec.model, spec.workload
    dense, experts = param_counts(spec)
    n_blocks, n_moe = _blocks(spec)
    world = cand.dp * cand.cp * cand.tp * cand.pp
    state = dense * w.state_bytes / world + experts * w.state_bytes / (cand.pp * cand.dp * cand.cp * cand.etp)
    embed = m.vocab_size * m.d_model
    head = 0 if m.tie_embeddings else embed
    block = (dense - embed - head) / n_blocks / cand.tp
    if n_moe and cand.dp * cand.cp > cand.ep:
        block += experts / n_blocks / (cand.ep * cand.etp)
    gathered = 3 * block * w.dtype_bytes
    if cand.pp == 1:
        return [state + gathered + (embed + head) / cand.tp * w.dtype_bytes]
    return [state + gathered + root / cand.tp * w.dtype_bytes for root in (embed, head or embed)]
