"""Configuration dataclasses: one per component, each field with a one-line reason.

Validation happens in ``__post_init__`` so a bad value fails with a ``ValueError`` that names the
field, before any tensor is built.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTERS = ("topk", "switch", "gshard", "noisy_topk", "expert_choice", "hash")
SCORE_FUNCS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "gelu")
GEMM_BACKENDS = ("auto", "grouped_mm", "per_expert_mm")


def _require(ok: bool, field: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r}: {why}")


def _one_of(field: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, field, value, f"must be one of {', '.join(choices)}")


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
    capacity_factor: float | None = None  # None: dropless; else each expert keeps cf*T*k/E tokens
    activation: str = "swiglu"  # expert FFN: swiglu (gated SiLU) or gelu
    num_shared_experts: int = 0  # always-on experts of width d_ff each (DeepSeek-MoE)
    residual: bool = False  # add a dense MLP mixed with the MoE by a learned gate (DeepSpeed PR-MoE)
    aux_loss_coef: float = 0.01  # weight of the Switch load-balancing loss in MoEStats.loss
    z_loss_coef: float = 0.001  # weight of the ST-MoE router z-loss in MoEStats.loss
    bias_update_rate: float = 0.0  # >0: aux-loss-free balancing bias step per update (DeepSeek-V3)
    gemm: str = "auto"  # grouped GEMM: auto | grouped_mm (torch._grouped_mm) | per_expert_mm

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_experts", "top_k"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, value, "must be a positive integer")
        _one_of("router", self.router, ROUTERS)
        _one_of("score_func", self.score_func, SCORE_FUNCS)
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
        if self.capacity_factor is not None:
            _require(self.capacity_factor > 0, "capacity_factor", self.capacity_factor, "must be > 0")
        _require(self.num_shared_experts >= 0, "num_shared_experts", self.num_shared_experts, "must be >= 0")
        _require(self.route_scale > 0, "route_scale", self.route_scale, "must be > 0")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        if self.bias_update_rate > 0:
            _require(
                self.router in ("topk", "switch", "gshard", "noisy_topk"),
                "bias_update_rate",
                self.bias_update_rate,
                f"aux-loss-free bias needs a token-choice router, not {self.router!r}",
            )
