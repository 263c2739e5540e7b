"""Hugging Face checkpoints in and out: a key map plus the stacking of per-expert weights into [E, ...].

Families read: Mixtral, Qwen2-MoE (shared expert with its own sigmoid gate) and OLMoE (q/k norm),
and the dense Llama, Mistral and Qwen2 (for upcycling). Written: Mixtral, or Qwen2-MoE when the
model has shared experts, dense blocks or q/k/v biases. Hugging Face names live in this file only.

One table of ``Rule`` s serves both directions: each native tensor is the concatenation (rows) of
one or more Hugging Face tensors, per expert and transposed to ``[in, out]`` for routed experts.

Legend: E experts, D model dim, F expert hidden dim.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from moekit.config import ModelConfig, MoEConfig
from moekit.fileio import write_bytes_atomic
from moekit.model import Transformer


class ConversionError(ValueError):
    """A checkpoint or model that does not fit a conversion; the message names the file or family and field."""


@dataclass(frozen=True)
class Family:
    """Where one Hugging Face architecture keeps its tensors."""

    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"[0]
    moe: bool  # routed experts (else a dense model, read for upcycling)
    mlp: str  # module holding each block's MLP or MoE
    expert: tuple[str, str, str]  # names of an expert's gate, up and down projections


_PROJ = ("gate_proj", "up_proj", "down_proj")
FAMILIES = {
    f.model_type: f
    for f in (
        Family("mixtral", "MixtralForCausalLM", True, "block_sparse_moe", ("w1", "w3", "w2")),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", True, "mlp", _PROJ),
        Family("olmoe", "OlmoeForCausalLM", True, "mlp", _PROJ),
        Family("llama", "LlamaForCausalLM", False, "mlp", _PROJ),
        Family("mistral", "MistralForCausalLM", False, "mlp", _PROJ),
        Family("qwen2", "Qwen2ForCausalLM", False, "mlp", _PROJ),
    )
}


# ---------------------------------------------------------------------------------------------
# The key map.


@dataclass(frozen=True)
class Part:
    key: str  # Hugging Face tensor name; "{e}" stands for the expert index
    rows: int  # rows it fills in the (per-expert, [out, in]) native tensor
    rope_heads: int = 0  # >0: query/key rows of this many heads, reordered for RoPE


@dataclass(frozen=True)
class Rule:
    native: str  # moekit tensor name
    parts: tuple[Part, ...]  # concatenated along rows
    experts: int = 0  # >0: one [out, in] matrix per expert, transposed and stacked to [E, in, out]
    groups: int = 0  # >0: the parts interleave in this many row groups (moekit's per-kv-group qkv)


def interleave_rope(w: Tensor, heads: int) -> Tensor:
    """Per head, rows (a_0..a_{h/2-1}, b_0..b_{h/2-1}) -> (a_0, b_0, a_1, b_1, ...).

    Hugging Face rotates the pair (x[j], x[j + h/2]) ("rotate_half"), moekit the pair (x[2j], x[2j+1])
    (complex RoPE); both by the angle of frequency j, so reordering the query and key rows makes
    the two compute the same attention scores (as gpt-fast's Llama conversion does, reversed).
    """
    return w.reshape(heads, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def deinterleave_rope(w: Tensor, heads: int) -> Tensor:
    """The inverse of ``interleave_rope``: moekit's row order back to Hugging Face's."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _moe_at(model: ModelConfig, moe: MoEConfig | None, layer: int) -> MoEConfig | None:
    """The MoE config of block ``layer``, or None for a dense block."""
    layers = model.moe_layers()
    if moe is None or layer not in layers:
        return None
    if model.experts_per_layer:
        return replace(moe, num_experts=model.experts_per_layer[layers.index(layer)])
    return moe


def rules(family: Family, model: ModelConfig, moe: MoEConfig | None) -> list[Rule]:
    """Every native tensor of ``Transformer(model, moe)`` and the Hugging Face tensors it is made of."""
    head_dim = model.d_model // model.n_heads
    q_rows, kv_rows = model.n_heads * head_dim, model.kv_heads * head_dim
    table = [Rule("embed.weight", (Part("model.embed_tokens.weight", model.vocab_size),))]
    for i in range(model.n_layers):
        n, h = f"blocks.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        table.append(Rule(n + "attn_norm.weight", (Part(h + "input_layernorm.weight", model.d_model),)))
        table.append(Rule(n + "ffn_norm.weight", (Part(h + "post_attention_layernorm.weight", model.d_model),)))
        for kind in ("weight", "bias") if model.qkv_bias else ("weight",):
            q = Part(f"{attn}q_proj.{kind}", q_rows, model.n_heads)
            k = Part(f"{attn}k_proj.{kind}", kv_rows, model.kv_heads)
            v = Part(f"{attn}v_proj.{kind}", kv_rows)
            table.append(Rule(f"{n}attn.qkv.{kind}", (q, k, v), groups=model.kv_heads))
        table.append(Rule(n + "attn.out.weight", (Part(attn + "o_proj.weight", model.d_model),)))
        if model.qk_norm:
            table.append(Rule(n + "attn.qk_norm.q.weight", (Part(attn + "q_norm.weight", q_rows, model.n_heads),)))
            table.append(Rule(n + "attn.qk_norm.k.weight", (Part(attn + "k_norm.weight", kv_rows, model.kv_heads),)))
        layer_moe = _moe_at(model, moe, i)
        mlp = h + family.mlp + "."
        if layer_moe is None:
            table += _ffn_rules(n + "ffn.", mlp, _PROJ, model.d_ff, model.d_model)
            continue
        gate, up, down = (f"{mlp}experts.{{e}}.{name}.weight" for name in family.expert)
        f, e = layer_moe.d_ff, layer_moe.num_experts
        table.append(Rule(n + "ffn.router.gate.weight", (Part(mlp + "gate.weight", e),)))
        table.append(Rule(n + "ffn.experts.w_in", (Part(gate, f), Part(up, f)), experts=e))
        table.append(Rule(n + "ffn.experts.w_out", (Part(down, model.d_model),), experts=e))
        if layer_moe.num_shared_experts:
            shared_ff = layer_moe.shared_hidden
            table += _ffn_rules(n + "ffn.shared.", mlp + "shared_expert.", _PROJ, shared_ff, model.d_model)
        if layer_moe.shared_expert_gate:
            table.append(Rule(n + "ffn.shared_gate.weight", (Part(mlp + "shared_expert_gate.weight", 1),)))
    table.append(Rule("norm.weight", (Part("model.norm.weight", model.d_model),)))
    if not model.tie_embeddings:
        table.append(Rule("lm_head.weight", (Part("lm_head.weight", model.vocab_size),)))
    return table


def _ffn_rules(native: str, hf: str, names: tuple[str, str, str], d_ff: int, d_model: int) -> list[Rule]:
    """A SwiGLU MLP: gate, up (moekit's ``w_in``) and down projections."""
    gate, up, down = (f"{hf}{name}.weight" for name in names)
    return [
        Rule(native + "w_gate.weight", (Part(gate, d_ff),)),
        Rule(native + "w_in.weight", (Part(up, d_ff),)),
        Rule(native + "w_out.weight", (Part(down, d_model),)),
    ]


def inert(family: Family, model: ModelConfig, moe: MoEConfig | None) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensors with no moekit counterpart that change nothing, and their shapes.

    Qwen2-MoE always builds a shared expert and its gate; a model without shared experts is one
    whose shared expert has width 0, which outputs zeros whatever its gate holds.
    """
    if family.model_type != "qwen2_moe":
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for i in model.moe_layers():
        layer_moe = _moe_at(model, moe, i)
        if layer_moe is None or layer_moe.num_shared_experts:
            continue
        shared = f"model.layers.{i}.{family.mlp}.shared_expert"
        d = model.d_model
        out |= {f"{shared}.gate_proj.weight": (0, d), f"{shared}.up_proj.weight": (0, d)}
        out |= {f"{shared}.down_proj.weight": (d, 0), f"{shared}_gate.weight": (1, d)}
    return out


def join(rule: Rule, read: Callable[[str], Tensor]) -> Tensor:
    """The native tensor of ``rule`` from the Hugging Face tensors ``read`` returns."""

    def matrix(expert: int) -> Tensor:
        parts = []
        for part in rule.parts:
            t = read(part.key.format(e=expert))
            parts.append(interleave_rope(t, part.rope_heads) if part.rope_heads else t)
        if rule.groups:
            return torch.cat([p.unflatten(0, (rule.groups, -1)) for p in parts], dim=1).flatten(0, 1)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    if not rule.experts:
        return matrix(0)
    return torch.stack([matrix(e).t() for e in range(rule.experts)])


def split(rule: Rule, tensor: Tensor) -> dict[str, Tensor]:
    """The Hugging Face tensors of ``rule`` cut from its native tensor (the inverse of ``join``)."""
    out: dict[str, Tensor] = {}
    for expert in range(rule.experts or 1):
        matrix = tensor[expert].t() if rule.experts else tensor
        if rule.groups:
            grouped = matrix.unflatten(0, (rule.groups, -1))
            pieces = [g.flatten(0, 1) for g in grouped.split([p.rows // rule.groups for p in rule.parts], dim=1)]
        else:
            pieces = matrix.split([p.rows for p in rule.parts])
        for part, piece in zip(rule.parts, pieces, strict=True):
            piece = deinterleave_rope(piece, part.rope_heads) if part.rope_heads else piece
            out[part.key.format(e=expert)] = piece.contiguous().clone()
    return out


# ---------------------------------------------------------------------------------------------
# Reading a Hugging Face directory.


class SafetensorsDir:
    """The tensors of a Hugging Face checkpoint directory (one or many safetensors shards), read lazily."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handles: dict[Path, Any] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise ConversionError(f"{index}: unreadable shard index ({err})") from None
            self.files = {key: self.path / name for key, name in weight_map.items()}
        elif (self.path / "model.safetensors").is_file():
            single = self.path / "model.safetensors"
            self.files = {key: single for key in self._handle(single).keys()}  # noqa: SIM118 (not a dict)
        else:
            raise ConversionError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json (only safetensors are read)"
            )

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error types for a damaged header
                raise ConversionError(f"{file}: unreadable safetensors file ({err})") from None
        return self._handles[file]

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str) -> Tensor:
        if key not in self.files:
            raise ConversionError(f"{self.path}: tensor {key} is missing from the checkpoint")
        return self._handle(self.files[key]).get_tensor(key).float()


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


def from_hf(path: Path) -> Transformer:
    """A moekit model (fp32) holding the weights of a local Hugging Face directory.

    ``model.cfg`` and ``model.moe_cfg`` describe it; every checkpoint tensor must be used, so a
    feature moekit lacks (an output bias, say) is an error rather than silently dropped.
    """
    path = Path(path)
    hf = read_hf_config(path)
    family = family_of(hf)
    checkpoint = SafetensorsDir(path)
    try:
        model_cfg, moe_cfg = configs_from_hf(hf)
    except KeyError as err:
        raise ConversionError(f"{path / 'config.json'}: missing field {err}") from None
    model = Transformer(model_cfg, moe_cfg)
    state = model.state_dict()
    used: set[str] = set()

    def read(key: str) -> Tensor:
        used.add(key)
        return checkpoint.read(key)

    for rule in rules(family, model_cfg, moe_cfg):
        tensor = join(rule, read)
        if tensor.shape != state[rule.native].shape:
            raise ConversionError(
                f"{path}: {rule.parts[0].key} gives {rule.native} shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(state[rule.native].shape)}"
            )
        state[rule.native] = tensor
    for key, shape in inert(family, model_cfg, moe_cfg).items():
        if key in checkpoint:
            t = read(key)
            if 0 in shape and tuple(t.shape) != shape:
                raise ConversionError(f"{path}: {key} has shape {tuple(t.shape)}, the config implies {shape}")
    if model_cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    unused = sorted(k for k in checkpoint.files if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ConversionError(f"{path}: tensors moekit's model has no place for: {', '.join(unused[:4])}")
    model.load_state_dict(state)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Writing a Hugging Face directory.


def export_family(model: ModelConfig, moe: MoEConfig | None) -> Family:
    """Mixtral, or Qwen2-MoE for shared experts or dense blocks; an error names what does not fit."""
    if moe is None or not model.moe_layers():
        raise ConversionError(
            "model.moe_every=0: a dense model fits no MoE family (export writes Mixtral or Qwen2-MoE)"
        )
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
    }
    for field, (value, needed) in misfits.items():
        if value != needed:
            raise ConversionError(f"{family.architecture}: {field}={value!r} does not fit (it needs {needed!r})")
    if family.model_type == "mixtral" and moe.softmax_before_topk and not moe.normalize_topk and moe.top_k > 1:
        raise ConversionError(f"{family.architecture}: moe.normalize_topk=False does not fit (Mixtral renormalises)")
    if moe.top_k == 1:
        raise ConversionError(f"{family.architecture}: moe.top_k=1 does not fit (it renormalises one pick to 1)")
    return family


def _hf_config(family: Family, model: ModelConfig, moe: MoEConfig) -> dict[str, Any]:
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


def to_hf(model: Transformer, out: Path) -> Family:
    """Write ``model`` as a Hugging Face directory (config.json, model.safetensors); return its family.

    Qwen2-MoE always has query/key/value biases and a sigmoid gate on its shared expert: a model
    without them is written with zero biases, and with a zero gate (sigmoid 0.5) in front of a
    shared expert whose output projection is doubled, which computes the same function. A model
    without shared experts gets one of width 0 (it outputs zeros).
    """
    from safetensors.torch import save

    model_cfg, moe_cfg = model.cfg, model.moe_cfg
    family = export_family(model_cfg, moe_cfg)
    assert moe_cfg is not None
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    if family.model_type == "qwen2_moe":
        state, model_cfg, moe_cfg = _as_qwen2_moe(state, model_cfg, moe_cfg)
    tensors: dict[str, Tensor] = {}
    for rule in rules(family, model_cfg, moe_cfg):
        tensors.update(split(rule, state[rule.native]))
    tensors |= {key: torch.zeros(shape) for key, shape in inert(family, model_cfg, moe_cfg).items()}
    out = Path(out)
    config = json.dumps(_hf_config(family, model_cfg, moe_cfg), indent=2) + "\n"
    write_bytes_atomic(out / "config.json", config.encode())
    write_bytes_atomic(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    return family


def _as_qwen2_moe(
    state: dict[str, Tensor], model: ModelConfig, moe: MoEConfig
) -> tuple[dict[str, Tensor], ModelConfig, MoEConfig]:
    """The same function with the q/k/v biases and shared-expert gate Qwen2-MoE always has."""
    state = dict(state)
    head_dim = model.d_model // model.n_heads
    for i in range(model.n_layers):
        if not model.qkv_bias:
            state[f"blocks.{i}.attn.qkv.bias"] = torch.zeros((model.n_heads + 2 * model.kv_heads) * head_dim)
        if i in model.moe_layers() and moe.num_shared_experts and not moe.shared_expert_gate:
            state[f"blocks.{i}.ffn.shared_gate.weight"] = torch.zeros(1, model.d_model)
            state[f"blocks.{i}.ffn.shared.w_out.weight"] = 2 * state[f"blocks.{i}.ffn.shared.w_out.weight"]
    shared_gate = moe.num_shared_experts > 0
    return state, replace(model, qkv_bias=True), replace(moe, shared_expert_gate=shared_gate)
