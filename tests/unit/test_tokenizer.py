"""Byte, char and BPE tokenizers: round trips of any text, saving and loading, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import sample_text as _text
from helpers import write_file as _write
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.tokenizer import BPETokenizer, ByteTokenizer, CharTokenizer, DataError, load_tokenizer


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train([_text(seed) for seed in range(4)], vocab_size=300)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_decodes_a_cut_character_with_replacement() -> None:
    ids = ByteTokenizer().encode("é")  # two bytes
    assert ByteTokenizer().decode(ids[:1]) == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab\n é→🙂"))
def test_char_tokenizer_round_trips_text_from_its_alphabet(text: str) -> None:
    tokenizer = CharTokenizer("ab\n é→🙂")
    assert tokenizer.vocab_size == 7
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_char_tokenizer_orders_ids_by_code_point_and_rejects_unknown_characters() -> None:
    tokenizer = CharTokenizer("cab")
    assert tokenizer.encode("abc") == [0, 1, 2]
    with pytest.raises(ValueError, match=r"'z' \(U\+007A\)"):
        tokenizer.encode("az")
    with pytest.raises(ValueError, match=r"outside the char vocabulary"):
        tokenizer.decode([3])


def test_bpe_trains_a_small_vocabulary_that_merges(bpe: BPETokenizer) -> None:
    assert 256 < bpe.vocab_size <= 300
    text = _text(99)
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges learned from the corpus apply
    assert bpe.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_bpe_round_trips_any_text(bpe: BPETokenizer, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_tokenizer_save_and_load(tmp_path: Path, bpe: BPETokenizer, kind: str) -> None:
    tokenizer = {"byte": ByteTokenizer(), "char": CharTokenizer(_text(0)), "bpe": bpe}[kind]
    tokenizer.save(tmp_path / "run")  # creates the directory
    loaded = load_tokenizer(tmp_path / "run")
    text = _text(0)
    assert (loaded.name, loaded.vocab_size) == (kind, tokenizer.vocab_size)
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["tokenizer.json"]  # no temp file left behind


def test_load_tokenizer_missing_or_corrupt(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no tokenizer at"):
        load_tokenizer(tmp_path)
    _write(tmp_path / "tokenizer.json", "{not json")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)
    _write(tmp_path / "tokenizer.json", '{"moekit_tokenizer": "morse"}')
    with pytest.raises(DataError, match="is not a moekit tokenizer"):
        load_tokenizer(tmp_path)
