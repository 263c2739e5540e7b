"""A Hugging Face checkpoint read in place for offloaded inference: where each routed expert's matrices
are in the shard files (for the expert store to read by byte range), and which layouts allow it.

Families that keep one matrix per expert and projection (Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE,
DeepSeek-V2/V3) do: expert e's gate, up and down projections are three byte ranges, stored
``[out, in]``, which the store reads side by side and uses transposed (the key map's only transform
of them). gpt-oss stacks all experts in one tensor with gate and up interleaved column by column
(``gate_up_proj``): an expert's ``w_in`` is not its bytes in any order a view can undo, so it is
refused, naming the layout, rather than computed wrong.
"""

from __future__ import annotations

from pathlib import Path

from moekit.convert.errors import ConversionError
from moekit.convert.stream import HFCheckpoint
from moekit.run.safetensors_io import Entry

Ranges = dict[str, list[tuple[Path, Entry]]]  # role (w_in, w_out) -> its matrices, concatenated along rows
_ROLES = ("w_in", "w_out")


def expert_ranges(checkpoint: HFCheckpoint) -> dict[tuple[int, int], Ranges]:
    """{(block, expert): {role: [(shard file, tensor entry), ...]}} for every routed expert.

    Raises ``ConversionError`` naming the layout when an expert's weights are not separate matrices.
    """
    source, out = checkpoint.source, {}
    for rule in checkpoint.rules:
        role = rule.native.rsplit(".", 1)[-1]
        if ".ffn.experts." not in rule.native or role not in _ROLES:
            continue
        if not rule.experts or rule.groups or any(p.rope_heads for p in rule.parts):
            raise ConversionError(
                f"{checkpoint.path}: {checkpoint.family.model_type} stores all experts in one tensor "
                f"({rule.parts[0].key}{', gate and up interleaved' if rule.gate_up else ''}): its experts "
                f"cannot be read in place; convert it first (moekit convert)"
            )
        block = int(rule.native.split(".")[1])
        for e in range(rule.experts):
            keys = [part.key.format(e=e) for part in rule.parts]
            for key in keys:
                source.meta(key)  # a missing tensor is named
            out.setdefault((block, e), {})[role] = [(source.files[k], source.entries[k]) for k in keys]
    return out
