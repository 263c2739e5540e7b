"""Hugging Face checkpoints in and out: configs mapped (``hf_config``), tensors joined or split (``keymap``).

Families read: Mixtral, Qwen2-MoE (shared expert with its own sigmoid gate), OLMoE (q/k norm),
Qwen3-MoE (per-head q/k norm, own head size, dense blocks), gpt-oss (sinks, sliding windows, biases,
clamped SwiGLU, YaRN), and the dense Llama, Mistral and Qwen2 (for upcycling). Written: Mixtral, or
Qwen2-MoE when the model has shared experts, dense blocks or q/k/v biases, Qwen3-MoE for per-head
q/k norms, gpt-oss for its features (``export_family``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from moekit.config import ModelConfig, MoEConfig
from moekit.convert.errors import ConversionError
from moekit.convert.export_fill import fill_for_family
from moekit.convert.hf_config import export_family, hf_config
from moekit.convert.keymap import Family, inert, rules, split
from moekit.convert.stream import HFCheckpoint, open_hf
from moekit.fileio import write_bytes_atomic
from moekit.model import Transformer
from moekit.run.load import ExpertsLoaded, ExpertTracker, materialise


def from_hf(path: Path, dtype: torch.dtype | None = None) -> Transformer:
    """A moekit model holding the weights of a local Hugging Face directory, in ``dtype`` (default: the
    checkpoint's own).

    ``model.cfg`` and ``model.moe_cfg`` describe it; every checkpoint tensor must be used, so a
    feature moekit lacks (an output bias, say) is an error rather than silently dropped.
    """
    return load_hf(open_hf(path, dtype))


def load_hf(
    checkpoint: HFCheckpoint, for_inference: bool = False, experts_loaded: ExpertsLoaded | None = None
) -> Transformer:
    """The model of a checked checkpoint: allocated without random init, filled one tensor (one expert)
    at a time. ``for_inference``: its experts in inference's layout (``run.load.materialise``).
    ``experts_loaded``: each MoE layer as soon as its experts are read (``run.load.ExpertTracker``)."""
    with torch.device("meta"):
        model = Transformer(checkpoint.model_cfg, checkpoint.moe_cfg)
    state = materialise(model, checkpoint.dtype, "cpu", for_inference).state_dict()
    tracker = ExpertTracker(model, state, experts_loaded) if experts_loaded is not None else None
    with torch.no_grad():
        for name, rows, piece in checkpoint.pieces():
            state[name][rows].copy_(piece)
            if tracker is not None:
                tracker.filled(name, rows)
    return model.eval()


def to_hf(model: Transformer, out: Path, dtype: torch.dtype | None = None) -> Family:
    """Write ``model`` as a Hugging Face directory (config.json, model.safetensors); return its family.
    ``dtype``: of the written weights (default: the model's own, so a bf16 run stays bf16).

    Qwen2-MoE always has query/key/value biases and a sigmoid gate on its shared expert: a model
    without them is written with zero biases, and with a zero gate (sigmoid 0.5) in front of a
    shared expert whose output projection is doubled, which computes the same function. A model
    without shared experts gets one of width 0 (it outputs zeros).
    """
    from safetensors.torch import save

    dtype = dtype or model.embed.weight.dtype
    model_cfg, moe_cfg = model.cfg, model.moe_cfg
    family = export_family(model_cfg, moe_cfg)
    assert moe_cfg is not None
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    if family.model_type == "qwen2_moe":
        state, model_cfg, moe_cfg = _as_qwen2_moe(state, model_cfg, moe_cfg)
    if family.model_type in ("qwen3_moe", "gpt_oss"):
        state, model_cfg, moe_cfg = fill_for_family(family.model_type, state, model_cfg, moe_cfg)
    table = rules(family, model_cfg, moe_cfg)
    tied = {"lm_head.weight"} if model_cfg.tie_embeddings else set()
    _refuse_unwritten(family, state, {rule.native for rule in table} | tied)
    tensors: dict[str, Tensor] = {}
    for rule in table:
        tensors.update(split(rule, state[rule.native]))
    tensors |= {key: torch.zeros(shape) for key, shape in inert(family, model_cfg, moe_cfg).items()}
    tensors = {key: t.to(dtype) for key, t in tensors.items()}
    out = Path(out)
    fields = hf_config(family, model_cfg, moe_cfg) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    write_bytes_atomic(out / "config.json", (json.dumps(fields, indent=2) + "\n").encode())
    write_bytes_atomic(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    return family


def _as_qwen2_moe(
    state: dict[str, Tensor], model: ModelConfig, moe: MoEConfig
) -> tuple[dict[str, Tensor], ModelConfig, MoEConfig]:
    """The same function with the q/k/v biases and shared-expert gate Qwen2-MoE always has."""
    state = dict(state)
    head_dim = model.head_size
    for i in range(model.n_layers):
        if not model.qkv_bias:
            state[f"blocks.{i}.attn.qkv.bias"] = torch.zeros((model.n_heads + 2 * model.kv_heads) * head_dim)
        if i in model.moe_layers() and moe.num_shared_experts and not moe.shared_expert_gate:
            state[f"blocks.{i}.ffn.shared_gate.weight"] = torch.zeros(1, model.d_model)
            state[f"blocks.{i}.ffn.shared.w_out.weight"] = 2 * state[f"blocks.{i}.ffn.shared.w_out.weight"]
    shared_gate = moe.num_shared_experts > 0
    return state, replace(model, qkv_bias=True), replace(moe, shared_expert_gate=shared_gate)


def _refuse_unwritten(family: Family, state: dict[str, Tensor], written: set[str]) -> None:
    """An error naming a tensor of the model that no rule writes: the family has no place for it, and
    dropping it would change what the model computes. Aux-loss-free balancing's selection bias
    (``router.expert_bias``, stored only by DeepSeek-V3) may be left out while it is zero."""
    for name in sorted(state.keys() - written):
        if name.endswith(".router.expert_bias"):
            if state[name].any():
                raise ConversionError(
                    f"{family.architecture}: {name} is nonzero (aux-loss-free balancing's selection bias), "
                    f"and {family.architecture} has no place for it"
                )
            continue
        raise ConversionError(f"{family.architecture}: {name} has no place in {family.architecture}")
