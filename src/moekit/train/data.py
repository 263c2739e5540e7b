"""Training text: resolve the files, tokenise them once into a cached token file, draw batches.

Legend: B batch size, C context length (tokens per sample), N tokens in a split.

The token stream is cached under a key made of the text's content and the tokenizer, so a second
run (or a resumed one) memory-maps it instead of re-tokenising. A batch is a pure function of
(split, step, seed): a resumed run draws exactly the batches an uninterrupted run would have, with
no data-loader state to checkpoint.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moekit.config import DataConfig
from moekit.errors import OptionError
from moekit.fileio import write_atomic, write_json_atomic
from moekit.tokenizer import BPETokenizer, ByteTokenizer, CharTokenizer, DataError, Tokenizer, load_tokenizer

CACHE_VERSION = "moekit-tokens-v1"  # part of the cache key: bump when the token file or text joining changes
_CHUNK_CHARS = 1 << 20  # bpe trains and encodes ~1M-character pieces cut at newlines, so workers share them


# ---------------------------------------------------------------------------------------------
# Files.


def resolve_files(path: str | None) -> list[Path]:
    """The files ``data.path`` names, in the fixed order the token stream follows.

    A file; a directory (its regular files, recursively, skipping hidden names); a glob pattern; or
    None: this Python's standard library ``*.py`` sources, without site-packages.
    """
    if path == "":
        raise DataError("data.path is an empty string; leave it unset for the default corpus")
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise DataError(f"data.path is unset and this Python has no standard library source at {root}; set it")
        prune = {"site-packages", "dist-packages", "__pycache__"}
        return _walk(root, lambda name: name.endswith(".py"), lambda name: name in prune)
    expanded = os.path.expanduser(path)
    target = Path(expanded)
    if target.is_file():
        return [target]
    if target.is_dir():
        files = _walk(target, lambda name: True, lambda name: False)
        if not files:
            raise DataError(f"data.path: directory {path} holds no files")
        return files
    if any(char in expanded for char in "*?["):
        files = sorted(Path(match) for match in glob.glob(expanded, recursive=True) if os.path.isfile(match))
        if not files:
            raise DataError(f"data.path: no files match {path}")
        return files
    raise DataError(f"data.path: no such file or directory: {path}")


def _walk(root: Path, keep: Callable[[str], bool], prune: Callable[[str], bool]) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not prune(d)]
        for name in filenames:
            if not name.startswith(".") and keep(name) and os.path.isfile(os.path.join(dirpath, name)):
                files.append(Path(dirpath, name))
    return sorted(files)


def _problem(data: bytes) -> str | None:
    """Why ``data`` is not usable text, or None."""
    if b"\x00" in data:
        return "is binary (it contains NUL bytes), not text"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
    return None


def _read_texts(files: list[Path], lenient: bool) -> list[bytes]:
    """Each non-empty file's UTF-8 bytes, ending in a newline so files never run together.

    Empty files are skipped; a binary or non-UTF-8 file is a DataError, or skipped when ``lenient``
    (the default corpus: a few stdlib test files are deliberately undecodable).
    """
    texts = []
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as e:
            if lenient:
                continue
            raise DataError(f"data.path: cannot read {path}: {e.strerror}") from None
        if not data:
            continue
        problem = _problem(data)
        if problem is not None:
            if lenient:
                continue
            raise DataError(f"data.path: {path} {problem}")
        texts.append(data if data.endswith(b"\n") else data + b"\n")
    return texts


def _describe(where: str, texts: list[bytes]) -> str:
    """``where (1.1 MB, 3 files)``: what a log line says about the corpus."""
    size = sum(len(text) for text in texts)
    if size < 1000:
        amount = f"{size} B"
    elif size < 1000**2:
        amount = f"{size / 1000:.1f} kB"
    else:
        amount = f"{size / 1000**2:.1f} MB"
    count = len(texts)
    return f"{where} ({amount}, {count} file{'s' if count != 1 else ''})"


# ---------------------------------------------------------------------------------------------
# Tokenising and the token cache.


def _cache_key(cfg: DataConfig, texts: list[bytes], tokenizer_file: bytes | None = None) -> str:
    """sha256 of the tokenizer settings (or given tokenizer) and each text's bytes, never the paths."""
    digest = hashlib.sha256()
    vocab = cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else ""
    digest.update(f"{CACHE_VERSION}\0{cfg.tokenizer}\0{vocab}\0".encode())
    if tokenizer_file is not None:
        digest.update(b"given\0" + hashlib.sha256(tokenizer_file).digest())
    for text in texts:
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text)
    return digest.hexdigest()


def _chunks(texts: list[str], size: int = _CHUNK_CHARS) -> Iterator[str]:
    """Cut each text into pieces of at most ~``size`` characters, at newlines where there is one."""
    for text in texts:
        start = 0
        while len(text) - start > size:
            cut = text.rfind("\n", start, start + size) + 1
            if cut <= start:
                cut = start + size
            yield text[start:cut]
            start = cut
        yield text[start:]


def _tokenize(cfg: DataConfig, texts: list[bytes]) -> tuple[Tokenizer, np.ndarray]:
    """Train the tokenizer on the texts and encode them into one 1-D id array."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer(), np.frombuffer(b"".join(texts), dtype=np.uint8)
    strings = [text.decode("utf-8") for text in texts]
    if cfg.tokenizer == "char":
        # NOTE: UTF-32 gives one uint32 code point per character, so the alphabet and the ids are
        # a unique + searchsorted in numpy instead of a Python loop over tens of millions of chars.
        codepoints = np.frombuffer("".join(strings).encode("utf-32-le"), dtype=np.uint32)
        alphabet = np.unique(codepoints)
        return CharTokenizer("".join(map(chr, alphabet.tolist()))), np.searchsorted(alphabet, codepoints)
    tokenizer = BPETokenizer.train(_chunks(strings), cfg.bpe_vocab_size)
    ids = tokenizer.encode_batch(list(_chunks(strings)))
    return tokenizer, np.concatenate([np.asarray(piece, dtype=np.uint32) for piece in ids])


def _encode(tokenizer: Tokenizer, texts: list[bytes]) -> np.ndarray:
    """Encode the texts with a tokenizer that already exists (the one of a run training starts from)."""
    chunks = list(_chunks([text.decode("utf-8") for text in texts]))
    pieces = tokenizer.encode_batch(chunks) if isinstance(tokenizer, BPETokenizer) else map(tokenizer.encode, chunks)
    return np.concatenate([np.asarray(piece, dtype=np.uint32) for piece in pieces])


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def _write_cache(directory: Path, tokenizer: Tokenizer, ids: np.ndarray, meta: dict[str, Any]) -> None:
    # NOTE: tokens.bin goes last: its presence marks a complete entry, so a run killed midway
    # leaves at worst a tokenizer and meta that the next run overwrites.
    try:
        tokenizer.save(directory)
        write_json_atomic(directory / "meta.json", meta)
        write_atomic(directory / "tokens.bin", ids.tofile)
    except OSError as e:
        raise DataError(f"data.cache_dir: cannot write the token cache {directory}: {e.strerror or e}") from None


def _load_cache(directory: Path, tokenizer_name: str) -> tuple[Tokenizer, np.memmap] | None:
    """The cached tokenizer and memory-mapped ids, or None when the entry is absent or damaged."""
    tokens = directory / "tokens.bin"
    if not tokens.is_file():
        return None
    try:
        meta = json.loads((directory / "meta.json").read_text("utf-8"))
        dtype = np.dtype(meta["dtype"])
        num_tokens = int(meta["num_tokens"])
        tokenizer = load_tokenizer(directory)
        size = tokens.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):  # DataError and JSON errors are ValueErrors
        return None
    if tokenizer.name != tokenizer_name or num_tokens <= 0 or size != num_tokens * dtype.itemsize:
        return None
    return tokenizer, np.memmap(tokens, dtype=dtype, mode="r", shape=(num_tokens,))


# ---------------------------------------------------------------------------------------------
# The corpus.


def _batch_seed(split: str, step: int, seed: int) -> int:
    digest = hashlib.blake2b(f"{split}:{step}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draw_seed(index: int, seed: int) -> int:
    """The seed of training micro-batch ``index``'s random draws (dropout, router noise, GShard's second
    dispatch): a function of its data position, as its samples are, so a rank reading micro-batch
    ``index`` draws what one process reading it draws, whatever the layout."""
    return _batch_seed("draws", index, seed)


def _context_error(context_length: int, split: str, source: str, num_tokens: int) -> DataError:
    return DataError(
        f"model.context_length {context_length} needs {context_length + 1} tokens per sample but the "
        f"{split} split of {source} has {num_tokens}; use more text or a shorter context"
    )


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays field by field has no single truth value
class Corpus:
    """A tokenised corpus split into train and val token streams (memory-mapped from the cache)."""

    tokenizer: Tokenizer
    train: np.ndarray  # [N_train] token ids, np.memmap: uint16, or uint32 for a vocabulary over 65535
    val: np.ndarray  # [N_val] token ids: the tail of the token stream
    source: str  # what the text is, for logs: "/path/x.txt (1.1 MB, 1 file)"
    cache_path: Path  # the token file both splits map
    cache_hit: bool  # True when the token file already existed and was reused

    def batch(
        self, split: str, step: int, batch_size: int, context_length: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x, y`` LongTensors ``[B, C]`` of random windows, ``y`` being ``x`` shifted by one token.

        A pure function of (split, step, seed) through its own ``torch.Generator``, so a resumed run
        draws exactly the batches an uninterrupted run would, and global RNG state plays no part.
        """
        if split not in ("train", "val"):
            raise OptionError("split", "must be train or val", split)
        if batch_size < 1 or context_length < 1:
            raise OptionError(
                "batch_size", "it and {context_length} must both be >= 1", batch_size, context_length=context_length
            )
        data = self.train if split == "train" else self.val
        if context_length + 1 > len(data):
            raise _context_error(context_length, split, self.source, len(data))
        generator = torch.Generator().manual_seed(_batch_seed(split, step, seed))
        starts_B = torch.randint(len(data) - context_length, (batch_size,), generator=generator).numpy()
        windows = np.asarray(data[starts_B[:, None] + np.arange(context_length + 1)], dtype=np.int64)
        xy_BC1 = torch.from_numpy(windows)  # [B, C + 1]
        return xy_BC1[:, :-1].contiguous(), xy_BC1[:, 1:].contiguous()


def prepare_corpus(cfg: DataConfig, context_length: int, tokenizer_dir: Path | None = None) -> Corpus:
    """Resolve ``cfg.path``, tokenise it (or reuse the token cache) and split it into train and val.

    With ``tokenizer_dir`` the text is encoded with the tokenizer saved there (a run whose weights
    training starts from) instead of one built from ``cfg.tokenizer``.

    The cache entry ``<cache_dir>/<key[:16]>/`` holds ``tokens.bin``, ``tokenizer.json`` and
    ``meta.json``; the key hashes the tokenizer settings and the files' contents, so moving or
    renaming files reuses it and editing one rebuilds it. Prints nothing.
    """
    if context_length < 1:
        raise OptionError("context_length", "must be >= 1", context_length)
    files = resolve_files(cfg.path)
    texts = _read_texts(files, lenient=cfg.path is None)
    if cfg.path is None:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        where = f"Python {version} standard library {sysconfig.get_paths()['stdlib']}"
    else:
        where = cfg.path
    if not texts:
        raise DataError(f"data.path: {files[0]} is empty" if len(files) == 1 else f"data.path: {where} holds no text")
    source = _describe(where, texts)
    cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache" / "moekit" / "tokens"
    given = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    given_file = (Path(tokenizer_dir) / "tokenizer.json").read_bytes() if tokenizer_dir is not None else None
    directory = cache_root / _cache_key(cfg, texts, given_file)[:16]
    cache_path = directory / "tokens.bin"

    cached = _load_cache(directory, given.name if given is not None else cfg.tokenizer)
    cache_hit = cached is not None
    if cached is None:
        tokenizer, ids = (given, _encode(given, texts)) if given is not None else _tokenize(cfg, texts)
        dtype = _token_dtype(tokenizer.vocab_size)
        meta = {
            "version": CACHE_VERSION,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name,
            "num_tokens": len(ids),
            "num_files": len(texts),
            "num_bytes": sum(len(text) for text in texts),
        }
        _write_cache(directory, tokenizer, ids.astype(dtype, copy=False), meta)
        cached = tokenizer, np.memmap(cache_path, dtype=dtype, mode="r", shape=(len(ids),))
    tokenizer, tokens = cached

    num_train = int(len(tokens) * (1 - cfg.val_fraction))
    train, val = tokens[:num_train], tokens[num_train:]
    for split, data in (("train", train), ("val", val)):
        if context_length + 1 > len(data):
            raise _context_error(context_length, split, source, len(data))
    return Corpus(tokenizer, train, val, source, cache_path, cache_hit)
