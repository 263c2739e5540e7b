"""A model directory opened for inference: a moekit run, or a Hugging Face checkpoint read in place.

A Hugging Face directory's non-expert weights are converted in memory (streamed, one tensor at a time,
in the checkpoint's dtype unless one is asked for). With offloaded experts each expert is read by
byte range from the shard files into the cache (``infer.range_store``): no converted copy is made and
nothing is written. Without, the whole model is converted in memory. Here, above both ``convert`` and
``infer`` (which never import one another), is where the two meet.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moekit.convert.hf import load_hf
from moekit.convert.in_place import expert_ranges
from moekit.convert.safetensors_dir import INDEX, SINGLE
from moekit.convert.source import hf_source
from moekit.errors import OptionError
from moekit.infer.expert_store import ExpertStoreError
from moekit.infer.offload import OffloadOptions, offloaded_model
from moekit.infer.quant import QUANT_FORMATS
from moekit.infer.range_store import RangeStore
from moekit.infer.resident_experts import (
    QuantizedExperts,
    prepack_,
    quantize_dense_,
    quantize_layer_experts_,
)
from moekit.layer import MoE
from moekit.run.load import LoadedRun, load_run
from moekit.units import format_bytes


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face checkpoint directory (safetensors weights beside config.json), not a moekit run."""
    return (Path(path) / "config.json").is_file() and any((Path(path) / f).is_file() for f in (SINGLE, INDEX))


@dataclass(frozen=True)
class InPlace:
    """What reading a Hugging Face directory in place costs on disk: its expert bytes read, none written."""

    files: int  # shard files the experts are read from
    expert_bytes: int  # bytes of every routed expert, read by range as needed

    def describe(self, path: Path) -> str:
        return (
            f"experts read in place from {path} ({format_bytes(self.expert_bytes)} over {self.files} "
            f"file{'s' * (self.files != 1)}): no copy written"
        )


def load_for_inference(
    path: Path,
    device: str = "cpu",
    offload: OffloadOptions | None = None,
    dtype: torch.dtype | None = None,
    expert_format: str = "fp",
    prepack: bool = True,
    dense_format: str = "fp",
    few_rows: bool = False,
) -> tuple[LoadedRun, InPlace | None]:
    """A run directory (``load_run``) or a Hugging Face directory, its experts offloaded under ``offload``;
    with what reading a Hugging Face directory in place costs (None for a run or a resident model).

    ``expert_format`` (int8 | int4; resident experts only, an offloaded store takes its format from
    ``offload``): the experts quantized in memory; ``dense_format`` (int8 | int4; resident models only) every
    other linear weight (``quantize_dense_``). ``prepack``: 16-bit weights reordered for oneDNN's
    kernels where the CPU has native ones (``infer.resident_experts``: faster; False keeps the plain
    layout, whose numbers offloaded experts reproduce exactly); ``few_rows``: bf16 weights laid out for a
    batch-1 decode instead (``prepack_``; on a CPU without native bf16 every bf16 load is)."""
    for field, fmt in (("expert_format", expert_format), ("dense_format", dense_format)):
        if fmt not in ("fp", *QUANT_FORMATS):
            raise OptionError(field, f"choose from fp, {', '.join(QUANT_FORMATS)}", fmt)
    if dense_format != "fp" and offload is not None:
        raise OptionError("dense_format", "offloaded models keep their dense weights as stored", dense_format)
    if expert_format != "fp" and offload is not None:
        reason = "offloaded experts take their format from the offload options"
        raise OptionError("expert_format", reason, expert_format)
    loaded, in_place = _load(path, device, offload, dtype, expert_format)
    if expert_format != "fp":
        if not loaded.config.is_moe:
            raise OptionError("expert_format", f"{path} is a dense model; it has no experts", expert_format)
        for moe in loaded.model.moe_layers():  # off a CPU (read whole, then quantized), or a layer read apart
            if not isinstance(moe.experts, QuantizedExperts):
                quantize_layer_experts_(moe, expert_format)
    if dense_format != "fp":
        quantize_dense_(loaded.model, dense_format)
    if prepack:
        prepack_(loaded.model, few_rows)
    return loaded, in_place


def _load(
    path: Path, device: str, offload: OffloadOptions | None, dtype: torch.dtype | None, expert_format: str = "fp"
) -> tuple[LoadedRun, InPlace | None]:
    """``expert_format`` int8 | int4: each MoE layer's experts quantized as soon as they are read, so the
    full-precision ones are held a layer at a time (on a CPU; elsewhere, after the load)."""
    path = Path(path)

    def quantize(moe: MoE) -> None:
        quantize_layer_experts_(moe, expert_format)

    quantizing = quantize if expert_format != "fp" and torch.device(device).type == "cpu" else None
    if not is_hf_dir(path):
        return load_run(path, device, offload, dtype, for_inference=True, experts_loaded=quantizing), None
    checkpoint, tokenizer, cfg = hf_source(path, dtype)
    if offload is None:
        model = load_hf(checkpoint, for_inference=True, experts_loaded=quantizing)
        return LoadedRun(model.to(device), tokenizer, cfg, path), None
    if checkpoint.moe_cfg is None:
        raise OptionError("offload", f"{path} is a dense model; it has no experts to offload")
    if offload.expert_format != "fp":
        raise OptionError(
            "expert_format",
            "a Hugging Face directory's experts are read in place, as stored (fp); for a quantized expert "
            "store convert it first (moekit convert)",
            offload.expert_format,
        )
    ranges = expert_ranges(checkpoint)
    stored = {entry.dtype for roles in ranges.values() for parts in roles.values() for _, entry in parts}
    if stored != {checkpoint.dtype}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in stored))
        raise OptionError(
            "dtype",
            f"{path}'s experts are stored as {names} and are read in place as stored; to run them in another "
            "dtype, or dequantised, convert first (moekit convert)",
            str(checkpoint.dtype).removeprefix("torch."),
        )

    def resident(wanted: Collection[str]) -> Iterator[tuple[str, Tensor]]:
        return ((name, piece) for name, _, piece in checkpoint.pieces(experts=False))

    def open_experts(blocks: dict[int, int]) -> RangeStore:
        expected = {(b, e) for b, n in blocks.items() for e in range(n)}
        if set(ranges) != expected:
            raise ExpertStoreError(f"{path}: its experts {sorted(set(ranges) ^ expected)[:3]} do not fit the model")
        # NOTE: the ranges cannot be read direct (see infer.range_store); evicting each from the page
        # cache after reading keeps direct_io's promise: no cached expert pages beside the budget.
        return RangeStore(ranges, offload.drop_pages or offload.direct_io)

    model, offloader = offloaded_model(
        checkpoint.model_cfg, checkpoint.moe_cfg, resident, open_experts, path, offload, device, checkpoint.dtype
    )
    files = {file for roles in ranges.values() for parts in roles.values() for file, _ in parts}
    expert_bytes = sum(e.end - e.begin for roles in ranges.values() for parts in roles.values() for _, e in parts)
    return LoadedRun(model, tokenizer, cfg, path, offloader), InPlace(len(files), expert_bytes)
