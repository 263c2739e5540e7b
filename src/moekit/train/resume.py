"""What a resumed run may change. Its schedule, optimizer, evaluation, checkpoint and layout settings
take effect from the resumed step (the learning rate is a function of the step and ``[train]``; the
optimizer's hyperparameters are this run's, its state the checkpoint's); the settings below decide
which samples a step reads, how text becomes tokens, only drew the initial weights, or whether two
checkpoint tensors are one, so a resume that changes one is refused by name. The model's shape is
checked against the checkpoint on load."""

from __future__ import annotations

from pathlib import Path

from moekit import runconfig
from moekit.errors import NO_VALUE, OptionError
from moekit.runconfig import RunConfig

KEPT = {
    "train.seed": "it orders the samples and seeds the random draws",
    "train.batch_size": "with the global micro-batches per step, it decides which samples a step reads",
    "data.tokenizer": "the run's tokenizer encodes the text",
    "data.bpe_vocab_size": "the run's tokenizer encodes the text",
    "data.val_fraction": "it splits the text into training and validation tokens",
    "model.context_length": "it is the length of every sample the run reads",
    "model.init_std": "it only drew the initial weights",
    "model.tie_embeddings": "the checkpoint holds one embedding matrix or two",
}


def check_resumable(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse (``OptionError`` naming the field) a resume of ``run_dir`` whose ``cfg`` changes a setting
    the run keeps; a run directory without its config has nothing to compare with."""
    recorded_path = run_dir / "config.json"
    if not recorded_path.is_file():
        return
    recorded = runconfig.from_json(recorded_path)
    for dotted, why in KEPT.items():
        section, _, name = dotted.partition(".")
        new, old = getattr(getattr(cfg, section), name), getattr(getattr(recorded, section), name)
        if new != old:
            kept = f"the run in {run_dir} keeps its own ({old!r}) when resumed, as {why}; "
            reason = kept + "start a new run from its weights ({init} RUN_DIR) to change it"
            raise OptionError(dotted, reason, new, init=NO_VALUE)
