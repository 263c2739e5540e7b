"""FLOPs and parameters of a model, per token: what the cost model computes and what published
tables count as "model FLOPs".

Two counts. ``layer_flops`` is the work a rank does (router included), split by where it runs.
``model_flops_per_token`` is Megatron's count, which NeMo Megatron-Bridge's and Megatron-Core's
"model TFLOP/s/GPU" divide by the step time: 3 x the forward GEMMs (6 x active weights: attention
projections, dense FFNs, the k routed and the shared experts' FFNs, the output head; no router, no
embedding lookup, no norms) plus causal attention scores (2 x query width x s/2 average context for
QK^T and as much for AV, forward), the MTP blocks as extra blocks with their own head.
"""

from __future__ import annotations

from moekit.parallel.planner.presets import ModelSpec


def _mult(activation: str) -> int:
    """Weight matrices of one FFN: (clamped) SwiGLU has gate, up and down; GELU up and down."""
    return 2 if activation == "gelu" else 3


def attention_dims(spec: ModelSpec) -> dict[str, int]:
    """Widths of one block's attention: ``q`` query width, ``kv`` the K and V widths a token caches
    (MLA: the compressed latent and the rotary key), ``qk`` and ``v`` the widths the scores and values
    are computed over, ``kv_act`` the K and V widths attention keeps for its backward, ``weights`` the
    projection parameters; MLA only (0 otherwise): ``latent`` the widths Q, K and V are projected up
    from (query and KV latents, rotary key), ``up`` the up-projection parameters."""
    m, s = spec.model, spec.shape
    D, heads = m.d_model, s.heads or m.n_heads
    if s.kv_lora_rank:  # MLA (DeepSeek-V2/V3)
        nope = s.head_dim or m.head_size
        qk = heads * (nope + s.qk_rope_dim)
        q_in = s.q_lora_rank * (D + qk) if s.q_lora_rank else D * qk
        kv_in = s.kv_lora_rank * (D + heads * (nope + s.v_head_dim)) + D * s.qk_rope_dim
        weights = q_in + kv_in + heads * s.v_head_dim * D
        v = heads * s.v_head_dim
        latent = s.q_lora_rank + s.kv_lora_rank + s.qk_rope_dim
        up = s.q_lora_rank * qk + s.kv_lora_rank * heads * (nope + s.v_head_dim)
        return {
            "q": qk, "kv": s.kv_lora_rank + s.qk_rope_dim, "qk": qk, "v": v, "kv_act": qk + v, "weights": weights,
            "latent": latent, "up": up,
        }  # fmt: skip
    hd = s.head_dim or m.head_size
    kv = (s.kv_heads or m.kv_heads) * hd
    q = heads * hd
    weights = D * (q + 2 * kv) + q * D
    return {"q": q, "kv": 2 * kv, "qk": q, "v": q, "kv_act": 2 * kv, "weights": weights, "latent": 0, "up": 0}


def attention_context(spec: ModelSpec, causal: bool = True, windowed: bool = True) -> float:
    """Average keys a query attends to over the blocks: s/2 causal (s when not), a window W's
    W - W(W-1)/2s for the windowed blocks (``windowed`` False counts them as full)."""
    s, shape = spec.seq_len, spec.shape
    full = s / 2 if causal else float(s)
    if not windowed or not shape.window or shape.window >= s:
        return full
    windowed = shape.window - shape.window * (shape.window - 1) / (2 * s)
    n = spec.model.n_layers
    return (full * (n - shape.window_layers) + windowed * shape.window_layers) / n


def layer_flops(spec: ModelSpec, moe_layer: bool) -> dict[str, float]:
    """Forward FLOPs per token of one block: attention projections, attention scores (``core``,
    causal), dense MLP or the MoE layer's router and shared experts, routed experts (k of them)."""
    m, e = spec.model, spec.moe
    D, a = m.d_model, attention_dims(spec)
    attn, core = 2 * a["weights"], 2 * (a["qk"] + a["v"]) * attention_context(spec)
    if not moe_layer:
        return {"attention": attn, "core": core, "dense": 2 * _mult(m.mlp_activation) * D * m.d_ff, "experts": 0.0}
    ffn = 2 * _mult(e.activation) * D * e.d_ff
    shared = 2 * _mult(e.activation) * D * e.shared_hidden
    return {"attention": attn, "core": core, "dense": 2 * D * e.num_experts + shared, "experts": e.top_k * ffn}


def _blocks(spec: ModelSpec) -> tuple[int, int]:
    """(blocks, MoE blocks), the MTP blocks counted as MoE blocks (DeepSeek-V3's are)."""
    m, mtp = spec.model, spec.shape.mtp_layers
    return m.n_layers + mtp, len(m.moe_layers()) + (mtp if m.moe_layers() else 0)


def param_counts(spec: ModelSpec) -> tuple[float, float]:
    """(non-expert parameters, routed-expert parameters) of the whole model."""
    m, e = spec.model, spec.moe
    D = m.d_model
    n_blocks, n_moe = _blocks(spec)
    attn = attention_dims(spec)["weights"] + 2 * D + spec.shape.q_lora_rank + spec.shape.kv_lora_rank
    ffn = _mult(e.activation) * D * e.d_ff
    shared = _mult(e.activation) * D * e.shared_hidden
    dense = n_moe * (D * e.num_experts + shared) + (n_blocks - n_moe) * _mult(m.mlp_activation) * D * m.d_ff
    embed = m.vocab_size * D * (1 if m.tie_embeddings else 2)
    mtp = spec.shape.mtp_layers * (2 * D * D + 2 * D)  # each MTP block's input projection and norms
    return n_blocks * attn + dense + embed + D + mtp, n_moe * e.num_experts * ffn  # + D: the final norm


def training_flops_per_token(spec: ModelSpec) -> tuple[float, float]:
    """(FLOPs outside the routed experts, FLOPs of the routed experts) per token of one training
    step of the whole model: 3x the forward (the backward is two GEMMs per forward GEMM), the output
    head included."""
    n_blocks, n_moe = _blocks(spec)
    moe, dense = layer_flops(spec, True), layer_flops(spec, False)
    per = [moe] * n_moe + [dense] * (n_blocks - n_moe)
    head = 2 * spec.model.d_model * spec.model.vocab_size * (1 + spec.shape.mtp_layers)
    rest = sum(f["attention"] + f["core"] + f["dense"] for f in per) + head
    return 3 * rest, 3 * sum(f["experts"] for f in per)


def model_flops_per_token(spec: ModelSpec, causal: bool = True, windowed: bool = True, gated: bool = True) -> float:
    """Megatron's model FLOPs per token of one training step (see the module docstring). Older
    counts differ, and a published figure is only comparable under its own: ``causal`` False counts
    the scores over the whole sequence (Megatron-Core up to v0.9), ``windowed`` False counts windowed
    blocks as full and ``gated`` False counts two matrices per gated FFN (Megatron-Bridge 25.11 for a
    GLU whose activation is not SiLU, as gpt-oss's)."""
    m, e = spec.model, spec.moe
    D, a = m.d_model, attention_dims(spec)
    n_blocks, n_moe = _blocks(spec)
    core = (a["qk"] + a["v"]) * attention_context(spec, causal, windowed)
    mults = (_mult(e.activation), _mult(m.mlp_activation)) if gated else (2, 2)
    ffn = D * mults[0] * (e.top_k * e.d_ff + e.shared_hidden)
    mlp = n_moe * ffn + (n_blocks - n_moe) * D * mults[1] * m.d_ff
    mtp = spec.shape.mtp_layers * 2 * D * D
    head = D * m.vocab_size * (1 + spec.shape.mtp_layers)
    return 6 * (n_blocks * (a["weights"] + core) + mlp + mtp + head)
