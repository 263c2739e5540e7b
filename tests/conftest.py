"""Shared fixtures: a small real-text corpus written into the test's own directory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

SENTENCE = (
    "the king and queen of the castle walked along the river to see the ships that came from the "
    "north with wool and wine while the people of the town sang songs about the old war and the "
    "brave soldiers who fought for their home and their children"
)
WORDS = SENTENCE.split()


def write_corpus(path: Path, n_lines: int = 600, seed: int = 0) -> Path:
    """Sentences of real words with structure a tiny model can learn in a few steps."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        start = rng.randrange(len(WORDS) - 8)
        lines.append(f"{i % 7}: " + " ".join(WORDS[start : start + rng.randint(4, 8)]) + ".")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")
