"""Configuration dataclasses: one per component, each field with a one-line reason.

Validation happens in ``__post_init__`` so a bad value fails with a ``ValueError`` that names the
field, before any tensor is built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ROUTERS = ("topk", "switch", "gshard", "noisy_topk", "expert_choice", "hash")
TOKEN_CHOICE_ROUTERS = ("topk", "switch", "gshard", "noisy_topk")  # learned, k experts per token
SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")
ACTIVATIONS = ("swiglu", "gelu", "clamped_swiglu")
GEMM_BACKENDS = ("auto", "grouped_mm", "per_expert_mm")


def _require(ok: bool, field: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r}: {why}")


def _one_of(field: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, field, value, f"must be one of {', '.join(choices)}")


def _finite(config: object, prefix: str) -> None:
    """Every float field a finite number: an inf or nan rate, scale or limit would only show as a NaN later."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float):
            _require(math.isfinite(value), prefix + f.name, value, "must be a finite number")


@dataclass
class MoEConfig:
    """One mixture-of-experts layer: router, dispatch and experts."""

    d_model: int  # width of the tokens entering and leaving the layer
    d_ff: int  # hidden width of each routed expert's FFN
    num_experts: int = 8  # routed experts in the layer
    top_k: int = 2  # experts each token picks (for expert_choice: average picks per token)
    router: str = "topk"  # topk | switch (top-1) | gshard (top-2) | noisy_topk | expert_choice | hash
    score_func: str = "softmax"  # softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3) router scores
    softmax_before_topk: bool = True  # softmax over all experts, then pick; False: over the k picked
    normalize_topk: bool = True  # rescale the k picked weights to sum to 1
    route_scale: float = 1.0  # multiplier on the combine weights (DeepSeek-V3's routed scaling)
    n_group: int = 1  # >1: experts in this many equal groups, each token picks within its best topk_group (DeepSeek)
    topk_group: int | None = None  # groups a token may pick from; None = all n_group
    group_score: str = "max"  # a group's rank: its best expert (DeepSeek-V2) or its best two summed (top2_sum, V3)
    capacity_factor: float | None = None  # None: dropless; else each expert keeps cf*T*k/E (batch-wide, not causal)
    activation: str = "swiglu"  # expert FFN: swiglu (gated SiLU), gelu, or clamped_swiglu (gpt-oss)
    swiglu_alpha: float = 1.702  # clamped_swiglu: (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # clamped_swiglu: gate clamped above at limit, up to [-limit, limit]
    expert_ffn_bias: bool = False  # biases on each routed expert's input and output projections (gpt-oss)
    router_bias: bool = False  # a learned bias on the router logits, in selection and weights (gpt-oss)
    num_shared_experts: int = 0  # always-on experts of width shared_d_ff each (DeepSeek-MoE)
    shared_d_ff: int | None = None  # hidden width of each shared expert; None = d_ff (Qwen2-MoE sets its own)
    residual: bool = False  # add a dense MLP mixed with the MoE by a learned gate (DeepSpeed PR-MoE)
    aux_loss_coef: float = 0.01  # weight of the Switch load-balancing loss in MoEStats.loss
    z_loss_coef: float = 0.001  # weight of the ST-MoE router z-loss in MoEStats.loss
    bias_update_rate: float = 0.0  # >0: aux-loss-free balancing bias step per update (DeepSeek-V3)
    gemm: str = "auto"  # grouped_mm | per_expert_mm | auto: a fixed rule on device and grad mode (experts/gemm.py)
    shared_expert_gate: bool = False  # scale the shared experts' output by a learned per-token sigmoid (Qwen2-MoE)
    dts_steps: int = 0  # >0: DTS gate (Nie et al.): start on all experts, anneal to top_k over this many steps
    dts_temperature: float = 2.0  # softmax temperature of the DTS gate at step 0, annealed to 1

    def __post_init__(self) -> None:
        _finite(self, "")
        for name in ("d_model", "d_ff", "num_experts", "top_k"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, value, "must be a positive integer")
        _one_of("router", self.router, ROUTERS)
        _one_of("score_func", self.score_func, SCORE_FUNCS)
        _one_of("group_score", self.group_score, GROUP_SCORES)
        _one_of("activation", self.activation, ACTIVATIONS)
        _one_of("gemm", self.gemm, GEMM_BACKENDS)
        _require(
            self.top_k <= self.num_experts,
            "top_k",
            self.top_k,
            f"cannot exceed num_experts={self.num_experts}",
        )
        if self.router == "switch":
            _require(self.top_k == 1, "top_k", self.top_k, "the switch router picks exactly 1 expert")
        if self.router == "gshard":
            _require(self.top_k == 2, "top_k", self.top_k, "the gshard router picks exactly 2 experts")
        softmax_over_picks = self.router == "noisy_topk" or not self.softmax_before_topk
        if self.top_k == 1 and self.score_func == "softmax" and self.router in ("topk", "noisy_topk"):
            _require(
                not softmax_over_picks,
                "top_k",
                self.top_k,
                "a softmax over one picked logit is always 1, so the router would get no gradient; "
                "use top_k >= 2 or softmax_before_topk = true with router = topk",
            )
        if self.capacity_factor is not None:
            _require(self.capacity_factor > 0, "capacity_factor", self.capacity_factor, "must be > 0")
        _require(self.num_shared_experts >= 0, "num_shared_experts", self.num_shared_experts, "must be >= 0")
        if self.shared_d_ff is not None:
            ok = isinstance(self.shared_d_ff, int) and self.shared_d_ff > 0
            _require(ok, "shared_d_ff", self.shared_d_ff, "must be a positive integer (or None: d_ff)")
            _require(self.num_shared_experts > 0, "shared_d_ff", self.shared_d_ff, "needs num_shared_experts > 0")
        _require(self.route_scale > 0, "route_scale", self.route_scale, "must be > 0")
        _require(self.swiglu_limit > 0, "swiglu_limit", self.swiglu_limit, "must be > 0")
        dense_mlps = self.num_shared_experts or self.residual
        ok = self.activation != "clamped_swiglu" or not dense_mlps
        _require(ok, "activation", self.activation, "routed experts only (shared and residual MLPs: swiglu, gelu)")
        ok = not self.router_bias or self.router in TOKEN_CHOICE_ROUTERS
        _require(ok, "router_bias", self.router_bias, "needs a token-choice router")
        self._check_groups()
        if self.shared_expert_gate:
            _require(self.num_shared_experts > 0, "shared_expert_gate", True, "needs num_shared_experts > 0")
        _require(isinstance(self.dts_steps, int) and self.dts_steps >= 0, "dts_steps", self.dts_steps, "must be >= 0")
        _require(self.dts_temperature > 0, "dts_temperature", self.dts_temperature, "must be > 0")
        if self.dts_steps:
            dts_ok = self.router == "topk" and self.score_func == "softmax" and self.softmax_before_topk
            _require(
                dts_ok, "dts_steps", self.dts_steps, "the DTS gate needs router = topk with a softmax before top-k"
            )
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        if self.bias_update_rate > 0:
            _require(
                self.router in TOKEN_CHOICE_ROUTERS,
                "bias_update_rate",
                self.bias_update_rate,
                f"aux-loss-free bias needs a token-choice router, not {self.router!r}",
            )

    def _check_groups(self) -> None:
        _require(isinstance(self.n_group, int) and self.n_group > 0, "n_group", self.n_group, "must be >= 1")
        if self.topk_group is not None:
            ok = isinstance(self.topk_group, int) and 0 < self.topk_group <= self.n_group
            _require(ok, "topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
        if self.n_group == 1:
            return
        _require(
            self.router in ("topk", "noisy_topk") and not self.dts_steps,
            "n_group",
            self.n_group,
            "group-limited routing needs router = topk or noisy_topk, without dts_steps",
        )
        _require(
            self.num_experts % self.n_group == 0,
            "n_group",
            self.n_group,
            f"must divide num_experts={self.num_experts} (with experts_per_layer: every layer's count)",
        )
        per_group = self.num_experts // self.n_group
        if self.group_score == "top2_sum":
            _require(per_group >= 2, "group_score", "top2_sum", f"needs >= 2 experts per group, not {per_group}")
        reachable = per_group * (self.topk_group or self.n_group)
        _require(self.top_k <= reachable, "top_k", self.top_k, f"exceeds the {reachable} experts of topk_group groups")

    @property
    def shared_hidden(self) -> int:
        """Hidden width of all shared experts together (always on, so they run as one wide FFN)."""
        return (self.shared_d_ff or self.d_ff) * self.num_shared_experts


ALL_TO_ALL = ("flat", "two_level")
EXPERT_SHARDING = ("shard", "replicate")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")


@dataclass
class ParallelConfig:
    """How a run is spread over ranks; the world size must equal dp * ep * tp * pp."""

    dp: int = 0  # data-parallel (FSDP) degree; 0 = what the world size leaves after ep * tp * pp
    ep: int = 1  # expert-parallel degree: each ep rank holds num_experts / ep experts of every MoE layer
    tp: int = 1  # tensor-parallel degree for attention and dense MLPs
    pp: int = 1  # pipeline stages (layers split into pp ranks)
    all_to_all: str = "flat"  # flat | two_level (within a node, then across nodes: Tutel 2DH)
    node_size: int = 0  # ep ranks per node for the two-level all-to-all; 0 = ranks on this host / tp
    overlap_chunks: int = 1  # >1: split each dispatch so one chunk's all-to-all overlaps another's GEMM
    dispatch_dedup: bool = False  # send a token once per ep rank holding any of its experts, not once per expert
    expert_sharding: str = "shard"  # expert weights over dp: shard (FSDP) | replicate (all-reduced grads)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | looped_bfs
    pp_microbatches: int = 0  # micro-batches per pipeline step; 0 = 2 * pp (must divide train.batch_size)
    timeout_s: float = 300.0  # a collective waiting longer than this (a dead rank) ends the run with an error
    placement_every: int = 0  # >0: every this many steps, re-place experts by the loads seen since (SmartMoE)
    placement_min_gain: float = 0.05  # re-place only when the busiest rank's predicted load drops by this fraction
    placement_max_moves: int = 0  # most experts one re-placement may move per layer (bounds the bytes); 0 = any
    shadow_experts: int = 0  # >0: replicate up to this many popular experts on every ep rank (FasterMoE)

    def __post_init__(self) -> None:
        _finite(self, "parallel.")
        for name in ("ep", "tp", "pp", "overlap_chunks"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"parallel.{name}", value, "must be a positive integer")
        for name in ("dp", "node_size", "pp_microbatches"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, f"parallel.{name}", value, "must be an integer >= 0")
        _one_of("parallel.all_to_all", self.all_to_all, ALL_TO_ALL)
        _one_of("parallel.expert_sharding", self.expert_sharding, EXPERT_SHARDING)
        _one_of("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _require(self.timeout_s > 0, "parallel.timeout_s", self.timeout_s, "must be > 0")
        for name in ("placement_every", "placement_max_moves", "shadow_experts"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, f"parallel.{name}", value, "must be an integer >= 0")
        _require(
            0 <= self.placement_min_gain < 1,
            "parallel.placement_min_gain",
            self.placement_min_gain,
            "must be in [0, 1)",
        )
        if self.shadow_experts:
            _require(
                self.placement_every > 0,
                "parallel.shadow_experts",
                self.shadow_experts,
                "needs parallel.placement_every > 0 (shadows are chosen at each placement check)",
            )

    @property
    def stages_per_rank(self) -> int:
        """Interleaved schedules hold two model chunks per pipeline rank."""
        return 2 if self.pp_schedule in ("interleaved_1f1b", "looped_bfs") else 1


TOKENIZERS = ("byte", "char", "bpe")


@dataclass
class DataConfig:
    """Where training text comes from and how it becomes tokens."""

    path: str | None = None  # text file, directory or glob; None: this Python's standard library source
    tokenizer: str = "byte"  # byte (no training) | char (corpus alphabet) | bpe (trained on the corpus)
    bpe_vocab_size: int = 4096  # vocabulary size when tokenizer = bpe
    val_fraction: float = 0.1  # share of tokens (the tail of the corpus) held out for validation
    cache_dir: str | None = None  # token cache; None: ~/.cache/moekit/tokens

    def __post_init__(self) -> None:
        _finite(self, "data.")
        _one_of("data.tokenizer", self.tokenizer, TOKENIZERS)
        _require(self.bpe_vocab_size >= 260, "data.bpe_vocab_size", self.bpe_vocab_size, "must be >= 260")
        _require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")


MLP_ACTIVATIONS = ("swiglu", "gelu")
ROPE_SCALINGS = ("none", "yarn")
NORMS = ("rmsnorm", "layernorm")
ATTENTIONS = ("mha", "mla")
DTYPES = ("fp32", "bf16")


@dataclass
class ModelConfig:
    """A decoder-only transformer; which of its layers are MoE is decided here, the MoE itself in [moe]."""

    vocab_size: int = 256  # token ids the model embeds; set from the tokenizer when training
    context_length: int = 256  # longest sequence the model attends over
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention query heads
    n_kv_heads: int | None = None  # key/value heads (fewer than n_heads: grouped-query attention); None = n_heads
    head_dim: int | None = None  # width of each attention head; None = d_model / n_heads (Qwen3, gpt-oss set theirs)
    d_model: int = 256  # residual stream width
    d_ff: int = 768  # hidden width of dense MLPs (and of each expert unless moe.d_ff is set)
    mlp_activation: str = "swiglu"  # dense MLP: swiglu or gelu
    norm: str = "rmsnorm"  # rmsnorm (Llama, Mixtral) or layernorm without bias (GPT-2, nanoGPT)
    dropout: float = 0.0  # dropout on attention and residual branches while training
    tie_embeddings: bool = True  # share the input embedding with the output projection
    rope_theta: float = 10000.0  # RoPE base frequency
    attention: str = "mha"  # mha (multi-head, grouped-query with n_kv_heads) | mla (DeepSeek's latent attention)
    q_lora_rank: int = 0  # mla: rank of the compressed query; 0 = a full-rank query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int | None = None  # mla: width of the cached key/value latent per token; None = 4 * d_model / n_heads
    qk_nope_head_dim: int | None = None  # mla: per-head query/key dims without RoPE; None = d_model / n_heads
    qk_rope_head_dim: int | None = None  # mla: per-head dims with RoPE (one key part shared by all heads); None = half
    v_head_dim: int | None = None  # mla: per-head value width; None = d_model / n_heads
    norm_eps: float | None = None  # epsilon of every norm; None: torch's default (imported checkpoints set theirs)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over the whole query and key projections before RoPE (OLMoE)
    qk_head_norm: bool = False  # RMSNorm over each query and key head (one weight of head_dim) before RoPE (Qwen3)
    attn_out_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    attn_sinks: bool = False  # a learned logit per head in each softmax denominator: may attend to nothing (gpt-oss)
    sliding_window: int = 0  # >0: windowed blocks attend to this many most recent tokens (their own included)
    full_attention_every: int = 0  # with sliding_window: blocks n-1, 2n-1, ... attend to all tokens; 0 = none
    rope_scaling: str = "none"  # none | yarn (NTK-by-parts frequencies and attention scale, Peng et al. 2023)
    rope_factor: float = 1.0  # yarn: context extension factor
    rope_original_context: int = 0  # yarn: context length the RoPE frequencies were trained at
    rope_beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept (extrapolated)
    rope_beta_slow: float = 1.0  # yarn: rotations below which a frequency is divided by rope_factor
    rope_truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    rope_attention_factor: float | None = None  # yarn: scale on cos/sin; None = from the two mscales below
    rope_mscale: float = 1.0  # yarn: strength of the ln(factor) gain on the rotated query/key dims (DeepSeek)
    rope_mscale_all_dim: float = 0.0  # yarn, mla: >0 moves this much of that gain onto the softmax scale (DeepSeek)
    init_std: float = 0.02  # std of weight init; residual output projections get 1/sqrt(2*n_layers) of it
    moe_every: int = 1  # every n-th block (after first_dense_layers) is MoE; 0 = a dense model
    first_dense_layers: int = 0  # leading blocks kept dense (DeepSeek-MoE)
    experts_per_layer: list[int] | None = None  # pyramid MoE: experts of each MoE block, overrides moe.num_experts

    def __post_init__(self) -> None:
        _finite(self, "model.")
        for name in ("vocab_size", "context_length", "n_layers", "n_heads", "d_model", "d_ff"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"model.{name}", value, "must be a positive integer")
        if self.attention != "mla":  # MLA's head widths are its own fields
            if self.head_dim is None:
                ok = self.d_model % self.n_heads == 0
                _require(
                    ok, "model.n_heads", self.n_heads, f"must divide d_model={self.d_model} (or set model.head_dim)"
                )
            else:
                _require(
                    isinstance(self.head_dim, int) and self.head_dim > 0, "model.head_dim", self.head_dim, "must be > 0"
                )
            _require(self.head_size % 2 == 0, "model.head_dim", self.head_size, "head size must be even (RoPE)")
        _require(not (self.qk_norm and self.qk_head_norm), "model.qk_head_norm", True, "excludes model.qk_norm")
        for name in ("sliding_window", "full_attention_every"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, f"model.{name}", value, "must be an integer >= 0")
        kv = self.kv_heads
        _require(kv > 0 and self.n_heads % kv == 0, "model.n_kv_heads", self.n_kv_heads, "must divide n_heads")
        _one_of("model.mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
        _one_of("model.attention", self.attention, ATTENTIONS)
        self._check_mla()
        self._check_yarn()
        _require(self.init_std > 0, "model.init_std", self.init_std, "must be > 0")
        _one_of("model.norm", self.norm, NORMS)
        if self.norm_eps is not None:
            _require(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        _require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")
        _require(self.moe_every >= 0, "model.moe_every", self.moe_every, "must be >= 0")
        _require(self.first_dense_layers >= 0, "model.first_dense_layers", self.first_dense_layers, "must be >= 0")
        if self.experts_per_layer is not None:
            n_moe = len(self.moe_layers())
            _require(
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
                _require(unset, f"model.{name}", getattr(self, name), "needs model.attention = mla")
            return
        defaults = dict(kv_lora_rank=4 * head, qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head)
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"model.{name}", value, "must be a positive integer")
        rope = self.qk_rope_head_dim
        _require(rope % 2 == 0, "model.qk_rope_head_dim", rope, "must be even (RoPE rotates pairs)")
        _require(self.q_lora_rank >= 0, "model.q_lora_rank", self.q_lora_rank, "must be >= 0")
        _require(self.n_kv_heads in (None, self.n_heads), "model.n_kv_heads", self.n_kv_heads, "mla has no kv heads")
        _require(not self.qkv_bias, "model.qkv_bias", True, "mla has no fused q/k/v projection")
        _require(not self.qk_norm, "model.qk_norm", True, "mla normalises its latents instead")
        _require(not self.qk_head_norm, "model.qk_head_norm", True, "mla normalises its latents instead")
        _require(self.head_dim is None, "model.head_dim", self.head_dim, "mla sets qk_nope/qk_rope/v_head_dim")
        for name in ("attn_out_bias", "attn_sinks", "sliding_window"):
            _require(not getattr(self, name), f"model.{name}", getattr(self, name), "not supported with mla")

    def _check_yarn(self) -> None:
        _one_of("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling == "yarn":
            _require(self.rope_factor >= 1, "model.rope_factor", self.rope_factor, "must be >= 1")
            ok = self.rope_original_context > 0
            _require(ok, "model.rope_original_context", self.rope_original_context, "yarn needs it > 0")
        if self.rope_mscale_all_dim:
            _require(
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


@dataclass
class TrainConfig:
    """The optimisation loop, evaluation, logging and checkpoints."""

    steps: int = 300  # optimizer steps; the LR schedule spans them (resumed with more: the longer cosine from there)
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 30  # linear warmup from 0 to lr
    weight_decay: float = 0.1  # AdamW decay on weights by role: not on biases (expert ones included), norms or sinks
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = off
    max_nonfinite_steps: int = 3  # stop after this many consecutive steps skipped for a NaN/inf gradient norm
    dtype: str = "fp32"  # fp32, or bf16 autocast (fp32 master weights, router kept in fp32)
    compile: bool = False  # torch.compile each block (MoE dispatch stays eager)
    seed: int = 1337  # seeds init, data order and dropout: equal seeds give equal runs on CPU
    eval_every: int = 50  # steps between validation passes (and one at the end)
    eval_iters: int = 10  # validation batches per pass
    ckpt_every: int = 100  # steps between checkpoints (and one at the end); 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    async_checkpoint: bool = False  # write checkpoints on a background thread while training goes on
    peak_tflops: float | None = None  # device peak for MFU; None: a known GPU's dense peak in train.dtype, 0.5 on a CPU
    sample_tokens: int = 200  # tokens generated into sample.txt at the end; 0 = none
    # Training beyond memory: MoE experts' weights and AdamW state kept on disk, a budgeted working set in RAM.
    memory_budget: str = ""  # RAM for the experts' working set (e.g. 4GB); "" = every expert stays in memory
    host_budget: str = ""  # RAM holding the offloaded expert state moved most per step instead of the disk; "" = none
    offload_dir: str = ""  # directory of the offloaded expert state (a local disk); "" = <run_dir>/offload

    def __post_init__(self) -> None:
        _finite(self, "train.")
        positive = (
            "steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "eval_iters",
            "keep_checkpoints",
            "max_nonfinite_steps",
        )
        for name in positive:
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"train.{name}", value, "must be a positive integer")
        for name in ("warmup_steps", "ckpt_every", "sample_tokens"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, f"train.{name}", value, "must be an integer >= 0")
        _require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _require(0 <= self.min_lr <= self.lr, "train.min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        _require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        for name in ("beta1", "beta2"):
            _require(0 <= getattr(self, name) < 1, f"train.{name}", getattr(self, name), "must be in [0, 1)")
        _require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0")
        _require(self.peak_tflops is None or self.peak_tflops > 0, "train.peak_tflops", self.peak_tflops, "must be > 0")
        _one_of("train.dtype", self.dtype, DTYPES)
        self._check_offload()

    def _check_offload(self) -> None:
        from moekit.units import parse_bytes

        if self.memory_budget:
            _require(
                parse_bytes(self.memory_budget, "train.memory_budget") > 0,
                "train.memory_budget",
                self.memory_budget,
                "must be > 0",
            )
        if self.host_budget:
            _require(
                parse_bytes(self.host_budget, "train.host_budget") > 0,
                "train.host_budget",
                self.host_budget,
                "must be > 0",
            )
            _require(
                bool(self.memory_budget),
                "train.host_budget",
                self.host_budget,
                "needs train.memory_budget (the host tier sits between the working set and the disk)",
            )
        _require(
            not self.offload_dir or bool(self.memory_budget),
            "train.offload_dir",
            self.offload_dir,
            "needs train.memory_budget (nothing is offloaded without a budget)",
        )

    @property
    def offloaded(self) -> bool:
        """Whether the experts train beyond memory (``memory_budget`` given)."""
        return bool(self.memory_budget)
