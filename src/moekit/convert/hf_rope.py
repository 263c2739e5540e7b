"""RoPE in a Hugging Face ``config.json`` to moekit's fields and back: plain, or YaRN as transformers
computes it (its DeepSeek form included: ``mscale`` and ``mscale_all_dim``)."""

from __future__ import annotations

from typing import Any

from moekit.config import ModelConfig
from moekit.convert.errors import unfit
from moekit.model.rope import yarn_gain

DEFAULT_THETA = 10000.0  # transformers' PreTrainedConfig.default_theta


def hf_rope_parameters(hf: dict[str, Any], default: dict[str, Any] | None = None) -> dict[str, Any]:
    """The RoPE parameters transformers 5 builds its model with (``convert_rope_params_to_dict``).

    ``rope_scaling`` (the older name) replaces ``rope_parameters`` outright, whatever the latter says;
    the top-level ``rope_theta`` and ``partial_rotary_factor`` count only where those parameters leave
    them out. A family's default theta reaches here as a top-level ``rope_theta`` (``_HF_DEFAULTS``).
    """
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or default or {})
    params.setdefault("rope_theta", hf.get("rope_theta", DEFAULT_THETA))
    if hf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return params


def rope_from_hf(hf: dict[str, Any], default: dict[str, Any] | None = None, mla: bool = False) -> dict[str, Any]:
    """moekit's RoPE fields for the config's RoPE (``default``: the family's when the config has none).

    transformers scales YaRN's cos and sin by ``attention_factor`` or, given both mscales,
    ``yarn_gain(mscale) / yarn_gain(mscale_all_dim)``, else ``yarn_gain(1)``; DeepSeek's attention
    (``mla``) also puts ``yarn_gain(mscale_all_dim)`` squared on its softmax scale.
    """
    model_type = hf["model_type"]
    params = hf_rope_parameters(hf, default)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params["rope_theta"])
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise unfit(model_type, f"partial_rotary_factor {params['partial_rotary_factor']}")
    if rope_type == "default":
        return dict(rope_theta=theta)
    if rope_type != "yarn":
        raise unfit(model_type, f"rope_type {rope_type!r} (moekit has plain RoPE and YaRN)")
    original = params.get("original_max_position_embeddings")
    if not original:
        raise unfit(model_type, "YaRN without original_max_position_embeddings")
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim") or 0.0
    gains: dict[str, float] = {}
    if mla:
        if mscale_all and not mscale:
            raise unfit(model_type, f"rope mscale {mscale!r} with mscale_all_dim {mscale_all}")
        # transformers reads mscale only beside mscale_all_dim; alone, the gain is that of mscale 1
        gains = dict(rope_mscale=float(mscale) if mscale_all else 1.0, rope_mscale_all_dim=float(mscale_all))
    elif attention is None and mscale and mscale_all:
        attention = yarn_gain(factor, mscale) / yarn_gain(factor, mscale_all)
    return dict(
        rope_theta=theta,
        rope_scaling="yarn",
        rope_factor=float(factor),
        rope_original_context=int(original),
        rope_beta_fast=float(params.get("beta_fast") or 32.0),
        rope_beta_slow=float(params.get("beta_slow") or 1.0),
        rope_truncate=bool(params.get("truncate", True)),
        rope_attention_factor=None if attention is None else float(attention),
        **gains,
    )


def rope_to_hf(model: ModelConfig) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for moekit's RoPE fields (inverse of ``rope_from_hf``)."""
    if model.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": model.rope_theta}
    rope = {
        "rope_type": "yarn",
        "rope_theta": model.rope_theta,
        "factor": model.rope_factor,
        "original_max_position_embeddings": model.rope_original_context,
        "beta_fast": model.rope_beta_fast,
        "beta_slow": model.rope_beta_slow,
        "truncate": model.rope_truncate,
        "attention_factor": model.rope_attention_factor,
    }
    if model.attention == "mla":
        rope |= {"mscale": model.rope_mscale, "mscale_all_dim": model.rope_mscale_all_dim}
    return rope
