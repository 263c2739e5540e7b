"""Hugging Face ``config.json`` to moekit's configs and back, for the families ``keymap`` knows.

Anything a config sets that moekit's model cannot express is a ``ConversionError`` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from moekit.config import ModelConfig, MoEConfig
from moekit.convert import deepseek
from moekit.convert.errors import ConversionError, unfit
from moekit.convert.hf_fields import check_fit, common_fields
from moekit.convert.hf_rope import rope_from_hf
from moekit.convert.keymap import FAMILIES, Family


def read_hf_config(path: Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{path}: no config.json (not a Hugging Face model directory)") from None
    except (OSError, ValueError) as err:
        raise ConversionError(f"{file}: unreadable ({err})") from None


def family_of(hf: dict[str, Any]) -> Family:
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        known = ", ".join(FAMILIES)
        raise ConversionError(f"model_type {model_type!r} is not supported (moekit reads {known})")
    if model_type == "deepseek_v3" and hf.get("rope_interleave") is False:
        return replace(family, rope_halves=True)
    return family


def _full_attention_every(family: Family, layer_types: list[str]) -> int:
    """moekit's ``full_attention_every`` for a list of per-layer "sliding_attention"/"full_attention"."""
    for every in range(len(layer_types) + 1):
        if layer_types == layer_types_of(len(layer_types), every):
            return every
    raise unfit(family.model_type, f"layer_types {layer_types} (moekit makes every n-th block full attention)")


def layer_types_of(n_layers: int, full_attention_every: int) -> list[str]:
    full = [bool(full_attention_every) and (i + 1) % full_attention_every == 0 for i in range(n_layers)]
    return ["full_attention" if f else "sliding_attention" for f in full]


def _gpt_oss_fields(family: Family, hf: dict[str, Any], model: dict[str, Any], moe: dict[str, Any]) -> None:
    """gpt-oss: sinks, windowed and full layers, biased attention; clamped SwiGLU experts with biases,
    routed by a softmax over the top-k biased logits."""
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or layer_types_of(n_layers, 2)
    window = hf.get("sliding_window") or 0
    if window and "sliding_attention" in layer_types:
        model.update(sliding_window=window, full_attention_every=_full_attention_every(family, layer_types))
    model.update(attn_sinks=True)
    moe.update(
        activation="clamped_swiglu",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        expert_ffn_bias=True,
        router_bias=True,
        softmax_before_topk=False,
        normalize_topk=True,
    )


def _moe_pattern(family: Family, n_layers: int, moe_layers: list[int]) -> tuple[int, int]:
    """(first_dense_layers, moe_every) placing MoE blocks exactly at ``moe_layers``."""
    for first in range(n_layers):
        for every in range(1, n_layers + 1):
            cfg_layers = [i for i in range(first, n_layers) if (i - first) % every == 0]
            if cfg_layers == moe_layers:
                return first, every
    raise unfit(family.model_type, f"MoE blocks at layers {moe_layers} (moekit places them every n-th block)")


def _qkv_bias(family: Family, hf: dict[str, Any]) -> bool:
    """Whether transformers builds this config's query/key/value projections with biases."""
    if family.model_type in ("qwen3_moe", "gpt_oss"):
        return bool(hf.get("attention_bias"))  # with the output projection's (attn_out_bias)
    if family.model_type in ("llama", "olmoe") and hf.get("attention_bias"):
        raise unfit(family.model_type, "attention_bias=True (it also biases o_proj, which moekit's attention lacks)")
    if family.model_type == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))  # transformers 5 reads the field; earlier versions always biased
    return family.model_type == "qwen2"


# transformers' router_aux_loss_coef when config.json leaves it out
_HF_AUX_COEF = {"mixtral": 0.001, "qwen2_moe": 0.001, "olmoe": 0.01, "qwen3_moe": 0.001, "gpt_oss": 0.001}


def aux_coef_to_hf(aux_loss_coef: float, top_k: int, n_moe_layers: int) -> float:
    """The ``router_aux_loss_coef`` that gives moekit's ``aux_loss_coef`` the same weight in the loss.

    transformers' ``load_balancing_loss_func`` counts each token's k picks as k assignments of 1/T
    each (its load fractions sum to k) where moekit's ``switch_aux_loss`` divides by all T*k picks
    (they sum to 1), so one layer's loss is k times moekit's. transformers also adds one loss for the
    whole model, over the loads and probabilities averaged across the L MoE layers, where moekit
    adds one loss per layer. With every layer routed alike (and exactly for L = 1):
    ``hf_coef * hf_loss == aux_loss_coef * sum of moekit's layer losses`` when
    ``hf_coef = aux_loss_coef * L / k``.
    """
    return aux_loss_coef * n_moe_layers / top_k


def aux_coef_from_hf(router_aux_loss_coef: float, top_k: int, n_moe_layers: int) -> float:
    """moekit's ``aux_loss_coef`` for a Hugging Face ``router_aux_loss_coef`` (inverse of ``aux_coef_to_hf``)."""
    return router_aux_loss_coef * top_k / n_moe_layers


# transformers' defaults that change what a model computes, for a config.json that leaves them out
# (where they differ from the fallbacks below: rms_norm_eps 1e-6, rope_theta 10000, no groups, ...)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "mistral": {"sliding_window": 4096, "max_position_embeddings": 131072},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen2_moe": {"max_position_embeddings": 32768},
    "qwen3_moe": {"max_position_embeddings": 32768},
    "olmoe": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "deepseek_v2": {"n_shared_experts": 2, "q_lora_rank": 1536},
    "deepseek_v3": {
        "max_position_embeddings": 4096,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
    },
    "gpt_oss": {
        "head_dim": 64,
        "sliding_window": 128,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,  # default_theta: fills a rope_parameters that leaves it out
        "max_position_embeddings": 131072,
    },
}
_HF_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "gpt_oss": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


def configs_from_hf(hf: dict[str, Any]) -> tuple[ModelConfig, MoEConfig | None]:
    """moekit's model and MoE configs for a Hugging Face config, built as transformers builds its model.

    The checkpoint's tensors must then fit: one transformers would ignore, or initialise at random
    because it is missing, is an error in ``from_hf``.
    """
    family = family_of(hf)
    hf = _HF_DEFAULTS.get(family.model_type, {}) | hf
    if family.model_type in deepseek.FAMILIES:
        return deepseek.configs_from_hf(hf)
    d_model, n_heads, n_layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    if hf.get("hidden_act", "silu") != "silu":
        raise unfit(family.model_type, f"hidden_act {hf['hidden_act']!r} (SwiGLU experts use silu)")
    head_dim = hf.get("head_dim")
    if head_dim == d_model // n_heads and d_model % n_heads == 0:
        head_dim = None
    if hf.get("clip_qkv") is not None:
        raise unfit(family.model_type, f"clip_qkv {hf['clip_qkv']}")
    context = hf.get("max_position_embeddings", 2048)
    windowed = hf.get("use_sliding_window", family.model_type in ("mistral", "mixtral"))
    window = hf.get("sliding_window") if windowed else None
    layer_window = 0
    if window and family.model_type == "qwen3_moe":  # every block windowed, exactly
        layer_window, window = window, None
    if window:  # attention over a window equals full attention on sequences no longer than it
        context = min(context, window)
    model = dict(
        vocab_size=hf["vocab_size"],
        context_length=context,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        d_model=d_model,
        d_ff=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=_qkv_bias(family, hf),
        attn_out_bias=bool(hf.get("attention_bias")) and family.model_type in ("qwen3_moe", "gpt_oss"),
        qk_norm=family.model_type == "olmoe",
        qk_head_norm=family.model_type == "qwen3_moe",
        sliding_window=layer_window,
        moe_every=0,
        **rope_from_hf(hf, _HF_DEFAULT_ROPE.get(family.model_type)),
    )
    if not family.moe:
        return ModelConfig(**model), None
    num_experts = hf.get("num_local_experts") or hf["num_experts"]
    top_k = hf["num_experts_per_tok"]
    normalize = family.model_type == "mixtral" or bool(hf.get("norm_topk_prob"))  # Mixtral always renormalises
    if top_k == 1 and normalize:
        raise unfit(
            family.model_type, "top-1 routing with a renormalised weight of 1 (moekit keeps the router's probability)"
        )
    qwen = family.model_type in ("qwen2_moe", "qwen3_moe")
    d_ff = hf["moe_intermediate_size"] if qwen else hf["intermediate_size"]
    moe = dict(d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=top_k, normalize_topk=normalize)
    moe_layers = list(range(n_layers))
    if family.model_type == "gpt_oss":
        _gpt_oss_fields(family, hf, model, moe)
    if qwen:
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        moe_layers = [i for i in moe_layers if i not in dense and (i + 1) % step == 0]
    if family.model_type == "qwen2_moe":
        shared = hf["shared_expert_intermediate_size"]
        if not isinstance(shared, int) or shared < 0:
            raise unfit(family.model_type, f"shared_expert_intermediate_size {shared!r} (must be an integer >= 0)")
        if shared:  # one gated shared expert of its own width; 0: none (it would output zeros)
            moe.update(num_shared_experts=1, shared_d_ff=shared, shared_expert_gate=True)
    if not moe_layers:
        raise unfit(
            family.model_type, "no MoE blocks (mlp_only_layers and decoder_sparse_step leave every block dense)"
        )
    hf_coef = hf.get("router_aux_loss_coef", _HF_AUX_COEF[family.model_type])
    if not isinstance(hf_coef, (int, float)) or hf_coef < 0:
        raise unfit(family.model_type, f"router_aux_loss_coef {hf_coef!r} (must be a number >= 0)")
    moe["aux_loss_coef"] = aux_coef_from_hf(hf_coef, top_k, len(moe_layers))
    model["first_dense_layers"], model["moe_every"] = _moe_pattern(family, n_layers, moe_layers)
    return ModelConfig(**model), MoEConfig(**moe)


def _export_choice(model: ModelConfig, moe: MoEConfig) -> str:
    """The family a model is written as: the first whose features cover the model's."""
    gpt_oss = (model.attn_sinks, moe.activation == "clamped_swiglu", moe.expert_ffn_bias, moe.router_bias)
    if any(gpt_oss) or (model.sliding_window and model.full_attention_every):
        return "gpt_oss"
    if model.qk_head_norm:
        return "qwen3_moe"
    # Mixtral has no q/k/v biases (transformers would drop them), no shared experts and no dense blocks.
    needs_qwen = model.qkv_bias or moe.num_shared_experts or model.first_dense_layers or model.moe_every != 1
    return "qwen2_moe" if needs_qwen else "mixtral"


def export_family(model: ModelConfig, moe: MoEConfig | None) -> Family:
    """Mixtral, Qwen2-MoE (shared experts, dense blocks), Qwen3-MoE (per-head q/k norms), gpt-oss
    (sinks, clamped SwiGLU, expert and router biases) or, for MLA, DeepSeek; an error names what does
    not fit."""
    if moe is None or not model.moe_layers():
        raise ConversionError(
            "model.moe_every=0: a dense model fits no MoE family "
            "(export writes Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss or DeepSeek)"
        )
    if model.attention == "mla":
        return FAMILIES[deepseek.export_family(model, moe)]
    family = FAMILIES[_export_choice(model, moe)]
    oss, qwen3 = family.model_type == "gpt_oss", family.model_type == "qwen3_moe"
    misfits = {
        "moe.activation": (moe.activation, "clamped_swiglu" if oss else "swiglu"),
        "moe.score_func": (moe.score_func, "softmax"),
        "moe.route_scale": (moe.route_scale, 1.0),
        "model.qk_norm": (model.qk_norm, False),
        "model.qk_head_norm": (model.qk_head_norm, qwen3),
        "model.attn_out_bias": (model.attn_out_bias, model.attn_out_bias and (oss or qwen3)),
        "model.sliding_window": (model.sliding_window, model.sliding_window if oss or qwen3 else 0),
        "model.full_attention_every": (model.full_attention_every, model.full_attention_every if oss else 0),
        "moe.n_group": (moe.n_group, 1),
        "model.rope_mscale": (model.rope_mscale, 1.0),
    }
    if oss or qwen3:
        misfits["moe.num_shared_experts"] = (moe.num_shared_experts, 0)
    if oss:
        misfits |= {
            "moe.softmax_before_topk": (moe.softmax_before_topk, False),
            "model.first_dense_layers": (model.first_dense_layers, 0),
            "model.moe_every": (model.moe_every, 1),
        }
    check_fit(family.architecture, model, moe, misfits, biased_experts=oss)
    if family.model_type == "mixtral" and moe.softmax_before_topk and not moe.normalize_topk and moe.top_k > 1:
        raise ConversionError(f"{family.architecture}: moe.normalize_topk=False does not fit (Mixtral renormalises)")
    if moe.top_k == 1:
        raise ConversionError(f"{family.architecture}: moe.top_k=1 does not fit (it renormalises one pick to 1)")
    return family


def hf_config(family: Family, model: ModelConfig, moe: MoEConfig) -> dict[str, Any]:
    if family.model_type in deepseek.FAMILIES:
        return deepseek.hf_config(family.model_type, model, moe)
    config: dict[str, Any] = common_fields(model, moe) | {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_size,
        "router_aux_loss_coef": aux_coef_to_hf(moe.aux_loss_coef, moe.top_k, len(model.moe_layers())),
    }
    if family.model_type == "mixtral":
        # Mixtral has no dense blocks: its intermediate_size is the width of each expert.
        return config | {"num_local_experts": moe.num_experts, "intermediate_size": moe.d_ff, "sliding_window": None}
    if family.model_type == "gpt_oss":
        return config | {
            "num_local_experts": moe.num_experts,
            "intermediate_size": moe.d_ff,
            "attention_bias": True,
            # NOTE: transformers' gpt-oss builds a windowed mask whatever layer_types says: a model with
            # every block full gets its context as the window, which no sequence exceeds.
            "sliding_window": model.sliding_window or model.context_length,
            "layer_types": layer_types_of(model.n_layers, model.full_attention_every if model.sliding_window else 1),
            "swiglu_alpha": moe.swiglu_alpha,
            "swiglu_limit": moe.swiglu_limit,
        }
    dense = [i for i in range(model.n_layers) if i not in model.moe_layers()]
    if family.model_type == "qwen3_moe":
        return config | {
            "num_experts": moe.num_experts,
            "moe_intermediate_size": moe.d_ff,
            "norm_topk_prob": moe.normalize_topk or not moe.softmax_before_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense,
            "attention_bias": model.qkv_bias,
            "use_sliding_window": bool(model.sliding_window),
            # NOTE: transformers' gpt-oss builds a windowed mask whatever layer_types says: a model with
            # every block full gets its context as the window, which no sequence exceeds.
            "sliding_window": model.sliding_window or model.context_length,
        }
    return config | {
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.d_ff,
        "shared_expert_intermediate_size": moe.shared_hidden,
        "norm_topk_prob": moe.normalize_topk or not moe.softmax_before_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "qkv_bias": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model.n_layers,
    }
