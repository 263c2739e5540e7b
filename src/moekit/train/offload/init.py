"""Another run's weights (``train(init=...)``) into a model whose experts are offloaded, never the whole
expert set in RAM: each tensor of its ``model.safetensors`` read alone, each MoE layer's experts as this
rank's rows of them (``get_slice``) written to the offload file (``ExpertWriter.rewrite``). The values
are those ``load_model_weights`` loads into a model built whole."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from moekit.run.layout import MODEL_FILE, CheckpointError, is_sharded
from moekit.train.offload.build import ExpertWriter


def load_streamed(path: Path, model: nn.Module, writer: ExpertWriter) -> None:
    """Checkpoint ``path``'s weights into ``model`` (built with ``writer`` as its expert sink, not yet
    placed on a mesh) and ``writer``'s file; a key or shape that does not fit is named."""
    if is_sharded(path):
        raise CheckpointError(
            f"init: {path} is sharded (a training run's); offloaded experts are streamed from one file: "
            "consolidate it first with moekit export"
        )
    file = Path(path) / MODEL_FILE
    wanted = model.state_dict(keep_vars=True)
    experts = {id(p) for moe in model.moe_layers() for p in moe.experts.parameters()}
    with safe_open(str(file), framework="pt") as f:
        saved = set(f.keys())
        held = {id(wanted[k]) for k in saved & wanted.keys()}
        missing = sorted(k for k, t in wanted.items() if k not in saved and id(t) not in held)  # tied: once
        unexpected = sorted(saved - wanted.keys())
        if missing or unexpected:
            raise CheckpointError(
                f"{file}: does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        for key in sorted(saved):
            t, shape = wanted[key], tuple(f.get_slice(key).get_shape())
            if shape != tuple(t.shape):
                raise CheckpointError(f"{file}: does not fit this model: {key} is {shape}, here {tuple(t.shape)}")
            if id(t) not in experts:
                with torch.no_grad():
                    t.copy_(f.get_tensor(key))
        key_of = {id(t): k for k, t in wanted.items()}
        for layer, moe in enumerate(model.moe_layers()):
            keys = {role: key_of[id(p)] for role, p in moe.experts.named_parameters()}
            writer.rewrite(layer, lambda role, rows, keys=keys: f.get_slice(keys[role])[rows])
