"""Generated token ids -> text, one token at a time: what a stream may send now, stop strings, and
where each token's text begins (``text_offset``).

Text is held back while it may still change or be cut: a trailing U+FFFD (a multi-byte character
whose remaining bytes have not been generated yet) and a tail that begins a stop string.

Each token decodes a window of the last few ids, not every id so far (which grew with the text: 0.17
ms a token at 2,000 ids, d1024's BPE tokenizer, ad hoc; the window's few ids take microseconds).
The window starts one final piece back (ids whose text ended in a whole character), so a tokenizer
that renders a piece by what precedes it (SentencePiece's leading space) renders it as in the whole
text; where the window's text is no extension of that piece's, the whole text is decoded instead.
"""

from __future__ import annotations

import os

from moekit.tokenizer import Tokenizer


class TextStream:
    """The text of one choice's generated ids, released as it becomes final."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already released
        self.text = ""  # the text of the ids, as ``decode`` renders it
        self.offset = 0  # where the last token's text begins
        self._final = ""  # the text up to the last whole character
        self._start = self._settled = 0  # the window's first id; the first id past the final text
        self._context = ""  # the text of ids[_start:_settled], as decoded alone

    def add(self, token: int, check_stops: bool = True) -> tuple[str, str | None]:
        """The text ``token`` releases, and the stop string that ended the choice, if one did (the stop
        string and what follows it are never released). ``check_stops`` False: none can, yet."""
        before, final = self.text, self._final
        self.ids.append(token)
        window = self.tokenizer.decode(self.ids[self._start :])
        if window.startswith(self._context):
            self.text = final + window[len(self._context) :]
        else:  # the window's text is no extension of its context's: the whole text, decoded
            self.text = self.tokenizer.decode(self.ids)
        if before.startswith(final) and self.text.startswith(final):  # the final text left as it was
            self.offset = len(final) + token_start(before[len(final) :], self.text[len(final) :])
        else:
            self.offset = token_start(before, self.text)
        if not self.text.endswith("\ufffd"):  # final up to here: the next window starts a piece back
            # a tokenizer not decoding by piece keeps the window at the first id: every id decoded
            piece = self.tokenizer.decode(self.ids[self._settled :]) if self.tokenizer.decodes_by_piece else ""
            # NOTE: a piece with no text of its own (special tokens, which decode skips) is no context
            # (a SentencePiece decoder strips the space of the first piece that has text)
            if piece:
                self._start, self._context = self._settled, piece
            else:
                self._context = window
            self._final, self._settled = self.text, len(self.ids)
        for stop in self.stop if check_stops else ():
            at = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                return self._release(at), stop
        end = len(self.text.rstrip("\ufffd"))
        hold = 0  # the longest tail that begins a stop string waits
        for stop in self.stop if check_stops else ():
            for n in range(min(len(stop) - 1, end - self.sent), hold, -1):
                if self.text.endswith(stop[:n], 0, end):
                    hold = n
                    break
        return self._release(end - hold), None

    def flush(self) -> str:
        """Everything not released yet (the choice ended for another reason than a stop string)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta


def token_start(before: str, after: str) -> int:
    """Where a token's text begins, from the text before and after it: where the two first differ (a
    token that completes a character split across tokens begins at that character), except that a
    token leaving a trailing U+FFFD as it was continues the character that U+FFFD stands for."""
    common = len(os.path.commonprefix([before, after]))
    return common - 1 if after == before and before.endswith("\ufffd") else common


def prefix_offsets(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text begins in the text of ``ids``, as ``TextStream`` places them."""
    stream = TextStream(tokenizer, ())
    offsets = []
    for token in ids:
        stream.add(token)
        offsets.append(stream.offset)
    return offsets
