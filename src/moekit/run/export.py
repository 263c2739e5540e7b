"""``moekit export RUN_DIR --out DIR``: any run's latest checkpoint as a run directory whose
checkpoint is one ``model.safetensors`` (what inference, offloaded experts and ``--init`` read)."""

from __future__ import annotations

import shutil
from pathlib import Path

from moekit.errors import OptionError
from moekit.fileio import write_bytes_atomic
from moekit.run.checkpoint import begin_checkpoint, publish_checkpoint, save_failed
from moekit.run.consolidate import consolidate
from moekit.run.layout import CONFIG, MODEL_FILE, SHARDED, CheckpointError, is_sharded, latest_checkpoint
from moekit.run.manifest import digests, read_manifest
from moekit.tokenizer import load_tokenizer


def export_run(run_dir: Path, out: Path) -> Path:
    """Write ``out`` (config, tokenizer, one checkpoint); return that checkpoint's directory.

    A sharded checkpoint is consolidated one block at a time; its checksums are verified first.
    """
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / CONFIG).is_file():
        raise CheckpointError(f"{run_dir}: not a moekit run directory (no config.json)")
    if latest_checkpoint(out) is not None or (out / CONFIG).exists():
        raise OptionError("out", "already holds a run; choose an empty directory", out)
    source = latest_checkpoint(run_dir)
    if source is None:
        raise CheckpointError(f"{run_dir}: has no checkpoint yet")
    manifest = read_manifest(source)
    step = int(manifest["step"])
    out.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out / CONFIG, (run_dir / CONFIG).read_bytes())
    load_tokenizer(run_dir).save(out)
    try:
        tmp = begin_checkpoint(out, step)
        if is_sharded(source):
            consolidate(source / SHARDED, tmp / MODEL_FILE)
        else:
            shutil.copyfile(source / MODEL_FILE, tmp / MODEL_FILE)
        info = {"source": f"exported from {source}", "loss": manifest.get("loss"), "val_loss": manifest.get("val_loss")}
        return publish_checkpoint(out, tmp, step, digests(tmp, [MODEL_FILE]), info, keep=1)
    except OSError as err:
        raise save_failed(out, step, err) from None
