"""Engine events -> OpenAI's response objects: a whole completion, or one streamed chunk per token.

Choices are numbered prompt by prompt (``prompt_index * n + j``). ``usage`` is in every whole answer;
a stream sends it, as OpenAI does, only with ``stream_options.include_usage``: in a last chunk with no
choices, before ``data: [DONE]``. With ``return_routing`` each
generated token carries, per MoE layer, the experts that computed the logits it was sampled from.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from moekit.serve.engine import Finish, Token, TopLogprobs
from moekit.tokenizer import Tokenizer


def token_bytes(tokenizer: Tokenizer, token: int) -> list[int]:
    """The bytes of one token (a byte tokenizer's token is one byte, maybe half a character)."""
    return [token] if tokenizer.name == "byte" else list(tokenizer.decode([token]).encode("utf-8"))


class Shaper:
    """The JSON of one request's answer, completions or chat."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer) -> None:
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list[TopLogprobs], offset: int) -> dict[str, Any]:
        text = lambda t: self.tokenizer.decode([t])  # noqa: E731
        if self.chat:
            return {
                "content": [
                    {
                        "token": text(e.token),
                        "logprob": e.logprob,
                        "bytes": token_bytes(self.tokenizer, e.token),
                        "top_logprobs": [
                            {"token": text(t), "logprob": lp, "bytes": token_bytes(self.tokenizer, t)}
                            for t, lp in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(text(e.token))
        return {
            "tokens": [text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # NOTE: reversed, so that of tokens with the same text (bytes of split characters) the likeliest is kept.
            "top_logprobs": [{text(t): lp for t, lp in reversed(e.top)} for e in entries],
            "text_offset": offsets,
        }

    def _choice(self, index: int, text: str, finish: str | None, logprobs: Any, chunk: bool, first: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, event: Token | Finish, sent: int, first: bool) -> dict[str, Any]:
        """One streamed chunk: a token (``sent`` characters of this choice already streamed), or a finish."""
        if isinstance(event, Finish):
            choice = self._choice(event.choice, event.text, event.reason, None, True, first)
            return {**self._head(True), "choices": [choice]}
        logprobs = self._logprobs([event.logprobs], sent) if event.logprobs is not None else None
        choice = self._choice(event.choice, event.text, None, logprobs, True, first)
        if event.routing is not None:
            choice["routing"] = [event.routing]
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

    def completion(self, choices: list[ChoiceState], usage: dict[str, int]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            logprobs = self._logprobs(c.logprobs, 0) if c.want_logprobs else None
            choice = self._choice(i, "".join(c.text), c.finish, logprobs, False, False)
            if c.want_routing:
                choice["routing"] = c.routing
            out.append(choice)
        return {**self._head(False), "choices": out, "usage": usage}


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    want_logprobs: bool
    want_routing: bool
    text: list[str] = field(default_factory=list)
    logprobs: list[TopLogprobs] = field(default_factory=list)
    routing: list[list[list[int]]] = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, event: Token | Finish) -> None:
        self.text.append(event.text)
        if isinstance(event, Token):
            if event.logprobs is not None:
                self.logprobs.append(event.logprobs)
            if event.routing is not None:
                self.routing.append(event.routing)
        else:
            self.finish = event.reason
            self.prompt_tokens, self.completion_tokens = event.prompt_tokens, event.completion_tokens


def usage(choices: list[ChoiceState], n: int) -> dict[str, int]:
    """Token counts of a request: each prompt counted once (not once per choice)."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
