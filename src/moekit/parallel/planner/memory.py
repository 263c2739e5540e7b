"""Peak memory per device of a layout: training state, gathered FSDP blocks, the activations of the
micro-batches in flight and the last rank's logits."""

from __future__ import annotations

from moekit.parallel.planner.flops import attention_dims, param_counts
from moekit.parallel.planner.fsdp import fsdp_state_bytes
from moekit.parallel.planner.layout import Candidate, check_both_pass_overlap, in_flight, micro_tokens, stage_blocks
from moekit.parallel.planner.presets import ModelSpec

MEMORY_USABLE = 0.9  # NOTE: workspace, fragmentation and the allocator's caches take the rest


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


def memory_bytes(spec: ModelSpec, cand: Candidate, load_imbalance: float = 1.0) -> float:
    """Peak bytes per device, the larger of the first and the last pipeline rank's: training state
    (under FSDP ``fsdp_state_bytes``: sharded, with its gathered blocks and root), the activations of the
    micro-batches in flight (``block_activation_bytes``, ``in_flight``) and, on the last rank, the fp32 logits the
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
        states = fsdp_state_bytes(spec, cand)
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
