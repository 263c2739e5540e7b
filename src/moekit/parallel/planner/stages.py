"""What the pipeline's depth and micro-batch count cost beyond the busiest stage's blocks: the first and
last stages' own work (the embedding's gradient, the output head and its loss) that makes them the
busiest, the sends on the warm-up's and cool-down's critical path, and the schedule's fixed cost a chunk.

The bubble itself is ``(pp - 1) / vp`` slots of a micro-batch (``estimate``): ``(pp - 1) / (vp m)`` of
the ``m`` micro-batches' time, Megatron's interleaved 1F1B's.

NOTE: derived, not measured (``benchmarks/device_rates.py`` does not time them): ``EMBEDDING_GRAD_BYTES``
and ``LOSS_BYTES`` count the bytes of eager kernels, and the DGX-H100 preset's ``stage_pass_us``.
"""

from __future__ import annotations

import math

from moekit.parallel.planner.comm import p2p_time
from moekit.parallel.planner.flops import _blocks
from moekit.parallel.planner.layout import Candidate
from moekit.parallel.planner.presets import Cluster, ModelSpec

# Bytes an embedding-table entry costs every micro-batch on the first stage: the backward writes a dense
# bf16 gradient of the whole (vocabulary-parallel) table and reads it back (2 + 2), then adds it to the
# fp32 gradient buffer (read 4, write 4).
EMBEDDING_GRAD_BYTES = 12
# Bytes a logit costs in the vocabulary-parallel cross-entropy, as an unfused kernel moves them: its bf16
# logit read (2) and gradient written (2), and about eight fp32 passes over the logits (the cast, the max,
# the shift, the exponentials and their sum, the backward's softmax): 2 + 2 + 8 x 4. An estimate, not a
# measurement: counting every pass apart gives 40, a fused cross-entropy (Megatron's
# cross_entropy_loss_fusion) about 4-8; docs/planner.md shows the published rows at each.
LOSS_BYTES = 36


def embedding_seconds(spec: ModelSpec, cand: Candidate, c: Cluster) -> float:
    """One micro-batch's embedding gradient on the first stage (its table's ``vocab / tp`` rows), at the
    elementwise rate; 0 without one (``hbm_gbps`` 0)."""
    if not c.hbm_gbps:
        return 0.0
    m = spec.model
    return m.vocab_size * m.d_model / cand.tp * EMBEDDING_GRAD_BYTES / (c.hbm_gbps * 1e9)


def loss_seconds(spec: ModelSpec, cand: Candidate, c: Cluster, tokens: float) -> float:
    """One micro-batch's cross-entropy over its ``tokens`` (each head's: MTP's too) on the last stage."""
    if not c.hbm_gbps:
        return 0.0
    logits = tokens * spec.model.vocab_size / cand.tp * (1 + spec.shape.mtp_layers)
    return logits * LOSS_BYTES / (c.hbm_gbps * 1e9)


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


def busiest_stage(
    blocks_s: float, ends: dict[str, float], blocks: int, spec: ModelSpec, cand: Candidate
) -> tuple[float, dict[str, float]]:
    """One micro-batch on the busiest rank and what its stage's own work adds, by name: ``ends`` holds the
    ``head`` and ``loss`` seconds (the last stage's) and the ``embedding``'s (the first's). Without a
    pipeline one rank does all three. Otherwise the last rank (``with_head``: with interleaved stages
    its blocks make room for the head and loss) or the first, whichever is slower; the other's work is
    off the critical path."""
    last = ends["head"] + ends["loss"]
    if cand.pp == 1:
        return blocks_s + last + ends["embedding"], dict(ends)
    last_s = with_head(blocks_s, last, blocks, spec, cand)
    first_s = blocks_s + ends["embedding"]
    if first_s > last_s:
        return first_s, {"head": 0.0, "loss": 0.0, "embedding": ends["embedding"]}
    added = last_s - blocks_s
    share = added / last if last else 0.0
    return last_s, {"head": ends["head"] * share, "loss": ends["loss"] * share, "embedding": 0.0}


def pipeline_fixed(spec: ModelSpec, cand: Candidate, c: Cluster, send_bytes: float) -> tuple[float, float]:
    """(seconds a micro-batch, seconds a step) the pipeline adds by its depth: ``stage_pass_us`` for each
    chunk's forward and backward on the rank (the schedule's own work between chunks: its send and
    receive posted and waited for, the chunk's first launches), and with interleaved stages, whose
    steady-state sends hide behind the next chunk, the ``2 (pp - 1)`` sends of ``send_bytes`` on the
    warm-up's and cool-down's critical path (plain 1F1B waits for every send: in its bubble already)."""
    if cand.pp == 1:
        return 0.0, 0.0
    per_micro = 2 * cand.vp * c.stage_pass_us * 1e-6
    fill = 0.0
    if cand.vp > 1:
        fill = 2 * (cand.pp - 1) * p2p_time(send_bytes, cand.tp * cand.cp * cand.dp, c, cand.pp)
    return per_micro, fill
