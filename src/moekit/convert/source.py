"""A model to convert or upcycle, from a moekit run directory or a Hugging Face directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from moekit.config import DataConfig
from moekit.convert.hf import load_hf
from moekit.convert.stream import HFCheckpoint, open_hf
from moekit.model import Transformer
from moekit.run.load import load_run
from moekit.runconfig import RunConfig, for_model
from moekit.tokenizer import Tokenizer, load_tokenizer

# What a Hugging Face directory says about chatting with its model beside its tokenizer.json: the chat
# template (in tokenizer_config.json, or in chat_template.jinja as transformers 5 saves it), the special
# tokens (there, or in an older directory's special_tokens_map.json), and the ids that end a
# generation (generation_config.json).
CHAT_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def carry_chat_files(source: Path, target: Path) -> list[str]:
    """Copy ``CHAT_FILES`` that ``source`` has into ``target``, so the model chats and stops the same
    there (``moekit serve``, transformers); returns the names copied."""
    copied = [name for name in CHAT_FILES if (Path(source) / name).is_file()]
    for name in copied:
        shutil.copyfile(Path(source) / name, Path(target) / name)
    return copied


def hf_source(path: Path, dtype: torch.dtype | None = None) -> tuple[HFCheckpoint, Tokenizer, RunConfig]:
    """(checked checkpoint, tokenizer, run config) of a Hugging Face directory; no weights read yet."""
    checkpoint = open_hf(path, dtype)
    # The run trains on text encoded with this tokenizer (train --init), whatever data.tokenizer says.
    cfg = for_model(checkpoint.model_cfg, checkpoint.moe_cfg, DataConfig(tokenizer="bpe"))
    return checkpoint, load_tokenizer(path), cfg


def load_model_source(path: Path) -> tuple[Transformer, Tokenizer, RunConfig]:
    """(model, tokenizer, run config) of a moekit run directory or of a Hugging Face directory."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json (neither a moekit run nor a Hugging Face directory)")
    if (path / "checkpoints").is_dir():
        run = load_run(path)
        return run.model, run.tokenizer, run.config
    checkpoint, tokenizer, cfg = hf_source(path)
    return load_hf(checkpoint), tokenizer, cfg
