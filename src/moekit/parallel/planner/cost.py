"""The cost model: predicted step time and peak memory of one layout, as a sum of named terms.

One step is ``micro + (pp - 1) / vp`` pipeline slots (the interleaved bubble; ``vp`` 1 is plain 1F1B)
of one micro-batch through the busiest stage, plus the exposed part of the once-per-step gradient
synchronisation, an interleaved pipeline's fill sends (``stages``) and the optimizer step
(``OPTIMIZER_BYTES`` a parameter over ``optimizer_gbps``). A micro-batch's time is its GEMMs (at
``efficiency`` of peak, slower at the small shapes tp leaves them (``tensor``), the experts' at
``expert_efficiency`` and slower when they have few rows, fp8 ones faster by ``fp8_speedup``), the
attention scores (bf16, at ``attention_efficiency``), the elementwise work between them (bytes over
``hbm_gbps``, with the casts into fp8), recomputation, the busiest end stage's own work (embedding
gradient, or head and loss), a fixed cost a pipeline chunk, and the exchanges left exposed: tp's
(``tensor``: the forward's exposed, the backward's beside their GEMMs), the expert all-to-alls
(flat, two-level, or deduplicated: one copy a destination node), expert-tp gathers, context-parallel KV
rings, pipeline sends (hidden when interleaved), and moekit's FSDP, which gathers every unit every
micro-batch, prefetched beside the compute on devices (``fsdp``: what stays exposed, and the contention
of what does not). An overlappable exchange hides ``cluster.overlap`` of itself, at most the compute that
runs beside it (interleaved pipeline sends, which nothing waits for until a chunk later, all of it);
all-to-alls overlapped in both passes only in the micro-batches paired with another one
(``paired_share``; refused where Megatron refuses it: ``check_both_pass_overlap``). Ranks that share
fewer cores than they are (CPU ranks) queue for them.
``Estimate.terms`` names each term's seconds a step, ``Estimate.hidden`` what overlap hides of each
overlappable exchange.

Techniques each have a switch in ``Candidate`` (all off is moekit's own runtime, what
``benchmarks/planner_calibration.py`` measures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moekit.parallel.planner.comm import all_to_all_time, deduplicated_time, members_per_node, p2p_time, ring_time
from moekit.parallel.planner.flops import attention_dims, layer_flops, param_counts
from moekit.parallel.planner.fsdp import fsdp_exposed
from moekit.parallel.planner.layout import RECOMPUTE_GEMMS, Candidate, micro_tokens, paired_share, stage_blocks
from moekit.parallel.planner.memory import MEMORY_USABLE, memory_bytes
from moekit.parallel.planner.presets import Cluster, ModelSpec
from moekit.parallel.planner.stages import busiest_stage, embedding_seconds, loss_seconds, pipeline_fixed
from moekit.parallel.planner.tensor import dense_gemm_seconds, tp_exchanges
from moekit.parallel.planner.traffic import FP8_CAST_BYTES, elementwise_bytes, fp8_cast_values

# Bytes an AdamW step moves a parameter: fp32 weight, gradient and two moments read, weight and moments written.
OPTIMIZER_BYTES = 28
OVERLAP_CHUNKS = 2  # chunks of an overlapped dispatch (parallel.overlap_chunks)


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    step_s: float
    compute_s: float  # GEMMs, elementwise work and recomputation, with the pipeline bubble; the optimizer step
    a2a_s: float  # expert-parallel exchanges on the critical path
    sync_s: float  # gradient and FSDP collectives, tp, cp and pipeline exchanges left exposed, their fixed costs
    memory_gb: float  # peak per device
    fits: bool
    terms: dict[str, float] = field(default_factory=dict, compare=False)  # seconds a step of each named term
    # Seconds a step of each overlappable exchange that runs beside compute, hidden (not in ``step_s``).
    hidden: dict[str, float] = field(default_factory=dict, compare=False)


def gradient_sync_time(spec: ModelSpec, cand: Candidate, c: Cluster) -> float:
    """Distributed optimizer, once a step: reduce-scatter of the gradients and all-gather of the
    updated weights, non-expert ones over the dp * cp ranks, expert ones over the ranks holding the
    same experts."""
    w = spec.workload
    dense_p, expert_p = param_counts(spec)
    world = cand.dp * cand.cp * cand.tp * cand.pp
    edp = world // (cand.pp * cand.ep * cand.etp)
    seconds = 0.0
    for nbytes in (w.grad_bytes, w.dtype_bytes):  # gradients reduce-scattered in their buffer, weights gathered
        seconds += ring_time(dense_p / (cand.tp * cand.pp) * nbytes, cand.dp * cand.cp, cand.tp, c, passes=1)
        seconds += ring_time(expert_p / (cand.ep * cand.etp * cand.pp) * nbytes, edp, cand.ep * cand.etp, c, 1)
    return seconds


def route_reach(spec: ModelSpec, nodes: int) -> int:
    """Nodes of an expert group of ``nodes`` nodes one token's experts can be on, at most: group-limited
    routing (``moe.n_group`` contiguous expert groups, ``moe.topk_group`` of them a token) confines it to
    the nodes its groups sit on, ``topk_group`` when each node holds whole groups (DeepSeek-V3: 8 groups,
    4 a token, over ep 64 = 8 nodes: 4 nodes), ``topk_group`` groups' share of the nodes when a group
    spans several nodes; any other split, or no groups, reaches them all."""
    e = spec.moe
    picked = e.topk_group or e.n_group
    if e.n_group % nodes == 0:
        return min(nodes, picked)
    if nodes % e.n_group == 0:
        return min(nodes, picked * nodes // e.n_group)
    return nodes


def _size_factor(rows: float, work: float, c: Cluster) -> float:
    """The share of the large-GEMM rate a grouped expert GEMM reaches with ``rows`` rows an expert and
    ``work`` multiply-adds over all its experts (``Cluster.gemm_half_rows``, ``gemm_half_work``)."""
    by_rows = rows / (rows + c.gemm_half_rows) if c.gemm_half_rows else 1.0
    return by_rows * (work / (work + c.gemm_half_work) if c.gemm_half_work else 1.0)


def _hidden(exchange_s: float, beside_s: float, c: Cluster) -> float:
    """What overlap hides of an exchange: ``c.overlap`` of it, at most the compute beside it."""
    return c.overlap * min(exchange_s, beside_s)


def _compute_terms(
    spec: ModelSpec, cand: Candidate, c: Cluster, tokens: float, rows: float, load_imbalance: float
) -> tuple[dict[str, float], float, list[float]]:
    """One micro-batch's compute on the busiest rank, by term (GEMMs at the large-GEMM rate and their
    slowdown at their shapes, expert GEMMs, attention scores, the fixed cost per block pass, elementwise
    work, the busiest stage's own: head, loss, embedding gradient), its total seconds, and the forward
    seconds of the tp regions' opening GEMMs (``dense_gemm_seconds``)."""
    m, e = spec.model, spec.moe
    D = m.d_model
    blocks, n_moe = stage_blocks(spec, cand)
    moe_f = layer_flops(spec, True)
    extra_dense, extra_experts = RECOMPUTE_GEMMS[cand.recompute]
    fp8 = c.fp8_speedup if cand.fp8 else 1.0
    gemm_rate = c.flops * fp8
    attention_rate = c.peak_tflops * 1e12 * (c.attention_efficiency or c.efficiency)
    # Forward FLOPs of one micro-batch on the busiest rank.
    redone = tokens * blocks * 2 * attention_dims(spec)["up"] / cand.tp if cand.recompute == "mla_up_proj" else 0.0
    core = tokens * blocks * moe_f["core"] / cand.tp
    experts = rows * n_moe * moe_f["experts"] * load_imbalance
    head = tokens * 2 * D * m.vocab_size * (1 + spec.shape.mtp_layers) / cand.tp
    per_expert = rows * cand.ep * e.top_k / e.num_experts  # rows of each local expert
    work = e.num_experts / cand.ep * per_expert * D * e.d_ff / cand.etp  # one grouped GEMM's multiply-adds
    expert_peak = c.peak_tflops * 1e12 * (c.expert_efficiency or c.efficiency) * fp8
    expert_rate = expert_peak * _size_factor(per_expert, work, c)
    large, shaped, opening = dense_gemm_seconds(spec, cand, c, tokens, gemm_rate, blocks, n_moe)
    terms = {
        "gemm": large + redone / gemm_rate,
        "gemm_shape": shaped - large,  # the dense GEMMs' slowdown at the shapes tp leaves them
        "gemm_experts": (3 + extra_experts) * experts / expert_rate,
        "attention": (3 + extra_dense) * core / attention_rate,
        "overhead": blocks * c.pass_overhead_us * 1e-6,
    }
    if c.hbm_gbps:  # elementwise work, and under fp8 the casts, both at the rate eager kernels reach
        elementwise = elementwise_bytes(spec, cand, tokens, load_imbalance)
        if cand.fp8:
            elementwise += FP8_CAST_BYTES * fp8_cast_values(spec, cand, tokens, load_imbalance)
        terms["elementwise"] = elementwise / (c.hbm_gbps * 1e9)
    blocks_s = sum(terms.values())
    ends = {
        "head": 3 * head / c.flops,
        "loss": loss_seconds(spec, cand, c, tokens),
        "embedding": embedding_seconds(spec, cand, c),
    }
    compute_s, stage_terms = busiest_stage(blocks_s, ends, blocks, spec, cand)
    terms.update(stage_terms)
    return terms, compute_s, opening


def _expert_exchanges(
    spec: ModelSpec,
    cand: Candidate,
    c: Cluster,
    rows: float,
    terms: dict[str, float],
    compute_s: float,
    load_imbalance: float,
) -> tuple[float, dict[str, float]]:
    """Seconds a micro-batch's expert-parallel exchanges add (dispatch and combine in the forward and again
    in the backward, with expert tp's gathers), and what overlap hides of them."""
    e, dt, D = spec.moe, spec.workload.dtype_bytes, spec.model.d_model
    n_moe = stage_blocks(spec, cand)[1]
    extra_dense, extra_experts = RECOMPUTE_GEMMS[cand.recompute]
    stride = cand.etp if cand.sp else cand.tp
    rows_bytes = rows * e.top_k * D * dt * load_imbalance
    chunks = OVERLAP_CHUNKS if cand.overlap == "forward" else 1
    if cand.all_to_all == "deduplicated":
        reach = route_reach(spec, cand.ep // members_per_node(cand.ep, stride, c.gpus_per_node))
        one = chunks * deduplicated_time(rows / chunks, D * dt * load_imbalance, e.top_k, cand.ep, stride, c, reach)
    else:
        one = chunks * all_to_all_time(rows_bytes / chunks, cand.ep, stride, c, cand.all_to_all == "two_level")
    one += 2 * ring_time(rows_bytes, cand.etp, 1, c, passes=1)  # expert tp: gather rows in, scatter out
    forward = 2 * one * n_moe
    passes = 2 + extra_dense  # the forward's exchanges again in a fully recomputed block
    if cand.overlap == "forward":
        # NOTE: moekit's dispatcher overlaps only the forward's exchanges with the forward's expert GEMMs
        # (a third of their FLOPs); the backward's exchanges run in the autograd thread, fully exposed.
        # Chunk by chunk, all but one chunk's exchange can run beside another chunk's GEMMs, and of that
        # ``cluster.overlap`` is hidden: none where the exchange and the GEMMs compete for the same cores.
        fwd_s = terms["gemm_experts"] / (3 + extra_experts)
        hidden = {"a2a": c.overlap * min(forward, fwd_s) * (1 - 1 / chunks)}
        a2a = passes * forward - hidden["a2a"]
        a2a += (chunks - 1) * n_moe * c.chunk_overhead_us * 1e-6
    else:
        a2a, hidden = passes * forward, {}
        if cand.overlap == "both":  # one micro-batch's exchanges beside another's compute, both passes
            hidden["a2a"] = paired_share(cand) * _hidden(a2a, compute_s, c)
            a2a -= hidden["a2a"]
    return a2a, hidden


def _other_exchanges(
    spec: ModelSpec,
    cand: Candidate,
    c: Cluster,
    tokens: float,
    terms: dict[str, float],
    compute_s: float,
    opening: list[float],
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds a micro-batch's tp, cp, pipeline and FSDP exchanges leave exposed, by name, and what overlap
    hides of each."""
    D, dt = spec.model.d_model, spec.workload.dtype_bytes
    blocks = stage_blocks(spec, cand)[0]
    extra_dense = RECOMPUTE_GEMMS[cand.recompute][0]
    sp = cand.tp if cand.sp else 1
    exchanges, hidden = {}, {}
    if cand.tp > 1:  # 2 regions a block, the backward's collectives beside its GEMMs (``tp_exchanges``)
        # NOTE: the forward's stay exposed: Megatron hides them only with its userbuffer tp_comm_overlap,
        # which the published DGX-H100 MoE recipes leave off (Megatron-Bridge's Qwen3-235B-A22B H100 config).
        exchanges["tp"], hidden["tp"] = tp_exchanges(spec, cand, c, tokens, opening)
        exchanges["tp_contention"] = c.overlap_contention * hidden["tp"]
    if cand.cp > 1:  # ring attention: K, V round the ring in the forward, K, V and their grads back
        kv = tokens * attention_dims(spec)["kv_act"] / cand.tp * dt
        cp_s = (1 + extra_dense + 2) * blocks * (cand.cp - 1) * p2p_time(kv, cand.tp, c, cand.cp)
        hidden["cp"] = _hidden(cp_s, terms["attention"], c)
        exchanges["cp"] = cp_s - hidden["cp"]
    if cand.pp > 1:  # activations to the next stage, gradients back, once per virtual stage
        pp_s = 2 * cand.vp * p2p_time(tokens * D * dt / sp, cand.tp * cand.cp * cand.dp, c, cand.pp)
        # NOTE: interleaved schedules post each send on its own stream and wait for it only before the chunk
        # that needs it, one chunk's compute later (Megatron's overlap_p2p_comm, for interleaved schedules
        # only): nothing depends on it meanwhile, so only what outlasts that compute shows. Plain 1F1B
        # waits for each send.
        exchanges["pp"] = max(0.0, pp_s - compute_s) if cand.vp > 1 else pp_s
        hidden["pp"] = pp_s - exchanges["pp"]
        exchanges["pp_schedule"] = pipeline_fixed(spec, cand, c, 0.0)[0]
    if cand.grad_sync == "fsdp":
        exchanges["fsdp"], hidden["fsdp"] = fsdp_exposed(spec, cand, c, compute_s)
        if hidden["fsdp"]:  # what the prefetched collectives take from the compute beside them
            exchanges["fsdp_contention"] = c.overlap_contention * hidden["fsdp"]
    return exchanges, hidden


def estimate(spec: ModelSpec, cand: Candidate, c: Cluster, load_imbalance: float = 1.0) -> Estimate:
    """Predicted step time and memory of one layout; ``load_imbalance`` is the max/mean rank load of
    the experts (1.0 balanced), which slows the busiest rank's GEMMs and exchanges. A micro-batch's
    compute, expert exchanges and other exchanges, then the step: ``micro`` of them and the bubble, the
    once-a-step gradient sync and optimizer step, and the queue for cores."""
    tokens = micro_tokens(spec, cand) / cand.cp  # a rank's tokens in attention
    rows = tokens / (cand.tp if cand.sp else 1)  # a rank's tokens entering the MoE layer (tp repeats them without sp)
    terms, compute_s, opening = _compute_terms(spec, cand, c, tokens, rows, load_imbalance)
    a2a, hidden = _expert_exchanges(spec, cand, c, rows, terms, compute_s, load_imbalance)
    terms["a2a"] = a2a
    exchanges, exchange_hidden = _other_exchanges(spec, cand, c, tokens, terms, compute_s, opening)
    hidden.update(exchange_hidden)
    terms.update(exchanges)
    sync = sum(exchanges.values())
    slots = cand.micro + (cand.pp - 1) / cand.vp
    step_terms = {name: cand.micro * t for name, t in terms.items()}
    step_terms["bubble"] = (slots - cand.micro) * (compute_s + a2a + sync)
    sends = tokens * spec.model.d_model * spec.workload.dtype_bytes / (cand.tp if cand.sp else 1)
    step_sync = step_terms["pp_fill"] = pipeline_fixed(spec, cand, c, sends)[1]  # the fill's sends, once a step
    step_hidden = {name: cand.micro * t for name, t in hidden.items()}
    if cand.grad_sync == "overlapped":  # beside the first micro-batch's forward and the last one's backward
        grads = gradient_sync_time(spec, cand, c)
        step_hidden["grads"] = _hidden(grads, compute_s + a2a, c)
        step_terms["grads"] = grads - step_hidden["grads"]
        step_sync += step_terms["grads"]
    optimizer = 0.0
    if c.optimizer_gbps:  # once a step, each rank updating its shard: every parameter over every rank
        world = cand.dp * cand.cp * cand.tp * cand.pp
        optimizer = step_terms["optimizer"] = (
            sum(param_counts(spec)) * OPTIMIZER_BYTES / world / (c.optimizer_gbps * 1e9)
        )
    queued = 0.0
    if c.cores and c.gpus_per_node > c.cores:
        # Ranks sharing fewer cores (CPU ranks): a rank's step is at least its share of every rank's
        # work; a rank idle in the pipeline bubble gives its core to the others, so the bubble is free.
        busy = cand.micro * (compute_s + a2a + sync) + step_sync + optimizer
        queued = max(0.0, c.gpus_per_node / c.cores * busy - (slots * (compute_s + a2a + sync) + step_sync + optimizer))
        step_terms["cores"] = queued
    mem = memory_bytes(spec, cand, load_imbalance)
    return Estimate(
        cand,
        step_s=slots * (compute_s + a2a + sync) + step_sync + optimizer + queued,
        compute_s=slots * compute_s + optimizer + queued,
        a2a_s=slots * a2a,
        sync_s=slots * sync + step_sync,
        memory_gb=mem / 1e9,
        fits=mem <= c.memory_gb * 1e9 * MEMORY_USABLE,
        terms=step_terms,
        hidden=step_hidden,
    )
