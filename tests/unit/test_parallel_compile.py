"""``train.compile``: per-block torch.compile trains to eager's losses, and compiles once.

Reference: the same run in eager mode. Tolerance 1e-5 on every step's loss over 20 steps (inductor
fuses and reorders float reductions, so bitwise equality is not expected).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moekit import runconfig
from moekit.train.loop import train

STEPS = 20
RUN = {
    "model.moe_every": "2",  # one MoE block and one dense block
    "train.steps": str(STEPS),
    "train.eval_every": str(STEPS),
    "train.ckpt_every": "0",
    "train.sample_tokens": "0",
}


@pytest.mark.slow
def test_compiled_run_matches_eager_and_does_not_recompile(corpus_file: Path, tmp_path: Path) -> None:
    base = {"data.path": str(corpus_file), "data.cache_dir": str(tmp_path / "cache"), **RUN}
    eager = train(runconfig.resolve("tiny", base), tmp_path / "eager", progress=False)
    compiled_cfg = runconfig.resolve("tiny", {**base, "train.compile": "true"})
    compiled = train(compiled_cfg, tmp_path / "compiled", progress=False)
    assert len(compiled.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(eager.losses, compiled.losses, strict=True)) <= 1e-5
    assert abs(eager.val_loss - compiled.val_loss) <= 1e-5
    records = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    first = records[0]
    assert first["compile_s"] > 0 and first["compiled_graphs"] >= 2  # MoE blocks: before and after dispatch
    # No recompilation from one training step to the next (the evaluation at the last step compiles
    # its own, gradient-free graphs once).
    assert {(r["compiled_graphs"], r["recompiles"]) for r in records[:-1]} == {
        (first["compiled_graphs"], first["recompiles"])
    }
