"""The MoE layer's config: router, dispatch and experts (``[moe]`` of a run)."""

from __future__ import annotations

from dataclasses import dataclass

from moekit.config.fields import (
    NONNEGATIVE,
    NONNEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    REQUIRED,
    check_fields,
    choice,
    option,
    require,
)

ROUTERS = ("topk", "switch", "gshard", "noisy_topk", "expert_choice", "hash")
TOKEN_CHOICE_ROUTERS = ("topk", "switch", "gshard", "noisy_topk")  # learned, k experts per token
SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")
ACTIVATIONS = ("swiglu", "gelu", "clamped_swiglu")
GEMM_BACKENDS = ("auto", "grouped_mm", "per_expert_mm")


@dataclass
class MoEConfig:
    """One mixture-of-experts layer: router, dispatch and experts."""

    d_model: int = option(REQUIRED, "width of the tokens entering and leaving the layer", POSITIVE_INT)
    d_ff: int = option(REQUIRED, "hidden width of each routed expert's FFN", POSITIVE_INT)
    num_experts: int = option(8, "routed experts in the layer", POSITIVE_INT)
    top_k: int = option(2, "experts each token picks (for expert_choice: average picks per token)", POSITIVE_INT)
    router: str = option(
        "topk", "topk | switch (top-1) | gshard (top-2) | noisy_topk | expert_choice | hash", choice(*ROUTERS)
    )
    score_func: str = option(
        "softmax", "softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3) router scores", choice(*SCORE_FUNCS)
    )
    softmax_before_topk: bool = option(True, "softmax over all experts, then pick; False: over the k picked")
    normalize_topk: bool = option(True, "rescale the k picked weights to sum to 1")
    route_scale: float = option(1.0, "multiplier on the combine weights (DeepSeek-V3's routed scaling)", POSITIVE)
    n_group: int = option(
        1, ">1: experts in this many equal groups, each token picks within its best topk_group (DeepSeek)", POSITIVE_INT
    )
    topk_group: int | None = option(None, "groups a token may pick from; None = all n_group")
    group_score: str = option(
        "max",
        "a group's rank: its best expert (DeepSeek-V2) or its best two summed (top2_sum, V3)",
        choice(*GROUP_SCORES),
    )
    capacity_factor: float | None = option(
        None, "None: dropless; else each expert keeps cf*T*k/E (batch-wide, not causal)", POSITIVE
    )
    activation: str = option(
        "swiglu", "expert FFN: swiglu (gated SiLU), gelu, or clamped_swiglu (gpt-oss)", choice(*ACTIVATIONS)
    )
    swiglu_alpha: float = option(1.702, "clamped_swiglu: (up + 1) * gate * sigmoid(alpha * gate)")
    swiglu_limit: float = option(7.0, "clamped_swiglu: gate clamped above at limit, up to [-limit, limit]", POSITIVE)
    expert_ffn_bias: bool = option(False, "biases on each routed expert's input and output projections (gpt-oss)")
    router_bias: bool = option(False, "a learned bias on the router logits, in selection and weights (gpt-oss)")
    num_shared_experts: int = option(0, "always-on experts of width shared_d_ff each (DeepSeek-MoE)", NONNEGATIVE)
    shared_d_ff: int | None = option(
        None, "hidden width of each shared expert; None = d_ff (Qwen2-MoE sets its own)", POSITIVE_INT
    )
    residual: bool = option(False, "add a dense MLP mixed with the MoE by a learned gate (DeepSpeed PR-MoE)")
    aux_loss_coef: float = option(0.01, "weight of the Switch load-balancing loss in MoEStats.loss", NONNEGATIVE)
    z_loss_coef: float = option(0.001, "weight of the ST-MoE router z-loss in MoEStats.loss", NONNEGATIVE)
    bias_update_rate: float = option(0.0, ">0: aux-loss-free balancing bias step per update (DeepSeek-V3)", NONNEGATIVE)
    gemm: str = option(
        "auto",
        "grouped_mm | per_expert_mm | auto: a fixed rule on device and grad mode (experts/gemm.py)",
        choice(*GEMM_BACKENDS),
    )
    shared_expert_gate: bool = option(
        False, "scale the shared experts' output by a learned per-token sigmoid (Qwen2-MoE)"
    )
    dts_steps: int = option(
        0, ">0: DTS gate (Nie et al.): start on all experts, anneal to top_k over this many steps", NONNEGATIVE_INT
    )
    dts_temperature: float = option(2.0, "softmax temperature of the DTS gate at step 0, annealed to 1", POSITIVE)

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.top_k <= self.num_experts, "top_k", self.top_k, f"cannot exceed num_experts={self.num_experts}")
        if self.router == "switch":
            require(self.top_k == 1, "top_k", self.top_k, "the switch router picks exactly 1 expert")
        if self.router == "gshard":
            require(self.top_k == 2, "top_k", self.top_k, "the gshard router picks exactly 2 experts")
        softmax_over_picks = self.router == "noisy_topk" or not self.softmax_before_topk
        if self.top_k == 1 and self.score_func == "softmax" and self.router in ("topk", "noisy_topk"):
            require(
                not softmax_over_picks,
                "top_k",
                self.top_k,
                "a softmax over one picked logit is always 1, so the router would get no gradient; "
                "use top_k >= 2 or softmax_before_topk = true with router = topk",
            )
        if self.shared_d_ff is not None:
            require(self.num_shared_experts > 0, "shared_d_ff", self.shared_d_ff, "needs num_shared_experts > 0")
        dense_mlps = self.num_shared_experts or self.residual
        ok = self.activation != "clamped_swiglu" or not dense_mlps
        require(ok, "activation", self.activation, "routed experts only (shared and residual MLPs: swiglu, gelu)")
        ok = not self.router_bias or self.router in TOKEN_CHOICE_ROUTERS
        require(ok, "router_bias", self.router_bias, "needs a token-choice router")
        self._check_groups()
        if self.shared_expert_gate:
            require(self.num_shared_experts > 0, "shared_expert_gate", True, "needs num_shared_experts > 0")
        if self.dts_steps:
            dts_ok = self.router == "topk" and self.score_func == "softmax" and self.softmax_before_topk
            require(dts_ok, "dts_steps", self.dts_steps, "the DTS gate needs router = topk with a softmax before top-k")
        if self.bias_update_rate > 0:
            require(
                self.router in TOKEN_CHOICE_ROUTERS,
                "bias_update_rate",
                self.bias_update_rate,
                f"aux-loss-free bias needs a token-choice router, not {self.router!r}",
            )

    def _check_groups(self) -> None:
        if self.topk_group is not None:
            ok = isinstance(self.topk_group, int) and 0 < self.topk_group <= self.n_group
            require(ok, "topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
        if self.n_group == 1:
            return
        require(
            self.router in ("topk", "noisy_topk") and not self.dts_steps,
            "n_group",
            self.n_group,
            "group-limited routing needs router = topk or noisy_topk, without dts_steps",
        )
        require(
            self.num_experts % self.n_group == 0,
            "n_group",
            self.n_group,
            f"must divide num_experts={self.num_experts} (with experts_per_layer: every layer's count)",
        )
        per_group = self.num_experts // self.n_group
        if self.group_score == "top2_sum":
            require(per_group >= 2, "group_score", "top2_sum", f"needs >= 2 experts per group, not {per_group}")
        reachable = per_group * (self.topk_group or self.n_group)
        require(self.top_k <= reachable, "top_k", self.top_k, f"exceeds the {reachable} experts of topk_group groups")

    @property
    def shared_hidden(self) -> int:
        """Hidden width of all shared experts together (always on, so they run as one wide FFN)."""
        return (self.shared_d_ff or self.d_ff) * self.num_shared_experts
