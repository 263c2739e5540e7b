"""The transformer's config: its shape, attention, norms, RoPE and which blocks are MoE (``[model]`` of a run;
the MoE layer itself is ``[moe]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.config.fields import (
    NONNEGATIVE,
    NONNEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    Check,
    check_fields,
    choice,
    option,
    require,
)

MLP_ACTIVATIONS = ("swiglu", "gelu")
ROPE_SCALINGS = ("none", "yarn")
ROPE_BASE = Check(lambda v: math.isfinite(v) and v > 1, "must be a finite number > 1")  # theta^(-2j/d) must fall
NORMS = ("rmsnorm", "layernorm")
ATTENTIONS = ("mha", "mla")


@dataclass
class ModelConfig:
    """A decoder-only transformer; which of its layers are MoE is decided here, the MoE itself in [moe]."""

    vocab_size: int = option(256, "token ids the model embeds; set from the tokenizer when training", POSITIVE_INT)
    context_length: int = option(256, "longest sequence the model attends over", POSITIVE_INT)
    n_layers: int = option(4, "transformer blocks", POSITIVE_INT)
    n_heads: int = option(4, "attention query heads", POSITIVE_INT)
    n_kv_heads: int | None = option(
        None, "key/value heads (fewer than n_heads: grouped-query attention); None = n_heads"
    )
    head_dim: int | None = option(
        None, "width of each attention head; None = d_model / n_heads (Qwen3, gpt-oss set theirs)", POSITIVE_INT
    )
    d_model: int = option(256, "residual stream width", POSITIVE_INT)
    d_ff: int = option(768, "hidden width of dense MLPs (and of each expert unless moe.d_ff is set)", POSITIVE_INT)
    mlp_activation: str = option("swiglu", "dense MLP: swiglu or gelu", choice(*MLP_ACTIVATIONS))
    norm: str = option("rmsnorm", "rmsnorm (Llama, Mixtral) or layernorm without bias (GPT-2, nanoGPT)", choice(*NORMS))
    dropout: float = option(0.0, "dropout on attention and residual branches while training")
    tie_embeddings: bool = option(True, "share the input embedding with the output projection")
    rope_theta: float = option(10000.0, "RoPE base frequency", ROPE_BASE)
    attention: str = option(
        "mha",
        "mha (multi-head, grouped-query with n_kv_heads) | mla (DeepSeek's latent attention)",
        choice(*ATTENTIONS),
    )
    q_lora_rank: int = option(
        0, "mla: rank of the compressed query; 0 = a full-rank query projection (DeepSeek-V2-Lite)"
    )
    kv_lora_rank: int | None = option(
        None, "mla: width of the cached key/value latent per token; None = 4 * d_model / n_heads"
    )
    qk_nope_head_dim: int | None = option(None, "mla: per-head query/key dims without RoPE; None = d_model / n_heads")
    qk_rope_head_dim: int | None = option(
        None, "mla: per-head dims with RoPE (one key part shared by all heads); None = half"
    )
    v_head_dim: int | None = option(None, "mla: per-head value width; None = d_model / n_heads")
    norm_eps: float | None = option(
        None, "epsilon of every norm; None: torch's default (imported checkpoints set theirs)", POSITIVE
    )
    qkv_bias: bool = option(False, "biases on the query, key and value projections (Qwen2)")
    qk_norm: bool = option(False, "RMSNorm over the whole query and key projections before RoPE (OLMoE)")
    qk_head_norm: bool = option(
        False, "RMSNorm over each query and key head (one weight of head_dim) before RoPE (Qwen3)"
    )
    attn_out_bias: bool = option(False, "a bias on the attention output projection (gpt-oss)")
    attn_sinks: bool = option(
        False, "a learned logit per head in each softmax denominator: may attend to nothing (gpt-oss)"
    )
    sliding_window: int = option(
        0, ">0: windowed blocks attend to this many most recent tokens (their own included)", NONNEGATIVE_INT
    )
    full_attention_every: int = option(
        0, "with sliding_window: blocks n-1, 2n-1, ... attend to all tokens; 0 = none", NONNEGATIVE_INT
    )
    rope_scaling: str = option(
        "none", "none | yarn (NTK-by-parts frequencies and attention scale, Peng et al. 2023)", choice(*ROPE_SCALINGS)
    )
    rope_factor: float = option(1.0, "yarn: context extension factor")
    rope_original_context: int = option(0, "yarn: context length the RoPE frequencies were trained at")
    rope_beta_fast: float = option(32.0, "yarn: rotations above which a frequency is kept (extrapolated)")
    rope_beta_slow: float = option(1.0, "yarn: rotations below which a frequency is divided by rope_factor")
    rope_truncate: bool = option(True, "yarn: round the ramp's ends to whole dimensions")
    rope_attention_factor: float | None = option(None, "yarn: scale on cos/sin; None = from the two mscales below")
    rope_mscale: float = option(1.0, "yarn: strength of the ln(factor) gain on the rotated query/key dims (DeepSeek)")
    rope_mscale_all_dim: float = option(
        0.0, "yarn, mla: >0 moves this much of that gain onto the softmax scale (DeepSeek)"
    )
    init_std: float = option(
        0.02, "std of weight init; residual output projections get 1/sqrt(2*n_layers) of it", POSITIVE
    )
    moe_every: int = option(1, "every n-th block (after first_dense_layers) is MoE; 0 = a dense model", NONNEGATIVE)
    first_dense_layers: int = option(0, "leading blocks kept dense (DeepSeek-MoE)", NONNEGATIVE)
    experts_per_layer: list[int] | None = option(
        None, "pyramid MoE: experts of each MoE block, overrides moe.num_experts"
    )

    def __post_init__(self) -> None:
        check_fields(self, "model.")
        if self.attention != "mla":  # MLA's head widths are its own fields
            if self.head_dim is None:
                ok = self.d_model % self.n_heads == 0
                require(
                    ok, "model.n_heads", self.n_heads, f"must divide d_model={self.d_model} (or set model.head_dim)"
                )
            require(self.head_size % 2 == 0, "model.head_dim", self.head_size, "head size must be even (RoPE)")
        require(not (self.qk_norm and self.qk_head_norm), "model.qk_head_norm", True, "excludes model.qk_norm")
        kv = self.kv_heads
        require(kv > 0 and self.n_heads % kv == 0, "model.n_kv_heads", self.n_kv_heads, "must divide n_heads")
        self._check_mla()
        self._check_yarn()
        require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")
        if self.experts_per_layer is not None:
            n_moe = len(self.moe_layers())
            require(
                len(self.experts_per_layer) == n_moe,
                "model.experts_per_layer",
                self.experts_per_layer,
                f"needs one entry per MoE block ({n_moe})",
            )

    _MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    def _check_mla(self) -> None:
        """Fill the MLA widths left unset (DeepSeek-V2's proportions) and check them."""
        head = max(2, self.d_model // self.n_heads // 2 * 2)
        if self.attention != "mla":
            for name in (*self._MLA_DIMS, "q_lora_rank"):
                unset = getattr(self, name) in (None, 0)
                require(unset, f"model.{name}", getattr(self, name), "needs model.attention = mla")
            return
        defaults = dict(kv_lora_rank=4 * head, qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head)
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"model.{name}", value, "must be a positive integer")
        rope = self.qk_rope_head_dim
        require(rope % 2 == 0, "model.qk_rope_head_dim", rope, "must be even (RoPE rotates pairs)")
        require(self.q_lora_rank >= 0, "model.q_lora_rank", self.q_lora_rank, "must be >= 0")
        require(self.n_kv_heads in (None, self.n_heads), "model.n_kv_heads", self.n_kv_heads, "mla has no kv heads")
        require(not self.qkv_bias, "model.qkv_bias", True, "mla has no fused q/k/v projection")
        require(not self.qk_norm, "model.qk_norm", True, "mla normalises its latents instead")
        require(not self.qk_head_norm, "model.qk_head_norm", True, "mla normalises its latents instead")
        require(self.head_dim is None, "model.head_dim", self.head_dim, "mla sets qk_nope/qk_rope/v_head_dim")
        for name in ("attn_out_bias", "attn_sinks", "sliding_window"):
            require(not getattr(self, name), f"model.{name}", getattr(self, name), "not supported with mla")

    def _check_yarn(self) -> None:
        if self.rope_scaling == "yarn":
            require(self.rope_factor >= 1, "model.rope_factor", self.rope_factor, "must be >= 1")
            ok = self.rope_original_context > 0
            require(ok, "model.rope_original_context", self.rope_original_context, "yarn needs it > 0")
        if self.rope_mscale_all_dim:
            require(
                self.attention == "mla",
                "model.rope_mscale_all_dim",
                self.rope_mscale_all_dim,
                "moves YaRN's gain onto MLA's softmax scale: needs model.attention = mla",
            )

    @property
    def rope_dim(self) -> int:
        """Dims of each query/key head that RoPE rotates."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def window(self, layer: int) -> int:
        """Keys block ``layer`` attends over: the sliding window, or 0 for all of them."""
        if not self.sliding_window or (self.full_attention_every and (layer + 1) % self.full_attention_every == 0):
            return 0
        return self.sliding_window

    def moe_layers(self) -> list[int]:
        """Indices of the blocks whose FFN is an MoE layer."""
        if self.moe_every == 0:
            return []
        return [
            i
            for i in range(self.first_dense_layers, self.n_layers)
            if (i - self.first_dense_layers) % self.moe_every == 0
        ]
