"""The token cache is keyed by content and reused, batches are reproducible, and every bad input fails
with a one-line DataError naming the file."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import sample_text as _text
from helpers import write_file as _write

from moekit.config import DataConfig
from moekit.tokenizer import DataError
from moekit.train import data
from moekit.train.data import Corpus, prepare_corpus, resolve_files


def _prepare(tmp_path: Path, path: Path | str, context_length: int = 16, **kwargs: object) -> Corpus:
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **kwargs)  # type: ignore[arg-type]
    return prepare_corpus(cfg, context_length)


def _all_ids(corpus: Corpus) -> list[int]:
    return np.concatenate([corpus.train, corpus.val]).tolist()


# ---------------------------------------------------------------------------------------------
# prepare_corpus: tokenising, the cache, the split.


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_corpus_decodes_back_to_the_text(tmp_path: Path, kind: str) -> None:
    text = _text(1)
    corpus = _prepare(tmp_path, _write(tmp_path / "a.txt", text), tokenizer=kind, bpe_vocab_size=300)
    assert corpus.tokenizer.name == kind
    assert isinstance(corpus.train, np.memmap) and isinstance(corpus.val, np.memmap)
    assert corpus.train.dtype == np.uint16
    assert corpus.tokenizer.decode(_all_ids(corpus)) == text
    assert not corpus.cache_hit
    assert corpus.source.startswith(str(tmp_path / "a.txt")) and "1 file)" in corpus.source


def test_cache_is_reused_without_retokenising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "a.txt", _text(2))
    first = _prepare(tmp_path, path, tokenizer="char")
    entry = first.cache_path.parent
    assert first.cache_path.name == "tokens.bin" and entry.parent == tmp_path / "cache" and len(entry.name) == 16
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "tokenizer.json", "tokens.bin"]

    def fail(*args: object) -> None:
        raise AssertionError("a cache hit must not re-tokenise")

    monkeypatch.setattr(data, "_tokenize", fail)
    second = _prepare(tmp_path, path, tokenizer="char")
    assert second.cache_hit and second.cache_path == first.cache_path
    assert np.array_equal(second.train, first.train) and np.array_equal(second.val, first.val)
    assert second.tokenizer.encode("the") == first.tokenizer.encode("the")


def test_cache_key_follows_content_and_tokenizer_not_path(tmp_path: Path) -> None:
    a = _prepare(tmp_path, _write(tmp_path / "a.txt", _text(3))).cache_path
    moved = _prepare(tmp_path, _write(tmp_path / "elsewhere" / "b.txt", _text(3)))
    assert moved.cache_hit and moved.cache_path == a
    assert _prepare(tmp_path, _write(tmp_path / "c.txt", _text(3) + "x\n")).cache_path != a
    assert _prepare(tmp_path, tmp_path / "a.txt", tokenizer="char").cache_path != a
    bpe_300 = _prepare(tmp_path, tmp_path / "a.txt", tokenizer="bpe", bpe_vocab_size=300).cache_path
    bpe_400 = _prepare(tmp_path, tmp_path / "a.txt", tokenizer="bpe", bpe_vocab_size=400).cache_path
    assert len({a, bpe_300, bpe_400}) == 3


def test_damaged_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.txt", _text(4))
    first = _prepare(tmp_path, path)
    expected, tokens = _all_ids(first), first.cache_path
    del first  # closes the memory map
    tokens.write_bytes(tokens.read_bytes()[:-2])  # a truncated token file
    rebuilt = _prepare(tmp_path, path)
    assert not rebuilt.cache_hit and _all_ids(rebuilt) == expected


@pytest.mark.parametrize("val_fraction", [0.1, 0.25, 0.5])
def test_split_sizes_follow_val_fraction(tmp_path: Path, val_fraction: float) -> None:
    text = _text(5)
    corpus = _prepare(tmp_path, _write(tmp_path / "a.txt", text), val_fraction=val_fraction)
    total = len(text.encode("utf-8"))
    assert len(corpus.train) == int(total * (1 - val_fraction))
    assert len(corpus.train) + len(corpus.val) == total
    assert bytes(corpus.train.tolist()) == text.encode("utf-8")[: len(corpus.train)]  # train is the head


def test_directory_input_is_recursive_sorted_and_skips_hidden_and_empty_files(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    _write(root / "b.txt", "bee\n")
    _write(root / "a" / "z.txt", "zed")  # no trailing newline: one is added
    _write(root / "a" / "empty.txt", "")
    _write(root / ".hidden.txt", "\x00 never read")
    _write(root / ".git" / "objects", b"\xff\xfe binary")
    assert resolve_files(str(root)) == [root / "a" / "empty.txt", root / "a" / "z.txt", root / "b.txt"]
    corpus = _prepare(tmp_path, root, context_length=1, val_fraction=0.25)
    assert corpus.tokenizer.decode(_all_ids(corpus)) == "zed\nbee\n"
    assert "2 files)" in corpus.source


def test_glob_input_is_sorted(tmp_path: Path) -> None:
    _write(tmp_path / "in" / "2.txt", "two\n")
    _write(tmp_path / "in" / "1.txt", "one\n")
    _write(tmp_path / "in" / "skip.md", "not matched\n")
    pattern = str(tmp_path / "in" / "*.txt")
    assert resolve_files(pattern) == [tmp_path / "in" / "1.txt", tmp_path / "in" / "2.txt"]
    corpus = _prepare(tmp_path, pattern, context_length=2, val_fraction=0.4)
    assert corpus.tokenizer.decode(_all_ids(corpus)) == "one\ntwo\n"


def test_default_corpus_is_the_stdlib_python_sources() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = resolve_files(None)
    assert len(files) > 500 and files == sorted(files)
    assert stdlib / "os.py" in files
    assert all(f.suffix == ".py" and f.is_relative_to(stdlib) for f in files)
    assert not any("site-packages" in f.parts or "__pycache__" in f.parts for f in files)


def test_default_corpus_skips_undecodable_files_quietly(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.py", "x = 1\n")
    files = [_write(tmp_path / "bad.py", b"# \xff\n"), good, _write(tmp_path / "nul.py", b"\x00")]
    assert data._read_texts(files, lenient=True) == [b"x = 1\n"]
    with pytest.raises(DataError, match="bad.py"):
        data._read_texts(files, lenient=False)


# ---------------------------------------------------------------------------------------------
# Batches.


def test_batch_is_a_function_of_split_step_and_seed(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.txt", _text(6, num_lines=200))
    corpus = _prepare(tmp_path, path)
    x, y = corpus.batch("train", step=7, batch_size=4, context_length=16, seed=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    train = torch.from_numpy(corpus.train.astype(np.int64))
    for row_x, row_y in zip(x, y, strict=True):
        start = int(torch.nonzero((train.unfold(0, 16, 1) == row_x).all(1))[0])
        assert torch.equal(train[start + 1 : start + 17], row_y)

    reloaded = _prepare(tmp_path, path)  # a resumed run: fresh Corpus, global RNG disturbed
    torch.manual_seed(123)
    x2, y2 = reloaded.batch("train", step=7, batch_size=4, context_length=16, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, corpus.batch("train", step=8, batch_size=4, context_length=16, seed=0)[0])
    assert not torch.equal(x, corpus.batch("train", step=7, batch_size=4, context_length=16, seed=1)[0])
    xv, yv = corpus.batch("val", step=7, batch_size=4, context_length=16, seed=0)
    assert torch.equal(xv[:, 1:], yv[:, :-1]) and int(xv.max()) < corpus.tokenizer.vocab_size


def test_batch_rejects_bad_arguments(tmp_path: Path) -> None:
    corpus = _prepare(tmp_path, _write(tmp_path / "a.txt", _text(7)))
    with pytest.raises(ValueError, match="split='test'"):
        corpus.batch("test", 0, 2, 8, 0)
    with pytest.raises(DataError, match=r"context_length 100000 .* val split"):
        corpus.batch("val", 0, 2, 100_000, 0)


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line, naming the file.


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("missing.txt", None, "no such file or directory"),
        ("*.nothing", None, "no files match"),
        ("empty.txt", b"", "is empty"),
        ("binary.bin", b"text\x00\x01\x02", r"is binary \(it contains NUL bytes\)"),
        ("latin1.txt", b"\xff\xfe caf\xe9", r"is not UTF-8 text \(byte 0xff at offset 0\)"),
    ],
)
def test_bad_input_names_the_file(tmp_path: Path, name: str, content: bytes | None, match: str) -> None:
    path = tmp_path / name
    if content is not None:
        _write(path, content)
    with pytest.raises(DataError, match=match) as info:
        _prepare(tmp_path, path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_bad_file_inside_a_directory_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "corpus" / "a.txt", "fine\n")
    bad = _write(tmp_path / "corpus" / "b.dat", b"\x89PNG\x00")
    with pytest.raises(DataError, match=f"{bad} is binary"):
        _prepare(tmp_path, tmp_path / "corpus")


def test_directory_of_empty_files_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path / "corpus" / "a.txt", "")
    _write(tmp_path / "corpus" / "b.txt", "")
    with pytest.raises(DataError, match=f"{tmp_path / 'corpus'} holds no text"):
        _prepare(tmp_path, tmp_path / "corpus")


def test_context_longer_than_a_split(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.txt", "x" * 99 + "\n")  # 100 tokens: 90 train, 10 val
    with pytest.raises(DataError, match=rf"model.context_length 32 .* val split of {path} .* has 10;"):
        _prepare(tmp_path, path, context_length=32)
    with pytest.raises(DataError, match=r"context_length 128 .* train split .* has 90;"):
        _prepare(tmp_path, path, context_length=128)
    assert len(_prepare(tmp_path, path, context_length=9).val) == 10


def test_empty_path_string_is_not_the_current_directory() -> None:
    with pytest.raises(DataError, match="data.path is an empty string"):
        resolve_files("")
