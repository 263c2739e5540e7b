"""Engine events -> OpenAI's response objects: a whole completion, or one streamed chunk per token.

Choices are numbered prompt by prompt (``prompt_index * n + j``). ``usage`` is in every whole answer;
a stream sends it, as OpenAI does, only with ``stream_options.include_usage``: in a last chunk with no
choices, before ``data: [DONE]``. With ``return_routing`` each generated token carries, per MoE
layer, the experts that computed the logits it was sampled from. ``stop_reason`` (vLLM's) names the
stop string or ``stop_token_ids`` token that ended a choice (null for the model's end token).

A token's logprobs go out with its text: while the text is held back (a tail that may begin a stop
string, half a character) so are they, and the tokens of a stop string are never reported, as its
text is not. ``text_offset`` is where a token's text begins in the choice's text (the echoed prompt
included), the same whole or streamed.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from moekit.serve.engine import Finish, PromptLogprobs, Token
from moekit.serve.protocol import Echo
from moekit.serve.sampling import TopLogprobs
from moekit.tokenizer import Tokenizer


def token_bytes(tokenizer: Tokenizer, token: int) -> list[int]:
    """The bytes of one token (a byte tokenizer's token is one byte, maybe half a character)."""
    return [token] if tokenizer.name == "byte" else list(tokenizer.decode([token]).encode("utf-8"))


@dataclass(frozen=True)
class Entry:
    """One token of a choice's logprobs."""

    offset: int  # where its text begins in the choice's text
    token: int
    score: TopLogprobs | None  # None: a prompt's first token (nothing before it to score it by)


@dataclass(frozen=True)
class Delta:
    """What one event adds to a choice's answer."""

    text: str
    entries: list[Entry]
    routing: list[list[int]] | None = None


@dataclass
class ChoiceState:
    """What one choice has produced so far, and the logprobs waiting for their text."""

    want_logprobs: bool
    want_routing: bool
    echo: Echo | None = None  # its prompt, returned first
    prompt: list[int] = field(default_factory=list)
    echo_only: bool = False  # the generated token is dropped (echo with max_tokens 0)
    text: list[str] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    held: list[Entry] = field(default_factory=list)  # logprobs of tokens whose text is held back
    routing: list[list[list[int]]] = field(default_factory=list)
    finish: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generated_chars: int = 0  # characters of generated text released

    @property
    def started(self) -> bool:
        return bool(self.text)

    def add(self, event: Token | Finish | PromptLogprobs) -> Delta:
        """Take ``event`` in; what it adds to the answer (a stream sends that as one chunk)."""
        base = len(self.echo.text) if self.echo is not None else 0
        head = self.echo.text if self.echo is not None and not self.started else ""
        entries: list[Entry] = []
        routing = None
        if isinstance(event, PromptLogprobs):
            scores = [None, *event.scores]
            entries = [Entry(at, t, s) for at, t, s in zip(self.echo.offsets, self.prompt, scores, strict=True)]
            text = ""
        elif self.echo_only:  # the prompt alone: the one generated token, and why it ended, are dropped
            text = ""
            if isinstance(event, Finish):
                self.finish = "length" if event.reason in ("stop", "length") else event.reason
                self.prompt_tokens = event.prompt_tokens
        elif isinstance(event, Token):
            text = event.text
            self.generated_chars += len(text)
            if event.logprobs is not None:
                self.held.append(Entry(base + event.offset, event.token, event.logprobs))
            entries = self._release(lambda e: e.offset - base < self.generated_chars)
            if event.routing is not None:
                routing = event.routing
                self.routing.append(routing)
        else:
            text = event.text
            self.generated_chars += len(text)
            self.finish, self.stop_reason = event.reason, event.stop_reason
            self.prompt_tokens, self.completion_tokens = event.prompt_tokens, event.completion_tokens
            if isinstance(event.stop_reason, str):  # the stop string's tokens: cut, as its text is
                self.held = []
            entries = self._release(lambda e: True)
        self.text.append(head + text)
        self.entries += entries
        return Delta(head + text, entries, routing)

    def _release(self, ready) -> list[Entry]:
        out = [e for e in self.held if ready(e)]
        self.held = [e for e in self.held if not ready(e)]
        return out


class Shaper:
    """The JSON of one request's answer, completions or chat."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer) -> None:
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _top(self, score: TopLogprobs) -> dict[str, float]:
        """The N likeliest tokens and the chosen one (up to N + 1, as OpenAI's completions give them)."""
        pairs = dict(score.top)
        pairs.setdefault(score.token, score.logprob)
        top: dict[str, float] = {}
        for token, logprob in sorted(pairs.items(), key=lambda p: -p[1]):
            # NOTE: of tokens with the same text (bytes of split characters) the likeliest is kept.
            top.setdefault(self._text(token), logprob)
        return top

    def _logprobs(self, entries: list[Entry]) -> dict[str, Any]:
        if self.chat:
            item = lambda t, lp: {"token": self._text(t), "logprob": lp, "bytes": token_bytes(self.tokenizer, t)}  # noqa: E731
            return {
                "content": [
                    {**item(e.token, e.score.logprob), "top_logprobs": [item(t, lp) for t, lp in e.score.top]}
                    for e in entries
                ]
            }
        return {
            "tokens": [self._text(e.token) for e in entries],
            "token_logprobs": [None if e.score is None else e.score.logprob for e in entries],
            "top_logprobs": [None if e.score is None else self._top(e.score) for e in entries],
            "text_offset": [e.offset for e in entries],
        }

    def _choice(self, index: int, text: str, c: ChoiceState, entries: list[Entry], chunk: bool, first: bool) -> dict:
        logprobs = self._logprobs(entries) if c.want_logprobs else None
        ends = {"finish_reason": c.finish, "stop_reason": c.stop_reason}
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, **ends}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs, **ends}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, **ends}

    def chunk(self, index: int, delta: Delta, c: ChoiceState, first: bool) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: what ``delta`` adds (``first``: the choice's first)."""
        choice = self._choice(index, delta.text, c, delta.entries, True, first)
        if delta.routing is not None:
            choice["routing"] = [delta.routing]
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

    def completion(self, choices: list[ChoiceState], usage: dict[str, int]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            choice = self._choice(i, "".join(c.text), c, c.entries, False, False)
            if c.want_routing:
                choice["routing"] = c.routing
            out.append(choice)
        return {**self._head(False), "choices": out, "usage": usage}


def usage(choices: list[ChoiceState], n: int) -> dict[str, int]:
    """Token counts of a request: each prompt counted once (not once per choice)."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
