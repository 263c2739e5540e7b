"""The key map between moekit's and Hugging Face's tensor names, for both directions.

One table of ``Rule`` s: each native tensor is the concatenation (rows) of one or more Hugging Face
tensors, per expert and transposed to ``[in, out]`` for routed experts. Hugging Face tensor names
live in this module only.

Legend: E experts, D model dim, F expert hidden dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from moekit.config import ModelConfig, MoEConfig


@dataclass(frozen=True)
class Family:
    """Where one Hugging Face architecture keeps its tensors."""

    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"[0]
    moe: bool  # routed experts (else a dense model, read for upcycling)
    mlp: str  # module holding each block's MLP or MoE
    expert: tuple[str, str, str]  # names of an expert's gate, up and down projections ("": fused, gpt-oss)
    shared: str = "shared_expert"  # module holding the shared experts (under ``mlp``)
    expert_bias: bool = False  # the router's selection bias is stored (DeepSeek-V3's e_score_correction_bias)
    rope_halves: bool = False  # MLA's RoPE dims pair (x[j], x[j + d/2]) (DeepSeek-V3 with rope_interleave false)


_PROJ = ("gate_proj", "up_proj", "down_proj")
FAMILIES = {
    f.model_type: f
    for f in (
        Family("mixtral", "MixtralForCausalLM", True, "block_sparse_moe", ("w1", "w3", "w2")),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", True, "mlp", _PROJ),
        Family("olmoe", "OlmoeForCausalLM", True, "mlp", _PROJ),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", True, "mlp", _PROJ),
        Family("gpt_oss", "GptOssForCausalLM", True, "mlp", ("", "", "")),
        Family("deepseek_v2", "DeepseekV2ForCausalLM", True, "mlp", _PROJ, "shared_experts"),
        Family("deepseek_v3", "DeepseekV3ForCausalLM", True, "mlp", _PROJ, "shared_experts", expert_bias=True),
        Family("llama", "LlamaForCausalLM", False, "mlp", _PROJ),
        Family("mistral", "MistralForCausalLM", False, "mlp", _PROJ),
        Family("qwen2", "Qwen2ForCausalLM", False, "mlp", _PROJ),
    )
}


@dataclass(frozen=True)
class Part:
    key: str  # Hugging Face tensor name; "{e}" stands for the expert index
    rows: int  # rows it fills in the (per-expert, [out, in]) native tensor
    rope_heads: int = 0  # >0: query/key rows of this many heads, reordered for RoPE
    rope_tail: int = 0  # >0: only the last this many rows of each head are reordered (MLA's RoPE dims)


@dataclass(frozen=True)
class Rule:
    native: str  # moekit tensor name
    parts: tuple[Part, ...]  # concatenated along rows
    experts: int = 0  # >0: one [out, in] matrix per expert, transposed and stacked to [E, in, out]
    groups: int = 0  # >0: the parts interleave in this many row groups (moekit's per-kv-group qkv)
    gate_up: bool = False  # the one part's last dim alternates gate and up (gpt-oss); moekit's has gates first


def interleave_rope(w: Tensor, heads: int, tail: int = 0) -> Tensor:
    """Per head, rows (a_0..a_{h/2-1}, b_0..b_{h/2-1}) -> (a_0, b_0, a_1, b_1, ...).

    Hugging Face rotates the pair (x[j], x[j + h/2]) ("rotate_half"), moekit the pair (x[2j], x[2j+1])
    (complex RoPE); both by the angle of frequency j, so reordering the query and key rows makes
    the two compute the same attention scores (as gpt-fast's Llama conversion does, reversed).
    ``tail`` > 0 reorders only each head's last ``tail`` rows (MLA rotates those alone).
    """
    return _reorder_rope(w, heads, tail, (2, -1))


def deinterleave_rope(w: Tensor, heads: int, tail: int = 0) -> Tensor:
    """The inverse of ``interleave_rope``: moekit's row order back to Hugging Face's."""
    return _reorder_rope(w, heads, tail, (-1, 2))


def _reorder_rope(w: Tensor, heads: int, tail: int, split: tuple[int, int]) -> Tensor:
    per_head = w.reshape(heads, -1, *w.shape[1:])
    rest, rope = per_head.split([per_head.shape[1] - tail, tail] if tail else [0, per_head.shape[1]], dim=1)
    rope = rope.unflatten(1, split).transpose(1, 2).flatten(1, 2)
    return concatenate([rest, rope], dim=1).reshape(w.shape)


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
    head_dim = model.head_size
    q_rows, kv_rows = model.n_heads * head_dim, model.kv_heads * head_dim
    table = [Rule("embed.weight", (Part("model.embed_tokens.weight", model.vocab_size),))]
    for i in range(model.n_layers):
        n, h = f"blocks.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        table.append(Rule(n + "attn_norm.weight", (Part(h + "input_layernorm.weight", model.d_model),)))
        table.append(Rule(n + "ffn_norm.weight", (Part(h + "post_attention_layernorm.weight", model.d_model),)))
        if model.attention == "mla":
            table += _mla_rules(n + "attn.", attn, model, family.rope_halves)
        for kind in ("weight", "bias") if model.qkv_bias else ("weight",) * (model.attention == "mha"):
            q = Part(f"{attn}q_proj.{kind}", q_rows, model.n_heads)
            k = Part(f"{attn}k_proj.{kind}", kv_rows, model.kv_heads)
            v = Part(f"{attn}v_proj.{kind}", kv_rows)
            table.append(Rule(f"{n}attn.qkv.{kind}", (q, k, v), groups=model.kv_heads))
        table.append(Rule(n + "attn.out.weight", (Part(attn + "o_proj.weight", model.d_model),)))
        if model.attn_out_bias:
            table.append(Rule(n + "attn.out.bias", (Part(attn + "o_proj.bias", model.d_model),)))
        if model.attn_sinks:
            table.append(Rule(n + "attn.sinks", (Part(attn + "sinks", model.n_heads),)))
        if model.qk_norm or model.qk_head_norm:  # one head's weight when per head (its RoPE order too)
            q_width, k_width = (head_dim, head_dim) if model.qk_head_norm else (q_rows, kv_rows)
            q_heads, k_heads = (1, 1) if model.qk_head_norm else (model.n_heads, model.kv_heads)
            table.append(Rule(n + "attn.qk_norm.q.weight", (Part(attn + "q_norm.weight", q_width, q_heads),)))
            table.append(Rule(n + "attn.qk_norm.k.weight", (Part(attn + "k_norm.weight", k_width, k_heads),)))
        layer_moe = _moe_at(model, moe, i)
        mlp = h + family.mlp + "."
        if layer_moe is None:
            table += _ffn_rules(n + "ffn.", mlp, _PROJ, model.d_ff, model.d_model)
            continue
        f, e = layer_moe.d_ff, layer_moe.num_experts
        router = mlp + ("router." if family.model_type == "gpt_oss" else "gate.")
        table.append(Rule(n + "ffn.router.gate.weight", (Part(router + "weight", e),)))
        if layer_moe.router_bias:
            table.append(Rule(n + "ffn.router.gate.bias", (Part(router + "bias", e),)))
        if family.expert_bias:
            table.append(Rule(n + "ffn.router.expert_bias", (Part(mlp + "gate.e_score_correction_bias", e),)))
        if family.model_type == "gpt_oss":
            table += _fused_expert_rules(n + "ffn.experts.", mlp + "experts.", e)
        else:
            gate, up, down = (f"{mlp}experts.{{e}}.{name}.weight" for name in family.expert)
            table.append(Rule(n + "ffn.experts.w_in", (Part(gate, f), Part(up, f)), experts=e))
            table.append(Rule(n + "ffn.experts.w_out", (Part(down, model.d_model),), experts=e))
        if layer_moe.num_shared_experts:
            shared_ff = layer_moe.shared_hidden
            table += _ffn_rules(n + "ffn.shared.", f"{mlp}{family.shared}.", _PROJ, shared_ff, model.d_model)
        if layer_moe.shared_expert_gate:
            table.append(Rule(n + "ffn.shared_gate.weight", (Part(mlp + "shared_expert_gate.weight", 1),)))
    table.append(Rule("norm.weight", (Part("model.norm.weight", model.d_model),)))
    if not model.tie_embeddings:
        table.append(Rule("lm_head.weight", (Part("lm_head.weight", model.vocab_size),)))
    return table


def _fused_expert_rules(native: str, hf: str, num_experts: int) -> list[Rule]:
    """gpt-oss's experts: stacked ``[E, in, out]`` already, gate and up interleaved, with biases."""
    return [
        Rule(native + "w_in", (Part(hf + "gate_up_proj", num_experts),), gate_up=True),
        Rule(native + "w_in_bias", (Part(hf + "gate_up_proj_bias", num_experts),), gate_up=True),
        Rule(native + "w_out", (Part(hf + "down_proj", num_experts),)),
        Rule(native + "w_out_bias", (Part(hf + "down_proj_bias", num_experts),)),
    ]


def _mla_rules(native: str, hf: str, model: ModelConfig, rope_halves: bool) -> list[Rule]:
    """Multi-head latent attention (DeepSeek-V2/V3): the query path (low-rank or one projection), the
    key/value latent with its shared RoPE key, and the latent's expansion into per-head keys and values."""
    heads, rope = model.n_heads, model.qk_rope_head_dim or 0
    q_rows = heads * ((model.qk_nope_head_dim or 0) + rope)
    reorder = rope if rope_halves else 0  # rope dims to reorder, at the end of each head

    def one(name: str, key: str, rows: int, rope_heads: int = 0) -> Rule:
        return Rule(native + name, (Part(hf + key, rows, rope_heads if reorder else 0, reorder if rope_heads else 0),))

    if model.q_lora_rank:
        table = [one("q_down.weight", "q_a_proj.weight", model.q_lora_rank)]
        table.append(one("q_norm.weight", "q_a_layernorm.weight", model.q_lora_rank))
        table.append(one("q_up.weight", "q_b_proj.weight", q_rows, heads))
    else:
        table = [one("q_proj.weight", "q_proj.weight", q_rows, heads)]
    rank = model.kv_lora_rank or 0
    table.append(one("kv_down.weight", "kv_a_proj_with_mqa.weight", rank + rope, 1))
    table.append(one("kv_norm.weight", "kv_a_layernorm.weight", rank))
    kv_rows = heads * ((model.qk_nope_head_dim or 0) + (model.v_head_dim or 0))
    table.append(one("kv_up.weight", "kv_b_proj.weight", kv_rows))
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
            parts.append(interleave_rope(t, part.rope_heads, part.rope_tail) if part.rope_heads else t)
        if rule.groups:
            return concatenate([p.unflatten(0, (rule.groups, -1)) for p in parts], dim=1).flatten(0, 1)
        return concatenate(parts)

    if rule.gate_up:
        t = matrix(0)
        return concatenate([t[..., 0::2], t[..., 1::2]], dim=-1)
    if not rule.experts:
        return matrix(0)
    if rule.experts == 1:  # one expert of a stream: a view, so copying it into place transposes once at most
        return matrix(0).t().unsqueeze(0)
    return concatenate([matrix(e).t().unsqueeze(0) for e in range(rule.experts)])


def concatenate(parts: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat`` (one part: itself), as one allocation and a copy per part. On the meta device, where
    a load first checks every joined shape, ``torch.cat`` and ``torch.stack`` run torch's Python
    references, whose first call imports torch._dynamo: a second of every load."""
    if len(parts) == 1:
        return parts[0]
    dim %= parts[0].dim()
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = parts[0].new_empty(shape)
    start = 0
    for p in parts:
        out.narrow(dim, start, p.shape[dim]).copy_(p)
        start += p.shape[dim]
    return out


def split(rule: Rule, tensor: Tensor) -> dict[str, Tensor]:
    """The Hugging Face tensors of ``rule`` cut from its native tensor (the inverse of ``join``)."""
    if rule.gate_up:
        gate, up = tensor.chunk(2, dim=-1)
        return {rule.parts[0].key: torch.stack([gate, up], dim=-1).flatten(-2).contiguous()}
    out: dict[str, Tensor] = {}
    for expert in range(rule.experts or 1):
        matrix = tensor[expert].t() if rule.experts else tensor
        if rule.groups:
            grouped = matrix.unflatten(0, (rule.groups, -1))
            pieces = [g.flatten(0, 1) for g in grouped.split([p.rows // rule.groups for p in rule.parts], dim=1)]
        else:
            pieces = matrix.split([p.rows for p in rule.parts])
        for part, piece in zip(rule.parts, pieces, strict=True):
            piece = deinterleave_rope(piece, part.rope_heads, part.rope_tail) if part.rope_heads else piece
            out[part.key.format(e=expert)] = piece.contiguous().clone()
    return out


def expert_rule(rule: Rule, expert: int) -> Rule:
    """The rule of expert ``expert``'s slice ``[1, in, out]`` of a stacked expert tensor: ``join`` of it
    reads that expert's tensors only (conversion streams a layer's experts one at a time)."""
    parts = tuple(replace(p, key=p.key.format(e=expert)) for p in rule.parts)
    return replace(rule, parts=parts, experts=1)
