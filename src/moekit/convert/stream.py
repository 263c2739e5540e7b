"""A Hugging Face checkpoint as moekit's tensors, streamed: the key map's rules make each native tensor
from the Hugging Face tensors it is joined from, one at a time (a stacked expert tensor one expert at a
time), so no model is ever built with weights and memory holds one tensor's worth, whatever the size.

``open_hf`` checks everything before a byte of data is read: every rule joined on meta tensors (the
shard headers' shapes) must give the shape of the meta-device model's state dict, every checkpoint
tensor must be used, and every native tensor made. ``HFCheckpoint.pieces`` then yields the data in
the order of ``entries``: what ``write`` streams into one ``model.safetensors`` and ``from_hf``
copies into an allocated model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moekit.config import ModelConfig, MoEConfig
from moekit.convert import deepseek
from moekit.convert.fp8 import DequantizedDir, block_size_of
from moekit.convert.hf_config import ConversionError, configs_from_hf, family_of, read_hf_config
from moekit.convert.keymap import Family, Rule, expert_rule, inert, join, rules
from moekit.convert.safetensors_dir import SafetensorsDir
from moekit.model import Transformer
from moekit.run.safetensors_io import StreamWriter

# Native buffers no Hugging Face family has, and the value that changes nothing.
_ZERO_BUFFERS = (".router.expert_bias",)  # aux-loss-free balancing's selection bias


@dataclass(frozen=True)
class HFCheckpoint:
    """A checked Hugging Face checkpoint and the native tensors it converts into."""

    path: Path
    family: Family
    model_cfg: ModelConfig
    moe_cfg: MoEConfig | None
    source: SafetensorsDir
    rules: list[Rule]
    dtype: torch.dtype  # of the converted parameters
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]]  # every native tensor, in write order
    num_params: int
    skipped: list[str]  # checkpoint tensors left out on purpose (DeepSeek-V3's multi-token prediction)

    def pieces(self, experts: bool = True) -> Iterator[tuple[str, slice, Tensor]]:
        """(native name, its leading rows this piece fills, the piece), in ``entries`` order: a stacked
        expert tensor one expert at a time (none when ``experts`` is False), every other tensor whole."""
        for rule in self.rules:
            if rule.experts and not experts:
                continue
            if not rule.experts:
                yield rule.native, slice(None), join(rule, self.source.read).to(self.dtype)
                continue
            for e in range(rule.experts):
                yield rule.native, slice(e, e + 1), join(expert_rule(rule, e), self.source.read).to(self.dtype)
        for name, dtype, shape in self.entries[len(self.rules) :]:
            yield name, slice(None), torch.zeros(shape, dtype=dtype)

    def write(self, file: Path) -> tuple[int, str]:
        """Stream the converted tensors into safetensors file ``file``; its (bytes, SHA-256)."""
        writer = StreamWriter(file, self.entries)
        try:
            for name, _, piece in self.pieces():
                writer.write(name, piece)
        except BaseException:
            writer.abort()
            raise
        return writer.close()


def open_hf(path: Path, dtype: torch.dtype | None = None) -> HFCheckpoint:
    """A Hugging Face directory checked for conversion into ``dtype`` (default: the checkpoint's own).

    Every checkpoint tensor must be used, so a feature moekit lacks (an output bias, say) is an error
    rather than silently dropped; a shape that does not fit names the tensor.
    """
    path = Path(path)
    hf = read_hf_config(path)
    try:
        family = family_of(hf)
        block = block_size_of(hf)
        model_cfg, moe_cfg = configs_from_hf(hf)
    except ConversionError:
        raise
    except KeyError as err:
        raise ConversionError(f"{path / 'config.json'}: missing field {err}") from None
    except (TypeError, AttributeError, ValueError) as err:  # a field (or the whole file) of the wrong type
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise ConversionError(f"{path / 'config.json'}: a field of the wrong type or value ({first_line})") from None
    source = SafetensorsDir(path) if block is None else DequantizedDir(path, block)
    with torch.device("meta"):
        meta = Transformer(model_cfg, moe_cfg)
    state = meta.state_dict()
    table = rules(family, model_cfg, moe_cfg)
    used: set[str] = set()

    def shape_of(key: str) -> Tensor:
        used.add(key)
        return source.meta(key)

    for rule in table:
        shape = tuple(join(rule, shape_of).shape)
        if shape != state[rule.native].shape:
            raise ConversionError(
                f"{path}: {rule.parts[0].key} gives {rule.native} shape {shape}, "
                f"the config implies {tuple(state[rule.native].shape)}"
            )
    for key, shape in inert(family, model_cfg, moe_cfg).items():
        if key in source:
            got = tuple(shape_of(key).shape)
            if 0 in shape and got != shape:
                raise ConversionError(f"{path}: {key} has shape {got}, the config implies {shape}")
    mtp = deepseek.mtp_prefixes(hf) if family.model_type in deepseek.FAMILIES else ()
    skipped = sorted(k for k in source.files if mtp and k.startswith(mtp))
    unused = sorted(
        k for k in source.files if k not in used and k not in skipped and not k.endswith("rotary_emb.inv_freq")
    )
    if unused:
        raise ConversionError(f"{path}: tensors moekit's model has no place for: {', '.join(unused[:4])}")
    dtype = dtype or source.dtype()
    made = {rule.native for rule in table} | ({"lm_head.weight"} if model_cfg.tie_embeddings else set())
    zeros = [name for name in state if name not in made]
    assert all(name.endswith(_ZERO_BUFFERS) for name in zeros), f"no rule makes {zeros}"
    entries = [(rule.native, dtype, tuple(state[rule.native].shape)) for rule in table]
    entries += [(name, state[name].dtype, tuple(state[name].shape)) for name in zeros]
    return HFCheckpoint(path, family, model_cfg, moe_cfg, source, table, dtype, entries, meta.num_params(), skipped)
