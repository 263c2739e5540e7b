"""The work between a micro-batch's GEMMs that the cost model charges at the elementwise rate: the bytes of
norms, residuals, activations, permutes and combines, and under fp8 the values cast."""

from __future__ import annotations

from moekit.parallel.planner.flops import _mult, attention_dims
from moekit.parallel.planner.layout import RECOMPUTE_GEMMS, Candidate, stage_blocks
from moekit.parallel.planner.presets import ModelSpec

# Bytes a value costs to cast into fp8 (``fp8_cast_values``): 2 read, 1 written and 1 for its transpose,
# which the other GEMM of the backward reads (Transformer Engine on Hopper).
FP8_CAST_BYTES = 4


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
