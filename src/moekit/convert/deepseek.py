"""DeepSeek-V2 / V2-Lite / V3 (and Kimi-K2-style) ``config.json`` to moekit's configs and back.

Multi-head latent attention, YaRN RoPE, shared experts, dense leading blocks, and the routers:
V2 a softmax top-k (greedy or group-limited, groups ranked by their best expert) without
renormalisation; V3 sigmoid scores, a selection-only bias, groups ranked by their best two experts,
renormalised over the picks. Both scale the weights by ``routed_scaling_factor``. Anything else a
config sets that moekit's model cannot express is a ``ConversionError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from moekit.config import ModelConfig, MoEConfig
from moekit.convert.errors import ConversionError, unfit
from moekit.convert.hf_fields import check_fit, common_fields
from moekit.convert.hf_rope import rope_from_hf

FAMILIES = ("deepseek_v2", "deepseek_v3")


def _routing(hf: dict[str, Any]) -> dict[str, Any]:
    """moekit's router fields for V2's softmax or V3's sigmoid top-k."""
    top_k, n_group, topk_group = hf["num_experts_per_tok"], hf.get("n_group"), hf.get("topk_group")
    route = {"route_scale": float(hf.get("routed_scaling_factor", 1.0)), "top_k": top_k}
    if hf["model_type"] == "deepseek_v2":
        if hf.get("norm_topk_prob"):
            raise unfit(
                hf["model_type"],
                "norm_topk_prob=True (transformers' DeepSeek-V2 never renormalises; moekit follows it)",
            )
        method = hf.get("topk_method") or "greedy"
        if method == "greedy":
            return route | {"score_func": "softmax", "normalize_topk": False}
        if method != "group_limited_greedy":
            raise unfit(hf["model_type"], f"topk_method {method!r} (greedy or group_limited_greedy)")
        groups = {"n_group": n_group, "topk_group": topk_group, "group_score": "max"}
        return route | {"score_func": "softmax", "normalize_topk": False} | groups
    normalize = bool(hf.get("norm_topk_prob", True))
    if top_k == 1 and normalize:
        raise unfit(
            hf["model_type"], "top-1 routing with a renormalised weight of 1 (moekit keeps the router's probability)"
        )
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise unfit(hf["model_type"], f"scoring_func {hf['scoring_func']!r} (transformers' DeepSeek-V3 uses sigmoid)")
    groups = {"n_group": n_group, "topk_group": topk_group, "group_score": "top2_sum"}
    return route | {"score_func": "sigmoid", "normalize_topk": normalize, "aux_loss_coef": 0.0} | groups


def mtp_prefixes(hf: dict[str, Any]) -> tuple[str, ...]:
    """Key prefixes of V3's multi-token-prediction modules (``num_nextn_predict_layers`` of them, stored as
    blocks after the last one). They serve MTP training and speculative decoding, which moekit does not
    do, and transformers' DeepSeek-V3 leaves them out too, so conversion skips them (and says so)."""
    first = hf["num_hidden_layers"]
    return tuple(f"model.layers.{first + i}." for i in range(hf.get("num_nextn_predict_layers") or 0))


def configs_from_hf(hf: dict[str, Any]) -> tuple[ModelConfig, MoEConfig]:
    """moekit's model and MoE configs for a DeepSeek-V2/V3 config, built as transformers builds its model."""
    for field, needed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(field, needed) != needed:
            raise unfit(hf["model_type"], f"{field}={hf[field]!r} (moekit needs {needed!r})")
    if hf.get("moe_layer_freq", 1) != 1:
        raise unfit(hf["model_type"], f"moe_layer_freq={hf['moe_layer_freq']!r}")
    heads, n_layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads < heads:  # transformers ignores it at num_attention_heads or above (MLA has no kv heads)
        raise unfit(
            hf["model_type"], f"num_key_value_heads={kv_heads} < num_attention_heads={heads} (MLA expands every head)"
        )
    shared = hf.get("n_shared_experts")
    if not isinstance(shared, int) or shared < 1:
        raise unfit(hf["model_type"], f"n_shared_experts={shared!r} (moekit reads DeepSeek models with shared experts)")
    dense = hf.get("first_k_dense_replace") or 0
    if dense >= n_layers:
        raise unfit(hf["model_type"], f"first_k_dense_replace={dense} (no MoE blocks left of {n_layers})")
    model = ModelConfig(
        vocab_size=hf["vocab_size"],
        context_length=hf.get("max_position_embeddings", 2048),
        n_layers=n_layers,
        n_heads=heads,
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention="mla",
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        first_dense_layers=dense,
        moe_every=1,
        **rope_from_hf(hf, mla=True),
    )
    moe = MoEConfig(
        d_model=hf["hidden_size"],
        d_ff=hf["moe_intermediate_size"],
        num_experts=hf["n_routed_experts"],
        num_shared_experts=shared,
        **_routing(hf),
    )
    return model, moe


def export_family(model: ModelConfig, moe: MoEConfig) -> str:
    """``deepseek_v3`` for sigmoid routing, ``deepseek_v2`` for softmax; an error names what does not fit."""
    family = "deepseek_v3" if moe.score_func == "sigmoid" else "deepseek_v2"
    v3 = family == "deepseek_v3"
    misfits = {
        "model.moe_every": (model.moe_every, 1),
        "moe.activation": (moe.activation, "swiglu"),
        "moe.softmax_before_topk": (moe.softmax_before_topk, True),
        "moe.shared_expert_gate": (moe.shared_expert_gate, False),
        "moe.normalize_topk": (moe.normalize_topk, moe.normalize_topk if v3 else False),
        "moe.group_score": (moe.group_score, "top2_sum" if v3 else "max"),
    }
    if moe.n_group == 1:
        del misfits["moe.group_score"]  # one group: its rank changes nothing
    check_fit(family, model, moe, misfits, stores_expert_bias=v3)
    if moe.shared_hidden % moe.d_ff or not moe.num_shared_experts:
        raise ConversionError(f"{family}: shared experts of total width {moe.shared_hidden} are not n * moe.d_ff")
    if v3 and moe.top_k == 1 and moe.normalize_topk:
        raise ConversionError(f"{family}: moe.top_k=1 with normalize_topk does not fit (it renormalises to 1)")
    if model.rope_scaling == "yarn" and not model.rope_mscale_all_dim and model.rope_mscale != 1:
        raise ConversionError(f"{family}: model.rope_mscale without rope_mscale_all_dim does not fit")
    return family


def hf_config(family: str, model: ModelConfig, moe: MoEConfig) -> dict[str, Any]:
    """The ``config.json`` transformers builds the same model from."""
    groups = {"n_group": moe.n_group, "topk_group": moe.topk_group or moe.n_group}
    config: dict[str, Any] = common_fields(model, moe) | {
        "architectures": ["DeepseekV3ForCausalLM" if family == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "model_type": family,
        "moe_intermediate_size": moe.d_ff,
        "num_key_value_heads": model.n_heads,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.shared_hidden // moe.d_ff,
        "routed_scaling_factor": moe.route_scale,
        "first_k_dense_replace": model.first_dense_layers,
        "q_lora_rank": model.q_lora_rank or None,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "attention_bias": False,
    }
    if family == "deepseek_v3":
        v3 = {"norm_topk_prob": moe.normalize_topk, "rope_interleave": True, "num_nextn_predict_layers": 0}
        return config | groups | v3  # no multi-token-prediction module is written
    if moe.n_group > 1:
        return config | groups | {"topk_method": "group_limited_greedy", "norm_topk_prob": False}
    return config | {"topk_method": "greedy", "norm_topk_prob": False}
