"""Reading experts from a checkpoint file: each read lands where ``views`` finds it; a cut file names the expert."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moekit import runconfig
from moekit.infer.expert_store import ExpertStore, ExpertStoreError, expert_tensor_prefix
from moekit.infer.quant import roles
from moekit.storage.aligned import aligned_empty


def _store_args(run_dir: Path) -> tuple[Path, dict[int, int]]:
    cfg = runconfig.from_json(run_dir / "config.json")
    weights = next(run_dir.glob("checkpoints/step_*/model.safetensors"))
    return weights, dict.fromkeys(cfg.model.moe_layers(), cfg.moe.num_experts)


@pytest.mark.parametrize("direct", [True, False])
def test_each_expert_read_equals_the_checkpoint_tensor(run_dir: Path, direct: bool) -> None:
    """Direct (O_DIRECT, whole 4 KiB blocks) and buffered reads land each tensor where ``views`` finds it."""
    weights, blocks = _store_args(run_dir)
    reference = load_file(weights)
    with ExpertStore(weights, blocks, roles("fp"), direct=direct) as store:
        if direct and not store.direct:
            pytest.skip("this filesystem has no direct reads")
        assert store.direct == direct
        for slot in (aligned_empty(store.slot_bytes), aligned_empty(store.slot_bytes + 64)[64:]):
            for block, expert in store.pieces:  # (a slot off the 4 KiB grid is read buffered, to the same places)
                assert store.read_into((block, expert), slot) == store.bytes_per_expert
                for role, view in store.views((block, expert), slot).items():
                    assert torch.equal(view, reference[expert_tensor_prefix(block) + role][expert]), (block, role)


@pytest.mark.parametrize("direct", [True, False])
def test_a_file_cut_after_opening_names_the_expert(run_dir: Path, tmp_path: Path, direct: bool) -> None:
    weights, blocks = _store_args(run_dir)
    cut = tmp_path / "model.safetensors"
    shutil.copy(weights, cut)
    with ExpertStore(cut, blocks, roles("fp"), direct=direct) as store:
        last = max(store.pieces)
        w_out = next(p for p in store.pieces[last] if p.name == "w_out")
        os.truncate(cut, w_out.file_offset + w_out.nbytes // 2)
        with pytest.raises(ExpertStoreError, match=rf"truncated: expert {last[1]} of block {last[0]} \(w_out\)"):
            store.read_into(last, aligned_empty(store.slot_bytes))
