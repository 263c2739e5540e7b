"""Another run's weights (``train(init=...)``) into a model whose experts are offloaded, never the whole
expert set in RAM: each tensor of its ``model.safetensors`` read alone (``pread``, no map: a map's
touched pages would stay resident), each MoE layer's experts as this rank's rows of them written to
the offload file (``ExpertWriter.rewrite``). The values are those ``load_model_weights`` loads into a
model built whole."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moekit.errors import OptionError
from moekit.run.layout import MODEL_FILE, CheckpointError, is_sharded
from moekit.run.safetensors_io import read_header, read_tensor, rows
from moekit.train.offload.build import ExpertWriter


def load_streamed(path: Path, model: nn.Module, writer: ExpertWriter) -> None:
    """Checkpoint ``path``'s weights into ``model`` (built with ``writer`` as its expert sink, not yet
    placed on a mesh) and ``writer``'s file; a key or shape that does not fit is named."""
    if is_sharded(path):
        raise OptionError(
            "init",
            f"{path} is sharded (a multi-rank run's); offloaded experts are streamed from one file: "
            "consolidate it first with moekit export",
        )
    file = Path(path) / MODEL_FILE
    saved = read_header(file)
    wanted = model.state_dict(keep_vars=True)
    held = {id(wanted[k]) for k in saved.keys() & wanted.keys()}
    missing = sorted(k for k, t in wanted.items() if k not in saved and id(t) not in held)  # tied: once
    unexpected = sorted(saved.keys() - wanted.keys())
    if missing or unexpected:
        raise CheckpointError(f"{file}: does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for key, entry in saved.items():
        if entry.shape != tuple(wanted[key].shape):
            raise CheckpointError(f"{file}: does not fit this model: {key} is {entry.shape}, here {wanted[key].shape}")
    experts = {id(p) for moe in model.moe_layers() for p in moe.experts.parameters()}
    with torch.no_grad():
        for key, entry in saved.items():
            if id(wanted[key]) not in experts:
                wanted[key].copy_(read_tensor(file, entry))
    key_of = {id(t): k for k, t in wanted.items()}
    for layer, moe in enumerate(model.moe_layers()):
        entries = {role: saved[key_of[id(p)]] for role, p in moe.experts.named_parameters()}
        writer.rewrite(
            layer, lambda role, kept, entries=entries: read_tensor(file, rows(entries[role], kept.start, kept.stop))
        )
