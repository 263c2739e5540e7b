"""What a layout is and what its pipeline schedule implies: the ``Candidate`` the planner costs, the blocks
and tokens of the busiest rank's micro-batch, the micro-batches in flight at the peak, and which
micro-batches run beside another one (what the both-pass all-to-all overlap needs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.parallel.planner.flops import _blocks
from moekit.parallel.planner.presets import ModelSpec


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
