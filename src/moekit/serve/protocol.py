"""The OpenAI request bodies, read and checked: every mistake is an ``ApiError`` naming the field, so the
engine only ever sees prompts that fit and sampling values it can use.

``/v1/completions``: ``prompt`` (a string or a list of them). ``/v1/chat/completions``: ``messages``
(rendered by ``ChatTemplate``). Both: ``model``, ``max_tokens`` (chat also ``max_completion_tokens``;
default: the rest of the context), ``temperature`` (1), ``top_p`` (1), ``top_k`` (0 = all), ``seed``
(choice i samples with seed + i), ``stop`` (a string or up to four), ``n``, ``stream``, ``logprobs``
(completions: the top-N count; chat: a boolean with ``top_logprobs``), ``stream_options``
(``include_usage``: a last chunk with the usage), ``return_routing``. OpenAI's penalties, ``logit_bias``
and ``echo`` are taken at their neutral values (0, empty, false) and refused at any other, by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from moekit.serve.chat import ROLES, ChatTemplate
from moekit.serve.scheduler import SamplingParams
from moekit.tokenizer import Tokenizer

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP = 4


class ApiError(Exception):
    """A refused request: HTTP status and OpenAI's ``{"error": {message, type, param, code}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
        504: "timeout_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; each a flag of ``moekit serve``."""

    max_body: int = 1 << 20  # bytes of a request body (413 beyond)
    max_choices: int = 16  # prompts x n of one request
    max_tokens: int | None = None  # cap on max_tokens (None: the model's context)
    timeout: float = 600.0  # seconds from arrival to the last token


@dataclass
class Request:
    """A checked request: one prompt (token ids) per choice group, the sampling of each choice."""

    chat: bool
    model: str
    prompts: list[list[int]]
    n: int
    stream: bool
    params: list[SamplingParams] = field(default_factory=list)  # one per choice j of a prompt
    include_usage: bool = False  # a stream ends with a chunk of the usage (stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def read_json(body: bytes) -> dict[str, Any]:
    """A JSON object; NaN and Infinity literals (which Python's json accepts) are refused."""

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not a JSON number")

    try:
        value = json.loads(body, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ApiError(400, f"body is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "body must be a JSON object")
    return value


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "user"}
COMMON |= {"stream_options", "return_routing", "logprobs", "frequency_penalty", "presence_penalty", "logit_bias"}
FIELDS = {False: COMMON | {"prompt", "echo"}, True: COMMON | {"messages", "top_logprobs", "max_completion_tokens"}}
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # the second has nothing to hide here: ignored
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "echo": False}  # taken only as these


def _number(body: dict, name: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, not {value!r}", name)
    if not lo <= value <= hi:  # False for NaN; ints of any size compare exactly (no float())
        raise ApiError(400, f"'{name}'={value!r}: must be in [{lo}, {hi}]", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, not {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of 1..{MAX_STOP} of them", "stop")
    return tuple(stops)


def _content(message: Any) -> str | None:
    """A message's text: a string, or a list of text parts (OpenAI's ``[{"type": "text", "text"}]``),
    joined; None if it is neither."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    return content if isinstance(content, str) else None


def _prompts(body: dict, chat: bool, template: ChatTemplate) -> list[str]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and m.get("role") in ROLES and _content(m) is not None):
                raise ApiError(
                    400,
                    f"messages[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': a string or a list of "
                    "text parts}",
                    "messages",
                )
        try:
            return [template.render([{"role": m["role"], "content": _content(m)} for m in messages])]
        except Exception as err:  # a template's raise_exception, or any Jinja error, names the problem
            raise ApiError(400, f"'messages' do not fit the chat template: {err}", "messages") from None
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "'prompt' must be a string or a non-empty list of strings", "prompt")
    return prompts


def _encode(tokenizer: Tokenizer, text: str, context: int, add_special_tokens: bool) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except ValueError as err:  # a character outside a char vocabulary, a lone surrogate
        raise ApiError(400, f"the prompt cannot be tokenized: {err}", "prompt") from None
    if not ids:
        raise ApiError(400, "the prompt is empty: give at least one character", "prompt")
    if len(ids) >= context:
        raise ApiError(
            400, f"the prompt is {len(ids)} tokens: the context holds {context}, with room to generate", "prompt"
        )
    return ids


def parse_request(
    body: dict, chat: bool, tokenizer: Tokenizer, template: ChatTemplate, context: int, limits: Limits
) -> Request:
    """A checked ``Request`` from a completions (``chat`` False) or chat completions body."""
    unknown = sorted(set(body) - FIELDS[chat])
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and (value != neutral or isinstance(value, bool) != isinstance(neutral, bool)):
            raise ApiError(400, f"'{name}'={value!r}: not supported (only {neutral!r})", name)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, not {model!r}", "model")
    # A rendered chat template holds its special tokens (a BOS) already: the tokenizer adds none.
    special = not (chat and template.template is not None)
    prompts = [_encode(tokenizer, text, context, special) for text in _prompts(body, chat, template)]
    n = _number(body, "n", 1, 1, limits.max_choices, integer=True)
    if len(prompts) * n > limits.max_choices:
        raise ApiError(400, f"{len(prompts)} prompts x n={n}: at most {limits.max_choices} choices per request", "n")
    room = context - max(len(p) for p in prompts)
    cap = min(room, limits.max_tokens or context)
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number(body, name, cap, 1, math.inf, integer=True)
    if max_tokens > cap:
        why = f"the prompt leaves {room} of the context's {context}" if cap == room else "the server's limit"
        raise ApiError(400, f"'{name}'={max_tokens}: at most {cap} ({why})", name)
    if chat:
        count = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        if count and not _flag(body, "logprobs"):
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = count if _flag(body, "logprobs") else None
    else:
        logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    seed = _number(body, "seed", None, 0, MAX_SEED - (n - 1), integer=True)
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= STREAM_OPTIONS):
        allowed = ", ".join(sorted(STREAM_OPTIONS))
        raise ApiError(400, f"'stream_options' must be an object of {allowed}", "stream_options")
    include_usage = _flag(options or {}, "include_usage")
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
            top_k=_number(body, "top_k", 0, 0, tokenizer.vocab_size, integer=True),
            top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
            seed=None if seed is None else seed + j,
            stop=_stop(body),
            logprobs=logprobs,
            return_routing=_flag(body, "return_routing"),
        )
        for j in range(n)
    ]
    return Request(chat, model, prompts, n, _flag(body, "stream"), params, include_usage)
