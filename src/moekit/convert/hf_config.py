"""Hugging Face ``config.json`` to moekit's configs and back, for the families ``keymap`` knows.

Anything a config sets that moekit's model cannot express is a ``ConversionError`` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moekit.config import ModelConfig, MoEConfig
from moekit.convert import deepseek
from moekit.convert.errors import ConversionError
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


def _unfit(family: Family, what: str) -> ConversionError:
    return ConversionError(f"{family.model_type}: {what} does not fit moekit's model")


def _rope_theta(family: Family, hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise _unfit(family, f"rope_type {rope_type!r} (only plain RoPE)")
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _moe_pattern(family: Family, n_layers: int, moe_layers: list[int]) -> tuple[int, int]:
    """(first_dense_layers, moe_every) placing MoE blocks exactly at ``moe_layers``."""
    for first in range(n_layers):
        for every in range(1, n_layers + 1):
            cfg_layers = [i for i in range(first, n_layers) if (i - first) % every == 0]
            if cfg_layers == moe_layers:
                return first, every
    raise _unfit(family, f"MoE blocks at layers {moe_layers} (moekit places them every n-th block)")


def _qkv_bias(family: Family, hf: dict[str, Any]) -> bool:
    """Whether transformers builds this config's query/key/value projections with biases."""
    if family.model_type in ("llama", "olmoe") and hf.get("attention_bias"):
        raise _unfit(family, "attention_bias=True (it also biases o_proj, which moekit's attention lacks)")
    if family.model_type == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))  # transformers 5 reads the field; earlier versions always biased
    return family.model_type == "qwen2"


# transformers' router_aux_loss_coef when config.json leaves it out
_HF_AUX_COEF = {"mixtral": 0.001, "qwen2_moe": 0.001, "olmoe": 0.01}


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


def configs_from_hf(hf: dict[str, Any]) -> tuple[ModelConfig, MoEConfig | None]:
    """moekit's model and MoE configs for a Hugging Face config, built as transformers builds its model.

    The checkpoint's tensors must then fit: one transformers would ignore, or initialise at random
    because it is missing, is an error in ``from_hf``.
    """
    family = family_of(hf)
    if family.model_type in deepseek.FAMILIES:
        return deepseek.configs_from_hf(hf)
    d_model, n_heads, n_layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    if hf.get("hidden_act", "silu") != "silu":
        raise _unfit(family, f"hidden_act {hf['hidden_act']!r} (SwiGLU experts use silu)")
    if hf.get("head_dim") not in (None, d_model // n_heads):
        raise _unfit(family, f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
    if hf.get("clip_qkv") is not None:
        raise _unfit(family, f"clip_qkv {hf['clip_qkv']}")
    context = hf.get("max_position_embeddings", 2048)
    windowed = hf.get("use_sliding_window", family.model_type in ("mistral", "mixtral"))
    window = hf.get("sliding_window") if windowed else None
    if window:  # attention over a window equals full attention on sequences no longer than it
        context = min(context, window)
    model = dict(
        vocab_size=hf["vocab_size"],
        context_length=context,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_model=d_model,
        d_ff=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta(family, hf),
        qkv_bias=_qkv_bias(family, hf),
        qk_norm=family.model_type == "olmoe",
        moe_every=0,
    )
    if not family.moe:
        return ModelConfig(**model), None
    num_experts = hf.get("num_local_experts") or hf["num_experts"]
    top_k = hf["num_experts_per_tok"]
    normalize = bool(hf.get("norm_topk_prob", family.model_type == "mixtral"))
    if top_k == 1 and normalize:
        raise _unfit(family, "top-1 routing with a renormalised weight of 1 (moekit keeps the router's probability)")
    d_ff = hf["moe_intermediate_size"] if family.model_type == "qwen2_moe" else hf["intermediate_size"]
    moe = dict(d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=top_k, normalize_topk=normalize)
    moe_layers = list(range(n_layers))
    if family.model_type == "qwen2_moe":
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        moe_layers = [i for i in moe_layers if i not in dense and (i + 1) % step == 0]
        shared = hf["shared_expert_intermediate_size"]
        if not isinstance(shared, int) or shared < 0:
            raise _unfit(family, f"shared_expert_intermediate_size {shared!r} (must be an integer >= 0)")
        if shared:  # one gated shared expert of its own width; 0: none (it would output zeros)
            moe.update(num_shared_experts=1, shared_d_ff=shared, shared_expert_gate=True)
    if not moe_layers:
        raise _unfit(family, "no MoE blocks (mlp_only_layers and decoder_sparse_step leave every block dense)")
    hf_coef = hf.get("router_aux_loss_coef", _HF_AUX_COEF[family.model_type])
    if not isinstance(hf_coef, (int, float)) or hf_coef < 0:
        raise _unfit(family, f"router_aux_loss_coef {hf_coef!r} (must be a number >= 0)")
    moe["aux_loss_coef"] = aux_coef_from_hf(hf_coef, top_k, len(moe_layers))
    model["first_dense_layers"], model["moe_every"] = _moe_pattern(family, n_layers, moe_layers)
    return ModelConfig(**model), MoEConfig(**moe)


def export_family(model: ModelConfig, moe: MoEConfig | None) -> Family:
    """Mixtral, or Qwen2-MoE for shared experts or dense blocks; an error names what does not fit."""
    if moe is None or not model.moe_layers():
        raise ConversionError(
            "model.moe_every=0: a dense model fits no MoE family (export writes Mixtral, Qwen2-MoE or DeepSeek)"
        )
    if model.attention == "mla":
        return FAMILIES[deepseek.export_family(model, moe)]
    # Mixtral has no q/k/v biases (transformers would drop them), no shared experts and no dense blocks.
    needs_qwen = model.qkv_bias or moe.num_shared_experts or model.first_dense_layers or model.moe_every != 1
    family = FAMILIES["qwen2_moe" if needs_qwen else "mixtral"]
    misfits = {
        "model.norm": (model.norm, "rmsnorm"),
        "model.mlp_activation": (model.mlp_activation, "swiglu"),
        "moe.activation": (moe.activation, "swiglu"),
        "moe.router": (moe.router, "topk"),
        "moe.score_func": (moe.score_func, "softmax"),
        "moe.route_scale": (moe.route_scale, 1.0),
        "moe.capacity_factor": (moe.capacity_factor, None),
        "moe.residual": (moe.residual, False),
        "moe.bias_update_rate": (moe.bias_update_rate, 0.0),
        "model.experts_per_layer": (model.experts_per_layer, None),
        "model.qk_norm": (model.qk_norm, False),
        "moe.n_group": (moe.n_group, 1),
        "model.rope_yarn_factor": (model.rope_yarn_factor, 1.0),
    }
    for field, (value, needed) in misfits.items():
        if value != needed:
            raise ConversionError(f"{family.architecture}: {field}={value!r} does not fit (it needs {needed!r})")
    if family.model_type == "mixtral" and moe.softmax_before_topk and not moe.normalize_topk and moe.top_k > 1:
        raise ConversionError(f"{family.architecture}: moe.normalize_topk=False does not fit (Mixtral renormalises)")
    if moe.top_k == 1:
        raise ConversionError(f"{family.architecture}: moe.top_k=1 does not fit (it renormalises one pick to 1)")
    return family


def hf_config(family: Family, model: ModelConfig, moe: MoEConfig) -> dict[str, Any]:
    if family.model_type in deepseek.FAMILIES:
        return deepseek.hf_config(family.model_type, model, moe)
    eps = model.norm_eps if model.norm_eps is not None else torch.finfo(torch.float32).eps  # nn.RMSNorm's default
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.d_ff,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.d_model // model.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": model.context_length,
        "rms_norm_eps": eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "tie_word_embeddings": model.tie_embeddings,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": aux_coef_to_hf(moe.aux_loss_coef, moe.top_k, len(model.moe_layers())),
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if family.model_type == "mixtral":
        # Mixtral has no dense blocks: its intermediate_size is the width of each expert.
        return config | {"num_local_experts": moe.num_experts, "intermediate_size": moe.d_ff, "sliding_window": None}
    dense = [i for i in range(model.n_layers) if i not in model.moe_layers()]
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
