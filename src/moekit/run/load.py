"""A run directory read back as a model: its config, its tokenizer and the newest checkpoint's weights,
what generation, serving, conversion, export and upcycling start from."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from moekit.config import ModelConfig, MoEConfig
from moekit.errors import OptionError
from moekit.experts.matmul import inference_layout
from moekit.layer import MoE
from moekit.model import Transformer
from moekit.model.rope import rope_table
from moekit.run.layout import CONFIG, MODEL_FILE, SHARDED, CheckpointError, is_sharded, latest_checkpoint
from moekit.run.manifest import read_manifest
from moekit.run.safetensors_io import copy_tensor, read_header
from moekit.runconfig import RunConfig, from_json
from moekit.tokenizer import Tokenizer, load_tokenizer


class Offload(Protocol):
    """Experts kept out of memory (``moekit.infer.offload.OffloadOptions``): builds the model whose
    experts it serves."""

    def build(
        self, model_cfg: ModelConfig, moe_cfg: MoEConfig, checkpoint: Path, device: str, dtype: torch.dtype
    ) -> tuple[Transformer, Any]:
        """The model, its non-expert weights loaded from ``checkpoint``, and what serves its experts."""
        ...


@dataclass(frozen=True)
class LoadedRun:
    model: Transformer
    tokenizer: Tokenizer
    config: RunConfig
    checkpoint: Path
    offloader: Any = None  # the ``infer.offloader.Offloader`` serving the experts, when they are offloaded


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The floating dtype of a checkpoint's weights (most of their bytes): what it loads in by default.

    A sharded checkpoint holds a training run's fp32 weights.
    """
    if is_sharded(path):
        return torch.float32
    held: dict[torch.dtype, int] = {}
    for entry in read_header(Path(path) / MODEL_FILE, check_size=False).values():
        if entry.dtype.is_floating_point:
            held[entry.dtype] = held.get(entry.dtype, 0) + entry.end - entry.begin
    return max(held, key=held.__getitem__) if held else torch.float32


def materialise(
    model: Transformer, dtype: torch.dtype, device: str | torch.device, for_inference: bool = False
) -> Transformer:
    """Allocate, uninitialised, a model built on the meta device: parameters in ``dtype``, buffers in
    their own; embeddings tied again and the RoPE table (not saved) recomputed. Loading its weights
    then fills it, with no random init and no fp32 copy of a bf16 checkpoint.

    ``for_inference``: routed experts in the layout inference multiplies fastest
    (``experts.matmul.inference_layout``: output-major in 16 bits), which training and saving do not take.
    """
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if for_inference:
        for moe in model.moe_layers():
            for p in (moe.experts.w_in, moe.experts.w_out):
                p.data = inference_layout(p.data, dtype)
    _allocate(model, torch.device(device))
    cfg = model.cfg
    if cfg.tie_embeddings:  # allocating meta tensors one module at a time unties shared ones
        model.lm_head.weight = model.embed.weight
    model.rope_freqs = rope_table(cfg).to(device)
    return model


def _allocate(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, by ``torch.empty_strided``: ``to_empty``'s ``empty_like`` of a meta
    tensor runs torch's Python reference, which imports its symbolic-shapes machinery (sympy) on a load."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            empty = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device))


ExpertsLoaded = Callable[[MoE], None]  # called with an MoE layer once its routed experts are whole


class ExpertTracker:
    """Calls ``experts_loaded`` with each MoE layer as soon as every routed-expert tensor of it is whole,
    and drops ``state``'s references to them first: a loader filling a model tensor by tensor and
    quantizing each layer's experts there holds one layer's in full precision at a time (allocated
    but unwritten, a tensor costs no memory)."""

    def __init__(self, model: nn.Module, state: dict[str, Tensor], experts_loaded: ExpertsLoaded) -> None:
        self.pending: dict[MoE, set[str]] = {}  # each layer's expert tensors not yet whole
        for name, moe in model.named_modules():
            if isinstance(moe, MoE):
                self.pending[moe] = {n for n in state if n.startswith(f"{name}.experts.")}
        self.owners = {n: moe for moe, names in self.pending.items() for n in names}
        self.rows_left = {n: state[n].shape[0] for n in self.owners}
        self.state, self.experts_loaded = state, experts_loaded

    def filled(self, name: str, rows: slice = slice(None)) -> None:
        """``rows`` (leading) of state tensor ``name`` hold their values now."""
        if name not in self.rows_left:
            return
        self.rows_left[name] -= len(range(*rows.indices(self.state[name].shape[0])))
        if self.rows_left[name] > 0:
            return
        moe = self.owners.pop(name)
        del self.rows_left[name], self.state[name]
        self.pending[moe].discard(name)
        if not self.pending[moe]:
            del self.pending[moe]
            self.experts_loaded(moe)


def load_model_weights(path: Path, model: nn.Module, experts_loaded: ExpertsLoaded | None = None) -> None:
    """Load a checkpoint's weights into ``model``; a shape or key mismatch names the keys.

    One file is read a tensor at a time into the model's allocated state (never a second copy of the
    whole model); ``experts_loaded``: see ``ExpertTracker``. A sharded checkpoint is consolidated in
    memory (every shard read in this process), each layer handed to ``experts_loaded`` after."""
    if is_sharded(path):
        from moekit.run.sharded import load_weights  # DCP (and what it pulls in) only for a sharded checkpoint

        load_weights(Path(path) / SHARDED, model)
        for moe in model.moe_layers() if experts_loaded is not None else []:
            experts_loaded(moe)
        return
    file = Path(path) / MODEL_FILE
    state = model.state_dict()
    wanted = {n: t.data_ptr() for n, t in state.items() if t.numel()}  # before experts_loaded swaps any
    tracker = ExpertTracker(model, state, experts_loaded) if experts_loaded is not None else None
    loaded: set[int] = set()  # storage of every state tensor filled (a tied weight's two names share one)
    header = read_header(file)
    unexpected = [n for n in header if n not in state]
    if unexpected:
        raise CheckpointError(f"{file}: does not fit this model (unexpected {sorted(unexpected)[:3]})")
    for name, entry in header.items():  # all of them before any is read
        if tuple(entry.shape) != tuple(state[name].shape):
            have, want = list(entry.shape), list(state[name].shape)
            raise CheckpointError(f"{file}: does not fit this model: {name} is {have}, the model's {want}")
    if sys.byteorder != "little":
        raise CheckpointError(f"{file}: safetensors stores little-endian values; this machine is big-endian")
    for name, entry in header.items():  # never the whole file mapped: its touched pages would stay resident
        copy_tensor(file, entry, state[name])
        loaded.add(state[name].data_ptr())
        if tracker is not None:
            tracker.filled(name)
    missing = [n for n, ptr in wanted.items() if ptr not in loaded]
    if missing:
        raise CheckpointError(f"{file}: does not fit this model (missing {sorted(missing)[:3]})")


def load_run(
    run_dir: Path,
    device: str = "cpu",
    offload: Offload | None = None,
    dtype: torch.dtype | None = None,
    for_inference: bool = False,
    experts_loaded: ExpertsLoaded | None = None,
) -> LoadedRun:
    """The trained model (newest checkpoint, weights verified), its tokenizer and config.

    The weights load in ``dtype``, by default the checkpoint's own (a bf16 conversion stays bf16).
    A sharded checkpoint (from a multi-rank run) is consolidated in memory.

    With ``offload`` (``moekit.infer.offload.OffloadOptions``) the experts stay on disk and are served
    through a budgeted cache; only the non-expert weights are loaded. ``for_inference``: the experts in
    inference's layout (``materialise``); such a model is for generating, not for training or saving.
    ``experts_loaded``: each MoE layer as its experts are read (``load_model_weights``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).is_file():
        raise CheckpointError(f"{run_dir}: not a moekit run directory (no config.json)")
    cfg = from_json(run_dir / CONFIG)
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{run_dir}: has no checkpoint yet")
    if offload is not None:
        if not cfg.is_moe:
            raise OptionError("offload", f"{run_dir} is a dense model; it has no experts to offload")
        if is_sharded(path):
            raise OptionError(
                "offload",
                f"{path} is sharded (written by several ranks); offloaded experts are read from one file: "
                "consolidate it first with moekit export",
            )
        model, offloader = offload.build(cfg.model, cfg.moe, path, device, dtype or checkpoint_dtype(path))
        return LoadedRun(model, load_tokenizer(run_dir), cfg, path, offloader)
    read_manifest(path)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None)
    materialise(model, dtype or checkpoint_dtype(path), device, for_inference)
    load_model_weights(path, model, experts_loaded)
    return LoadedRun(model.eval(), load_tokenizer(run_dir), cfg, path)
