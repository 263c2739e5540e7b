"""Tokenizers: text <-> token ids, and the ``tokenizer.json`` a run directory keeps.

Training builds one from its corpus (``train/data.py``); inference, serving, conversion and export
read it back with ``load_tokenizer``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from moekit.fileio import write_bytes_atomic, write_json_atomic

if TYPE_CHECKING:
    import tokenizers


class DataError(ValueError):
    """A problem with the training text, its tokenizer or its token cache, in one line that names the file
    or field."""


class Tokenizer(Protocol):
    """Text <-> token ids in ``[0, vocab_size)``; ``save`` writes what ``load_tokenizer`` reads."""

    name: str  # byte | char | bpe
    vocab_size: int
    # whether a token's text depends on at most the piece of text before it (``serve.text.TextStream``)
    decodes_by_piece: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; ``add_special_tokens``: as its post-processor frames a text (a Hugging Face
        tokenizer's BOS), off for text that holds its special tokens already (a rendered chat)."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: nothing to train and nothing out of vocabulary."""

    name = "byte"
    vocab_size = 256
    decodes_by_piece = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # NOTE: sampled ids can cut a multi-byte character in half; "replace" keeps decode total.
        return bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        write_json_atomic(Path(directory) / "tokenizer.json", {"moekit_tokenizer": "byte"})


class CharTokenizer:
    """One token per distinct character of the corpus, ids in code-point order."""

    name = "char"
    decodes_by_piece = True

    def __init__(self, alphabet: str) -> None:
        if not alphabet:
            raise ValueError("char tokenizer alphabet is empty")
        self.alphabet = "".join(sorted(set(alphabet)))
        self.vocab_size = len(self.alphabet)
        self._ids = {char: i for i, char in enumerate(self.alphabet)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return [self._ids[char] for char in text]
        except KeyError as e:
            char = e.args[0]
            raise ValueError(
                f"character {char!r} (U+{ord(char):04X}) is not in the char tokenizer's alphabet "
                f"of {self.vocab_size} characters"
            ) from None

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the char vocabulary [0, {self.vocab_size})")
        return "".join([self.alphabet[i] for i in ids])

    def save(self, directory: Path) -> None:
        write_json_atomic(Path(directory) / "tokenizer.json", {"moekit_tokenizer": "char", "alphabet": self.alphabet})


class BPETokenizer:
    """Hugging Face byte-level BPE (GPT-2 style): lossless on any text, merges learned from the corpus."""

    name = "bpe"

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size()
        decoder = tokenizer.decoder
        self.decodes_by_piece = decoder is None or _decodes_by_piece(json.loads(decoder.__getstate__()))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learn up to ``vocab_size - 256`` merges on top of the 256 byte tokens."""
        tk = _import_tokenizers()
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown tokens
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` over many texts on all cores."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def save(self, directory: Path) -> None:
        write_bytes_atomic(Path(directory) / "tokenizer.json", self._tokenizer.to_str().encode("utf-8"))


def _decodes_by_piece(decoder: dict) -> bool:
    """Whether a Hugging Face decoder renders a token's text from at most the piece of text before it
    (what ``moekit.serve.text.TextStream``'s window holds): byte-level, byte fallback, SentencePiece's
    marker and its one leading space, WordPiece's joins, one-character replacements. Others (a longer
    replacement, which after ``Fuse`` may span tokens; CTC's merging of repeats; a strip of more than
    one leading character or of the end) are decoded whole."""
    kind = decoder.get("type")
    if kind == "Sequence":
        return all(_decodes_by_piece(d) for d in decoder.get("decoders", []))
    if kind == "Strip":
        return decoder.get("stop", 0) == 0 and decoder.get("start", 0) <= 1
    if kind == "Replace":
        return len(decoder.get("pattern", {}).get("String", "")) == 1
    return kind in ("ByteLevel", "ByteFallback", "Fuse", "Metaspace", "WordPiece")


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "data.tokenizer = bpe needs the Hugging Face tokenizers package: pip install tokenizers"
        ) from None
    return tokenizers


def load_tokenizer(directory: Path) -> Tokenizer:
    """Rebuild the tokenizer that ``save`` wrote to ``directory/tokenizer.json``."""
    path = Path(directory) / "tokenizer.json"
    try:
        text = path.read_text("utf-8")
        data = json.loads(text)
    except FileNotFoundError:
        raise DataError(f"no tokenizer at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read tokenizer {path}: {e}") from None
    kind = data.get("moekit_tokenizer") if isinstance(data, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char" and isinstance(data.get("alphabet"), str) and data["alphabet"]:
        return CharTokenizer(data["alphabet"])
    if kind is None and isinstance(data, dict) and isinstance(data.get("model"), dict):
        tk = _import_tokenizers()
        try:
            return BPETokenizer(tk.Tokenizer.from_str(text))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise DataError(f"cannot read tokenizer {path}: {e}") from None
    raise DataError(f"{path} is not a moekit tokenizer (expected byte, char or a Hugging Face tokenizer)")
