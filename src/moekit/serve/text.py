"""Generated token ids -> text, one token at a time: what a stream may send now, and stop strings.

Text is held back while it may still change or be cut: a trailing U+FFFD (a multi-byte character
whose remaining bytes have not been generated yet) and a tail that begins a stop string.
"""

from __future__ import annotations

from moekit.tokenizer import Tokenizer


class TextStream:
    """The text of one choice's generated ids, released as it becomes final."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already released
        self.text = ""

    def add(self, token: int) -> tuple[str, bool]:
        """The text ``token`` releases, and whether a stop string ended the choice (the stop string and
        what follows it are never released)."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        for stop in self.stop:
            at = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                return self._release(at), True
        end = len(self.text.rstrip("\ufffd"))
        hold = 0  # the longest tail that begins a stop string waits
        for stop in self.stop:
            for n in range(min(len(stop) - 1, end - self.sent), hold, -1):
                if self.text.endswith(stop[:n], 0, end):
                    hold = n
                    break
        return self._release(end - hold), False

    def flush(self) -> str:
        """Everything not released yet (the choice ended for another reason than a stop string)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta
