"""``TextStream``: the text of a choice's ids, built a window of ids at a time, against the whole text
decoded anew at every token. Reference, written out: after each token the text is ``decode`` of every
id so far, and the token's text begins where that text first differs from the text before it, or one
character earlier where the token left a trailing U+FFFD as it was (it continues that character).
Tokenizers: bytes (any id: invalid and cut UTF-8), a byte-level BPE, a SentencePiece-style BPE
(byte tokens ``<0xNN>`` in its vocabulary, a special end token decode skips, leading-space marker
stripped at the start, as Llama's and Mixtral's), and WordPiece, whose decoder joins pieces by what
precedes them."""

from __future__ import annotations

import json
import random

import pytest
import tokenizers
from helpers import sample_text
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from moekit.serve.text import TextStream
from moekit.tokenizer import BPETokenizer, ByteTokenizer

TEXTS = [sample_text(seed) for seed in range(3)] + ["naïve café → 東京 🙂 déjà vu, ok.", "a b  c\n\n¿qué?"]


def _sentencepiece() -> BPETokenizer:
    tk = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    special = ["<unk>", "</s>"]
    tk.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=[*special, *byte_tokens]))
    spec = json.loads(tk.to_str())  # the byte tokens ordinary words of the vocabulary, as in Llama's
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in special]
    return BPETokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))


def _wordpiece() -> BPETokenizer:
    tk = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    tk.train_from_iterator(TEXTS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return BPETokenizer(tk)


TOKENIZERS = {
    "bytes": ByteTokenizer,
    "byte-level-bpe": lambda: BPETokenizer.train(TEXTS, vocab_size=400),
    "sentencepiece": _sentencepiece,
    "wordpiece": _wordpiece,
}


def test_a_decoder_that_looks_further_back_than_a_piece_is_decoded_whole() -> None:
    """A replacement over the fused text spanning three tokens (``the`` -> ``THE``, each letter its own
    token) is outside what the window holds: such a tokenizer says so and its stream decodes every id,
    giving the whole text at every token; the decoders of byte-level BPE, Llama's and WordPiece are
    windowed."""
    raw = BPETokenizer.train(TEXTS, vocab_size=400)._tokenizer
    raw.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Fuse(), decoders.Replace("the", "THE")])
    tokenizer = BPETokenizer(raw)
    letters = [raw.token_to_id("Ġ" if c == " " else c) for c in "in the theatre, then"]  # byte-level's space
    assert not tokenizer.decodes_by_piece and None not in letters
    _streamed(tokenizer, letters)
    assert tokenizer.decode(letters) == "in THE THEatre, THEn"
    windowed = [TOKENIZERS[name]() for name in ("byte-level-bpe", "sentencepiece", "wordpiece")]
    assert all(t.decodes_by_piece for t in windowed)


def _reference_offset(before: str, after: str) -> int:
    common = 0
    while common < min(len(before), len(after)) and before[common] == after[common]:
        common += 1
    return common - 1 if after == before and before.endswith("\ufffd") else common


class _Counting:
    """A tokenizer that records how many ids each ``decode`` got."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids)

    def __getattr__(self, name: str):  # the rest of the tokenizer's (``decodes_by_piece``)
        return getattr(self.tokenizer, name)


def _streamed(tokenizer, ids: list[int]) -> list[int]:
    """Stream ``ids``, checking the text and the token's offset after each against the reference; the
    number of ids each of the stream's decodes got."""
    counting = _Counting(tokenizer)
    stream = TextStream(counting, ())
    for i, token in enumerate(ids):
        stream.add(token)
        assert stream.text == tokenizer.decode(ids[: i + 1])
        assert stream.offset == _reference_offset(tokenizer.decode(ids[:i]), stream.text)
    return counting.lengths


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_streams_text_and_offsets_equal_the_whole_decode_at_every_token(name: str) -> None:
    """Texts encoded (each token decodes a window of a few ids), and ids drawn at random as a model
    may sample them (where a run of byte tokens turns invalid, the text of the bytes before it changes
    too and the whole text is decoded until it ends in a whole character again)."""
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(0)
    encoded = [tokenizer.encode(text[:800]) for text in TEXTS]  # whole characters: each check decodes all ids so far
    drawn = [[rng.randrange(tokenizer.vocab_size) for _ in range(300)] for _ in range(3)]
    for ids in encoded + drawn:
        lengths = _streamed(tokenizer, ids)
        if any(ids is e for e in encoded) and len(ids) > 100:
            assert max(lengths) <= 16, "each token decodes a window, not every id so far"


def test_a_long_stream_decodes_a_window_of_ids_per_token() -> None:
    """2,000 ids of text: no decode past a handful of ids, the whole text exact at the end."""
    tokenizer = BPETokenizer.train(TEXTS, vocab_size=400)
    ids = tokenizer.encode(" ".join(TEXTS * 8))[:2000]
    counting = _Counting(tokenizer)
    stream = TextStream(counting, ())
    for token in ids:
        stream.add(token)
    assert len(ids) == 2000 and stream.text == tokenizer.decode(ids)
    assert max(counting.lengths) <= 8 and len(counting.lengths) <= 2 * len(ids)


def test_a_window_whose_text_is_no_extension_decodes_the_whole_and_recovers() -> None:
    """Words, a newline byte token, a character cut after two of its bytes, words again (SentencePiece
    style): byte fallback renders the newline's byte as U+FFFD too once the run is invalid, so the
    window's text stops extending its context's; the whole text is decoded until a whole character
    ends it, and the windows after that are small again."""
    tokenizer = _sentencepiece()
    vocab = tokenizer._tokenizer.get_vocab()
    words = tokenizer.encode(" ".join(TEXTS))
    ids = words[:200] + [vocab["<0x0A>"], vocab["<0xE2>"], vocab["<0x80>"]] + words[200:300]
    ids += [vocab["</s>"], *tokenizer.encode("la fin")]
    lengths = _streamed(tokenizer, ids)
    whole = [i for i, n in enumerate(lengths) if n > 200]
    assert whole and max(lengths[whole[-1] + 1 :]) <= 8
