"""The cost model: predicted step time and peak memory of one layout, as a sum of named terms.

One step is ``micro + (pp - 1) / vp`` pipeline slots (the interleaved bubble; ``vp`` 1 is plain 1F1B)
of one micro-batch through the busiest stage, plus the exposed part of the once-per-step gradient
synchronisation and the optimizer step (``OPTIMIZER_BYTES`` a parameter over ``optimizer_gbps``). A
micro-batch's time is its GEMMs (at ``efficiency`` of peak, the experts' at
``expert_efficiency`` and slower when they have few rows, fp8 ones faster by ``fp8_speedup``), the
attention scores (bf16, at ``attention_efficiency``), the elementwise work between them (bytes over
``hbm_gbps``, with the casts into fp8), recomputation, and the exchanges left exposed: tp all-reduces (or
sequence-parallel all-gather + reduce-scatter, the same bytes, never hidden), the expert all-to-alls
(flat, two-level, or deduplicated: one copy a destination node), expert-tp gathers, context-parallel KV
rings, pipeline sends (hidden when interleaved), and moekit's FSDP, which gathers every unit every
micro-batch. An overlappable exchange hides ``cluster.overlap`` of itself, at most the compute that
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

import math
from dataclasses import dataclass, field

from moekit.parallel.planner.comm import all_to_all_time, deduplicated_time, members_per_node, p2p_time, ring_time
from moekit.parallel.planner.flops import _blocks, _mult, attention_dims, layer_flops, param_counts
from moekit.parallel.planner.presets import Cluster, ModelSpec

MEMORY_USABLE = 0.9  # NOTE: workspace, fragmentation and the allocator's caches take the rest
# Bytes a value costs to cast into fp8 (``fp8_cast_values``): 2 read, 1 written and 1 for its transpose,
# which the other GEMM of the backward reads (Transformer Engine on Hopper).
FP8_CAST_BYTES = 4
# Bytes an AdamW step moves a parameter: fp32 weight, gradient and two moments read, weight and moments written.
OPTIMIZER_BYTES = 28
OVERLAP_CHUNKS = 2  # chunks of an overlapped dispatch (parallel.overlap_chunks)


@dataclass(frozen=True)
class Candidate:
    """One layout and the techniques it uses. ``dp`` is the data-parallel degree (world / (tp cp pp)):
    moekit's mesh carves ep out of it (ep divides dp, experts replicated over tp); with sequence
    parallelism the tp and cp ranks hold different tokens and join the expert groups too (Megatron's
    expert mesh: ep * etp divides dp * cp * tp, etp innermost)."""

    dp: int
    ep: int
    tp: int
    pp: int
    micro: int  # micro-batches per step on each data rank (pipeline micro-batches or gradient accumulation)
    all_to_all: str = "flat"  # flat | two_level | deduplicated (one copy a destination node, DeepEP)
    overlap: str = "none"  # all-to-all overlap: none | forward (moekit's chunked dispatch) | both (both passes)
    cp: int = 1  # context parallel: each sequence split over cp ranks, keys and values passed round a ring
    etp: int = 1  # expert tensor parallel: each expert's FFN split over etp ranks (needs sp)
    vp: int = 1  # virtual stages per pipeline rank (interleaved 1F1B)
    grad_sync: str = "fsdp"  # fsdp: gather/reduce every micro-batch | overlapped: once a step, beside compute
    recompute: str = "none"  # none | selective (norms, activations) | mla_up_proj | experts (expert FFNs) | full
    sp: bool = False  # sequence parallel with tp (activations split over tp between the tp regions)
    fp8: bool = False  # fp8 GEMMs
    weighted_activation: bool = False  # gate weights applied in the experts' activation: no expert output kept

    @property
    def layout(self) -> tuple[int, ...]:
        """What a run's parallel settings fix: (tp, cp, pp, vp, ep, etp, micro)."""
        return (self.tp, self.cp, self.pp, self.vp, self.ep, self.etp, self.micro)


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    step_s: float
    compute_s: float  # GEMMs, elementwise work and recomputation, with the pipeline bubble; the optimizer step
    a2a_s: float  # expert-parallel exchanges on the critical path
    sync_s: float  # gradient and FSDP collectives, tp, cp and pipeline exchanges left exposed
    memory_gb: float  # peak per device
    fits: bool
    terms: dict[str, float] = field(default_factory=dict, compare=False)  # seconds a step of each named term
    # Seconds a step of each overlappable exchange that runs beside compute, hidden (not in ``step_s``).
    hidden: dict[str, float] = field(default_factory=dict, compare=False)


# Forward GEMMs done again, (dense, experts); mla_up_proj redoes only MLA's up-projections (``estimate``).
RECOMPUTE_GEMMS = {"none": (0, 0), "selective": (0, 0), "mla_up_proj": (0, 0), "experts": (0, 1), "full": (1, 1)}


def stage_blocks(spec: ModelSpec, cand: Candidate) -> tuple[int, float]:
    """(blocks of the busiest pipeline rank, MoE blocks among them): ``pp * vp`` chunks of
    ceil(blocks / (pp vp)) blocks, the MTP blocks included."""
    n_blocks, n_moe = _blocks(spec)
    blocks = math.ceil(n_blocks / (cand.pp * cand.vp)) * cand.vp
    return blocks, blocks * n_moe / n_blocks


def micro_tokens(spec: ModelSpec, cand: Candidate) -> float:
    """Tokens one data rank's micro-batch holds (a cp group shares them)."""
    return spec.workload.global_batch * spec.seq_len / (cand.dp * cand.micro)


def block_activation_bytes(spec: ModelSpec, cand: Candidate, moe_layer: bool, load_imbalance: float = 1.0) -> float:
    """Bytes one block keeps on a rank for its backward, per token of the rank's micro-batch, after
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4:
    ``sbh(34 + 5as/h)`` bytes for a GPT block, ``/ t`` with tensor and sequence parallelism,
    ``sbh(10 + 24/t + 5as/ht)`` with tensor parallelism alone (the norms and the GEMMs' inputs outside
    the tp regions repeated on every tp rank). Generalised to flash attention (Q, K, V and its output
    kept, no ``as/h`` score terms), no dropout, grouped-query widths and gated FFNs, each kept tensor named:

    - attention: the norm's input and output (the QKV GEMM's input), then inside the tp region Q, K, V
      and the attention output (the output projection's input): ``D + D | q + kv + q`` values;
    - dense FFN: the norm's input and output | the first GEMM's outputs and the activation's output
      (the second GEMM's input): ``D + D | (mult - 1) F + F``;
    - MoE FFN: the norm's input and output (the router's input), shared experts as a dense FFN, and per
      routed copy (``top_k``, times the busiest rank's load) the permuted row, the first GEMM's outputs,
      the activation's output and the expert output the weighted combine keeps: ``D + (mult - 1) F + F
      + D`` (``F / etp``); without sequence parallelism every tp rank routes every token. With the gate
      weights applied in the activation (``weighted_activation``, Megatron-Core's experts'
      ``activation_func_with_probs``) the combine is a plain sum and keeps no expert output: ``- D``.

    GEMM inputs are kept at 1 byte under fp8 (Transformer Engine keeps the quantised input for the
    weight-gradient GEMM), the rest at ``dtype_bytes``. Recomputation as Megatron's modules: ``selective``
    (layernorm, moe_act) drops the norms' outputs and the experts' activation outputs, ``mla_up_proj``
    (multi-head latent attention only) Q, K and V, keeping the latents they are projected up from, whole
    on every tp rank (the down-projections are duplicated over tp): ``q + kv | latent``, ``experts``
    the routed experts' tensors but the permuted rows, ``full`` all but the block's input."""
    m, e, dt = spec.model, spec.moe, spec.workload.dtype_bytes
    D, a, tp = m.d_model, attention_dims(spec), cand.tp
    gin = 1 if cand.fp8 else dt  # bytes of a kept GEMM input
    rep = 1 / tp if cand.sp else 1.0  # the share of the tensors outside the tp regions a rank keeps
    if cand.recompute == "full":
        return dt * D * rep
    norms = dt * D + (0 if cand.recompute == "selective" else gin * D)  # a norm's input and output
    if cand.recompute == "mla_up_proj" and not a["latent"]:
        raise ValueError(f"recompute=mla_up_proj: model {spec.name} has no latent attention (shape.kv_lora_rank)")
    if cand.recompute == "mla_up_proj":
        attn = norms * rep + gin * a["q"] / tp + dt * a["latent"]
    else:
        attn = norms * rep + (gin * a["q"] + dt * (a["q"] + a["kv_act"])) / tp
    mult = 2 if (e.activation if moe_layer else m.mlp_activation) == "gelu" else 3
    ffn = (dt * (mult - 1) + gin) * (e.shared_hidden if moe_layer else m.d_ff) / tp
    if not moe_layer:
        return attn + norms * rep + ffn
    k, F = e.top_k * load_imbalance, e.d_ff / cand.etp
    kept_output = 0 if cand.weighted_activation else dt * D
    routed = {
        "none": gin * D + dt * (mult - 1) * F + gin * F + kept_output,
        "mla_up_proj": gin * D + dt * (mult - 1) * F + gin * F + kept_output,
        "selective": gin * D + dt * (mult - 1) * F + kept_output,
        "experts": gin * D,
    }[cand.recompute]
    return attn + (norms + k * routed) * rep + ffn


def in_flight(cand: Candidate) -> tuple[float, float]:
    """Micro-batches of its blocks the (first, last) pipeline rank holds at its peak under 1F1B: the
    first ``pp``, the last 1; interleaved, the first rank's ``2 (pp - 1) + (vp - 1) pp + 1`` warm-up
    chunks and the last's ``(vp - 1) pp + 1``, each ``1 / vp`` of the stage (Megatron-Core's schedule;
    Korthikanti et al. 2022, section 4.2.3: ``pp (1 + (pp - 1) / (pp vp))`` on the first). All-to-alls
    overlapped in both passes hold one chunk more on every rank: Megatron's combined 1F1B runs one extra
    warm-up forward so that each merged step's forward and backward are independent."""
    extra = 1 if cand.overlap == "both" else 0
    if cand.pp == 1:
        return (float(min(cand.micro, 1 + extra)),) * 2
    if cand.vp == 1:  # never with the both-pass overlap (check_both_pass_overlap)
        return float(min(cand.micro, cand.pp)), 1.0
    chunks = cand.micro * cand.vp
    first = min(chunks, 2 * (cand.pp - 1) + (cand.vp - 1) * cand.pp + 1 + extra)
    return first / cand.vp, min(chunks, (cand.vp - 1) * cand.pp + 1 + extra) / cand.vp


def memory_bytes(spec: ModelSpec, cand: Candidate, load_imbalance: float = 1.0) -> float:
    """Peak bytes per device, the larger of the first and the last pipeline rank's: training state,
    FSDP's two gathered blocks, the activations of the micro-batches in flight
    (``block_activation_bytes``, ``in_flight``) and, on the last rank, the fp32 logits the
    vocab-parallel cross-entropy keeps for its backward.

    Distributed optimizer (Megatron's, its documented ``6 + 12 / d`` bytes a parameter): bf16 weights
    (and under fp8 Transformer Engine's fp8 copy, cached across micro-batches and kept twice on Hopper:
    the weight and its transpose, which the backward's data-gradient GEMM needs) and the gradient buffer
    (``grad_bytes``) whole on each rank, fp32 master weights and Adam's moments over the data ranks; the
    first rank holds the embedding, the last the output head."""
    check_both_pass_overlap(cand)
    m, w = spec.model, spec.workload
    dense, experts = param_counts(spec)
    world = cand.dp * cand.cp * cand.tp * cand.pp
    if cand.grad_sync == "fsdp":
        state = dense * w.state_bytes / world + experts * w.state_bytes / (cand.pp * cand.dp * cand.cp * cand.etp)
        states = [state + 2 * dense / m.n_layers / cand.tp * w.dtype_bytes]  # the block running and the next
    else:
        embed = m.vocab_size * m.d_model
        head = 0 if m.tie_embeddings else embed
        body = (dense - embed - head) / cand.pp  # one stage's blocks, non-expert weights
        owned = [body + embed + head] if cand.pp == 1 else [body + embed, body + head]
        kept, sharded = w.dtype_bytes + w.grad_bytes + 2 * cand.fp8, w.state_bytes - 4
        edp = world // (cand.pp * cand.ep * cand.etp)
        routed = experts / (cand.ep * cand.etp * cand.pp) * (kept + sharded / edp)
        states = [p / cand.tp * (kept + sharded / (cand.dp * cand.cp)) + routed for p in owned]
    blocks, n_moe = stage_blocks(spec, cand)
    per_token = n_moe * block_activation_bytes(spec, cand, True, load_imbalance)
    per_token += (blocks - n_moe) * block_activation_bytes(spec, cand, False, load_imbalance)
    tokens = micro_tokens(spec, cand) / cand.cp
    first, last = in_flight(cand)
    logits = tokens * m.vocab_size * 4 / cand.tp
    peaks = [states[0] + per_token * tokens * first, states[-1] + per_token * tokens * last + logits]
    return max(peaks) if cand.pp > 1 else peaks[1]


def fsdp_collectives(spec: ModelSpec, cand: Candidate, c: Cluster) -> tuple[float, float]:
    """moekit's FSDP on one micro-batch of a pipeline stage: (alpha-beta seconds, number of collectives).

    Every micro-batch, each unit (a block, and the root) all-gathers its shard before the forward
    and again before the backward, then reduce-scatters its gradient; sharded experts do the same
    over the dp / ep ranks that hold the same experts, once per MoE layer even when overlapped
    dispatch computes them chunk by chunk."""
    m, w = spec.model, spec.workload
    dense_p, expert_p = param_counts(spec)
    n_moe = len(m.moe_layers())
    units = m.n_layers / cand.pp + 1
    seconds = count = 0.0
    if cand.dp > 1:
        unit_bytes = dense_p / (cand.tp * cand.pp) * w.dtype_bytes / units
        seconds += 3 * units * ring_time(unit_bytes, cand.dp, cand.tp, c, passes=1)
        count += 3 * units
    if n_moe and cand.dp > cand.ep:
        layer_bytes = expert_p / (cand.ep * n_moe) * w.dtype_bytes
        seconds += 3 * n_moe / cand.pp * ring_time(layer_bytes, cand.dp // cand.ep, cand.tp * cand.ep, c, passes=1)
        count += 3 * n_moe / cand.pp
    return seconds, count


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


def with_head(blocks_s: float, head_s: float, blocks: int, spec: ModelSpec, cand: Candidate) -> float:
    """The busiest rank's time for one micro-batch with the output head: the head on top of the blocks,
    except with interleaved stages, where the loss gets a chunk of its own and blocks move off the
    last rank (Megatron's ``pipeline_model_parallel_layout``, e.g. ``Et|(tt|)*30mL`` in Megatron-Bridge's
    DeepSeek-V3 H100 recipe, or ``account_for_loss_in_pipeline_split``). Blocks move whole: the last
    rank keeps the ``b`` blocks that best balance them and the head against the other ranks'
    ``ceil((N - b) / (pp - 1))``; never less than the rank's own blocks under even chunks."""
    if cand.pp == 1 or cand.vp == 1:
        return blocks_s + head_s
    n, block_s = _blocks(spec)[0], blocks_s / blocks
    balanced = min(max(math.ceil((n - b) / (cand.pp - 1)) * block_s, b * block_s + head_s) for b in range(n + 1))
    return max(blocks_s, balanced)


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


def check_both_pass_overlap(cand: Candidate) -> None:
    """Refuse what Megatron's ``overlap_moe_expert_parallel_comm`` (the both-pass overlap costed here)
    refuses: a pipeline without virtual stages, and full recomputation (its asserts in Megatron-Bridge's
    ``training/comm_overlap.py``: "virtual_pipeline_model_parallel_size must be specified when
    pipeline_model_parallel_size > 1", "disable full recomputation")."""
    if cand.overlap != "both":
        return
    if cand.pp > 1 and cand.vp == 1:
        raise ValueError(f"overlap=both: needs virtual pipeline stages (vp > 1) with pp={cand.pp}, got vp=1")
    if cand.recompute == "full":
        raise ValueError("overlap=both: not with recompute=full (choose selective recomputation or overlap=none)")


def paired_share(cand: Candidate) -> float:
    """The share of a rank's micro-batch chunks whose forward runs beside another one's backward, which
    is what hides all-to-alls overlapped in both passes (Megatron's ``overlap_moe_expert_parallel_comm``
    merges a forward and a backward chunk of 1F1B's steady state; DeepSeek-V3's DualPipe pairs them the
    same way): all but the first rank's warm-up chunks, which run alone, as do as many cool-down ones:
    ``2 (pp - 1) + (vp - 1) pp`` interleaved, 1 without a pipeline (``check_both_pass_overlap``: never
    plain 1F1B)."""
    check_both_pass_overlap(cand)
    chunks = cand.micro * cand.vp
    warm = 1 if cand.pp == 1 else 2 * (cand.pp - 1) + (cand.vp - 1) * cand.pp
    return max(0, chunks - warm) / chunks


def elementwise_bytes(spec: ModelSpec, cand: Candidate, tokens: float, load_imbalance: float = 1.0) -> float:
    """Bytes of the elementwise work between one micro-batch's GEMMs on a rank, each tensor counted once
    read or written, forward then backward (twice the forward's) and a recomputed forward again: per block
    the norms and residuals ``8 D`` a row; a dense FFN's or the shared experts' activation ``mult F / tp``
    a token (SwiGLU reads 2 F and writes F, GELU reads and writes F); per routed copy its permute in and
    out and the weighted combine ``4 D``. Not the routed experts' activation: their measured rate
    (``expert_efficiency``, the whole expert FFN) includes it. Selective recomputation (Megatron's
    ``layernorm`` and ``moe_act``) runs the two norms again, ``4 D`` a row, and each routed copy's
    activation, ``mult F / etp``."""
    m, e = spec.model, spec.moe
    D, tp = m.d_model, cand.tp
    rows = tokens / (tp if cand.sp else 1)
    blocks, n_moe = stage_blocks(spec, cand)
    extra_dense, extra_experts = RECOMPUTE_GEMMS[cand.recompute]
    dense = blocks * rows * 8 * D + (blocks - n_moe) * tokens * _mult(m.mlp_activation) * m.d_ff / tp
    dense += n_moe * tokens * _mult(e.activation) * e.shared_hidden / tp
    copies = n_moe * rows * e.top_k * load_imbalance
    redone = 0.0
    if cand.recompute == "selective":
        redone = blocks * rows * 4 * D + copies * _mult(e.activation) * e.d_ff / cand.etp
    return spec.workload.dtype_bytes * ((3 + extra_dense) * dense + (3 + extra_experts) * copies * 4 * D + redone)


def fp8_cast_values(spec: ModelSpec, cand: Candidate, tokens: float, load_imbalance: float = 1.0) -> float:
    """Values one micro-batch casts into fp8 on a rank (``tokens`` its attention tokens; rows, the tokens
    over sp, enter the MoE layer), in Transformer Engine's fp8 training: each GEMM's input in the forward,
    except a fused norm's output (LayerNormLinear writes it cast), each GEMM's output gradient in the
    backward; a recomputed forward casts again. A block's:

    - attention: the output projection's input ``v / tp`` | the QKV GEMMs' output gradients ``(q + kv) /
      tp`` and the output projection's ``D`` (NOTE: MLA's down- and up-projections counted as these widths);
    - a dense FFN of width ``F``: the second GEMM's input ``F / tp`` | the first GEMM's output gradient
      ``(mult - 1) F / tp`` and the second's ``D``; shared experts the same, and their input ``D`` (the
      MoE layer's norm is not fused into them);
    - each routed copy: the permuted row ``D`` and the second GEMM's input ``F`` | the output gradients
      ``(mult - 1) F`` and ``D``; with expert tp, gathered rows: ``etp D`` and ``F`` a rank.

    D-wide tensors are split over tp with sequence parallelism (``rows``), tp-split ones are not."""
    m, e = spec.model, spec.moe
    D, a, tp, etp = m.d_model, attention_dims(spec), cand.tp, cand.etp
    rows = tokens / (tp if cand.sp else 1)
    blocks, n_moe = stage_blocks(spec, cand)
    extra_dense, extra_experts = RECOMPUTE_GEMMS[cand.recompute]

    def ffn(width: float, activation: str, own_input: float) -> tuple[float, float]:  # (forward, backward)
        if not width:
            return 0.0, 0.0
        return own_input + tokens * width / tp, tokens * (_mult(activation) - 1) * width / tp + rows * D

    attention = tokens * a["v"] / tp, tokens * (a["q"] + a["kv_act"]) / tp + rows * D
    dense, shared = ffn(m.d_ff, m.mlp_activation, 0.0), ffn(e.shared_hidden, e.activation, rows * D)
    copies = rows * e.top_k * load_imbalance
    routed = copies * (etp * D + e.d_ff), copies * ((_mult(e.activation) - 1) * e.d_ff + etp * D)
    per_pass = [(attention, blocks), (dense, blocks - n_moe), (shared, n_moe)]
    values = sum(n * ((1 + extra_dense) * fwd + bwd) for (fwd, bwd), n in per_pass)
    return values + n_moe * ((1 + extra_experts) * routed[0] + routed[1])


def estimate(spec: ModelSpec, cand: Candidate, c: Cluster, load_imbalance: float = 1.0) -> Estimate:
    """Predicted step time and memory of one layout; ``load_imbalance`` is the max/mean rank load of
    the experts (1.0 balanced), which slows the busiest rank's GEMMs and exchanges."""
    m, e, w = spec.model, spec.moe, spec.workload
    D, dt = m.d_model, w.dtype_bytes
    blocks, n_moe = stage_blocks(spec, cand)
    tokens = micro_tokens(spec, cand) / cand.cp  # a rank's tokens in attention
    sp = cand.tp if cand.sp else 1
    rows = tokens / sp  # a rank's tokens entering the MoE layer (tp ranks repeat them without sp)
    moe_f, dense_f = layer_flops(spec, True), layer_flops(spec, False)
    extra_dense, extra_experts = RECOMPUTE_GEMMS[cand.recompute]
    fp8 = c.fp8_speedup if cand.fp8 else 1.0
    gemm_rate = c.flops * fp8
    attention_rate = c.peak_tflops * 1e12 * (c.attention_efficiency or c.efficiency)
    # Forward FLOPs of one micro-batch on the busiest rank.
    attn = tokens * blocks * moe_f["attention"] / cand.tp
    redone = tokens * blocks * 2 * attention_dims(spec)["up"] / cand.tp if cand.recompute == "mla_up_proj" else 0.0
    core = tokens * blocks * moe_f["core"] / cand.tp
    dense = tokens * (n_moe * moe_f["dense"] + (blocks - n_moe) * dense_f["dense"]) / cand.tp
    experts = rows * n_moe * moe_f["experts"] * load_imbalance
    head = tokens * 2 * D * m.vocab_size * (1 + spec.shape.mtp_layers) / cand.tp
    # NOTE: the dense GEMMs (a whole micro-batch's rows, thousands, against d_model-wide weights) run at the
    # large-GEMM rate; only the per-expert GEMMs (a few hundred rows each) are small enough to slow down.
    dense_rate = gemm_rate
    per_expert = rows * cand.ep * e.top_k / e.num_experts  # rows of each local expert
    work = e.num_experts / cand.ep * per_expert * D * e.d_ff / cand.etp  # one grouped GEMM's multiply-adds
    expert_peak = c.peak_tflops * 1e12 * (c.expert_efficiency or c.efficiency) * fp8
    expert_rate = expert_peak * _size_factor(per_expert, work, c)
    expert_s = (3 + extra_experts) * experts / expert_rate
    terms = {
        "gemm": ((3 + extra_dense) * (attn + dense) + redone) / dense_rate,
        "gemm_experts": expert_s,
        "attention": (3 + extra_dense) * core / attention_rate,
        "overhead": blocks * c.pass_overhead_us * 1e-6,
    }
    if c.hbm_gbps:  # elementwise work, and under fp8 the casts, both at the rate eager kernels reach
        elementwise = elementwise_bytes(spec, cand, tokens, load_imbalance)
        if cand.fp8:
            elementwise += FP8_CAST_BYTES * fp8_cast_values(spec, cand, tokens, load_imbalance)
        terms["elementwise"] = elementwise / (c.hbm_gbps * 1e9)
    blocks_s = sum(terms.values())
    compute_s = with_head(blocks_s, 3 * head / c.flops, blocks, spec, cand)
    terms["head"] = compute_s - blocks_s

    # Expert-parallel exchanges: dispatch and combine in the forward and again in the backward.
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
        fwd_s = expert_s / (3 + extra_experts)
        hidden = {"a2a": c.overlap * min(forward, fwd_s) * (1 - 1 / chunks)}
        a2a = passes * forward - hidden["a2a"]
        a2a += (chunks - 1) * n_moe * c.chunk_overhead_us * 1e-6
    else:
        a2a, hidden = passes * forward, {}
        if cand.overlap == "both":  # one micro-batch's exchanges beside another's compute, both passes
            hidden["a2a"] = paired_share(cand) * _hidden(a2a, compute_s, c)
            a2a -= hidden["a2a"]

    terms["a2a"] = a2a
    exchanges = {}
    if cand.tp > 1:  # 2 all-reduces (or all-gather + reduce-scatter) a block each pass, on the critical path
        # NOTE: exposed: Megatron hides them only with its userbuffer tp_comm_overlap, which the published
        # DGX-H100 MoE recipes leave off (Megatron-Bridge's Qwen3-235B-A22B H100 config).
        exchanges["tp"] = 2 * passes * blocks * ring_time(tokens * D * dt, cand.tp, 1, c)
    if cand.cp > 1:  # ring attention: K, V round the ring in the forward, K, V and their grads back
        kv = tokens * attention_dims(spec)["kv_act"] / cand.tp * dt
        cp_s = (1 + extra_dense + 2) * blocks * (cand.cp - 1) * p2p_time(kv, cand.tp, c, cand.cp)
        hidden["cp"] = _hidden(cp_s, (3 + extra_dense) * core / attention_rate, c)
        exchanges["cp"] = cp_s - hidden["cp"]
    if cand.pp > 1:  # activations to the next stage, gradients back, once per virtual stage
        pp_s = 2 * cand.vp * p2p_time(tokens * D * dt / sp, cand.tp * cand.cp * cand.dp, c, cand.pp)
        # NOTE: interleaved schedules post each send on its own stream and wait for it only before the chunk
        # that needs it, one chunk's compute later (Megatron's overlap_p2p_comm, for interleaved schedules
        # only): nothing depends on it meanwhile, so only what outlasts that compute shows. Plain 1F1B
        # waits for each send.
        exchanges["pp"] = max(0.0, pp_s - compute_s) if cand.vp > 1 else pp_s
        hidden["pp"] = pp_s - exchanges["pp"]
    if cand.grad_sync == "fsdp":
        wire, collectives = fsdp_collectives(spec, cand, c)
        exchanges["fsdp"] = wire + collectives * c.fsdp_overhead_us * 1e-6
    terms.update(exchanges)
    sync = sum(exchanges.values())
    slots = cand.micro + (cand.pp - 1) / cand.vp
    step_terms = {name: cand.micro * t for name, t in terms.items()}
    step_terms["bubble"] = (slots - cand.micro) * (compute_s + a2a + sync)
    step_sync = 0.0
    step_hidden = {name: cand.micro * t for name, t in hidden.items()}
    if cand.grad_sync == "overlapped":  # beside the first micro-batch's forward and the last one's backward
        grads = gradient_sync_time(spec, cand, c)
        step_hidden["grads"] = _hidden(grads, compute_s + a2a, c)
        step_sync = grads - step_hidden["grads"]
        step_terms["grads"] = step_sync
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
