"""The OpenAI request bodies, read and checked: every mistake is an ``ApiError`` naming the field, so the
engine only ever sees prompts that fit and sampling values it can use.

``/v1/completions``: ``prompt`` (a string, a list of token ids, or a list of either), ``echo`` (each
choice's text begins with its prompt, and its logprobs with the prompt tokens' when ``logprobs`` is
set; with ``max_tokens`` 0 the prompt is all it holds), ``add_special_tokens``.
``/v1/chat/completions``: ``messages`` (rendered by ``ChatTemplate``; an assistant's ``content`` may be
null). Both: ``model``, ``max_tokens`` (chat also ``max_completion_tokens``; default: the rest of the
context), ``temperature`` (1), ``top_p`` (1), ``top_k`` (0 or -1 = all), ``min_p`` (0), ``seed``
(choice i samples with seed + i), ``stop`` (a string or up to 64), ``stop_token_ids``, ``n``,
``stream``, ``logprobs`` (completions: the top-N count; chat: a boolean with ``top_logprobs``),
``stream_options`` (``include_usage``: a last chunk with the usage), ``return_routing``, and the
sampling options of ``sampling.py``: ``logit_bias``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``. Any other field: ``compat``.

Counts are checked before any per-prompt work (prompts x n first), so a body of many small prompts
is refused without tokenising one of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from moekit.serve.chat import ROLES, ChatTemplate
from moekit.serve.compat import unsupported
from moekit.serve.errors import ApiError
from moekit.serve.scheduler import SamplingParams
from moekit.serve.text import prefix_offsets
from moekit.tokenizer import Tokenizer

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP = 64  # stop strings (and stop token ids) per request: each is checked after every token
# NOTE: a string prompt longer than this many characters a context token is refused before it is
# tokenised (which would cost the server time in proportion to the body, for an answer it cannot give):
# byte-level BPE tokens average 3-5 characters of text, and few of any vocabulary pass 64.
MAX_CHARS_PER_TOKEN = 64
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # the second has nothing to hide here: ignored


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; each a flag of ``moekit serve``."""

    max_body: int = 1 << 20  # bytes of a request body (413 beyond)
    max_choices: int = 16  # prompts x n of one request
    max_tokens: int | None = None  # cap on max_tokens (None: the model's context)
    timeout: float = 600.0  # seconds from arrival to the last token


@dataclass(frozen=True)
class Echo:
    """A completions prompt returned before its choices' text (``echo``)."""

    text: str
    offsets: list[int]  # where each prompt token's text begins (logprobs only)


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
    echo: list[Echo] | None = None  # per prompt, with echo
    echo_only: bool = False  # max_tokens 0 with echo: the generated token is not returned
    ignored: list[str] = field(default_factory=list)  # fields taken as vLLM takes unknown ones

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


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n"}
COMMON |= {"stream", "stream_options", "return_routing", "logprobs", "logit_bias", "frequency_penalty"}
COMMON |= {"presence_penalty", "repetition_penalty", "min_tokens", "ignore_eos"}
FIELDS = {
    False: COMMON | {"prompt", "echo", "add_special_tokens"},
    True: COMMON | {"messages", "top_logprobs", "max_completion_tokens"},
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not (_is_int(value) or (not integer and isinstance(value, float))):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, not {value!r}", name)
    if not lo <= value <= hi:  # False for NaN; ints of any size compare exactly (no float())
        raise ApiError(400, f"'{name}'={value!r}: must be in [{lo}, {hi}]", name)
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, not {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    return tuple(stops)


def _token_ids(body: dict, name: str, vocab: int) -> list[int]:
    ids = body.get(name)
    ids = [] if ids is None else ids
    if not (isinstance(ids, list) and len(ids) <= MAX_STOP and all(_is_int(t) and 0 <= t < vocab for t in ids)):
        raise ApiError(400, f"'{name}' must be a list of up to {MAX_STOP} token ids in [0, {vocab})", name)
    return ids


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    why = f"'logit_bias' must map token ids in [0, {vocab}) to numbers in [-100, 100]"
    if not isinstance(bias, dict):
        raise ApiError(400, why, "logit_bias")
    pairs = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else -1
        if not (0 <= token < vocab and (_is_int(value) or isinstance(value, float)) and -100 <= value <= 100):
            raise ApiError(400, f"{why}, not {key!r}: {value!r}", "logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


def _content(message: Any) -> str | None:
    """A message's text: a string, or a list of text parts (OpenAI's ``[{"type": "text", "text"}]``),
    joined; an assistant's null content (one that only called tools) is empty; None if it is neither."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    if content is None and isinstance(message, dict) and message.get("role") == "assistant":
        return ""
    return content if isinstance(content, str) else None


def _chat_prompt(body: dict, template: ChatTemplate) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and _content(m) is not None):
            raise ApiError(
                400,
                f"messages[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': a string or a list of "
                "text parts (null for an assistant)}",
                "messages",
            )
    try:
        return template.render([{"role": m["role"], "content": _content(m)} for m in messages])
    except Exception as err:  # a template's raise_exception, or any Jinja error, names the problem
        raise ApiError(400, f"'messages' do not fit the chat template: {err}", "messages") from None


def _completion_prompts(body: dict) -> list[Any]:
    """The prompts as given (strings or lists of ids), unchecked past their number."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")


def _encode(tokenizer: Tokenizer, prompt: Any, context: int, add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        if len(prompt) > context * MAX_CHARS_PER_TOKEN:
            why = f"more than the context's {context} tokens hold ({MAX_CHARS_PER_TOKEN} characters a token at most)"
            raise ApiError(400, f"the prompt is {len(prompt)} characters: {why}", "prompt")
        try:
            ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except ValueError as err:  # a character outside a char vocabulary, a lone surrogate
            raise ApiError(400, f"the prompt cannot be tokenized: {err}", "prompt") from None
    elif isinstance(prompt, list) and all(_is_int(t) and 0 <= t < tokenizer.vocab_size for t in prompt):
        ids = prompt
    else:
        why = f"each prompt must be a string or a list of token ids in [0, {tokenizer.vocab_size})"
        raise ApiError(400, f"{why}, not {str(prompt)[:80]}", "prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty: give at least one character or token", "prompt")
    if len(ids) >= context:
        raise ApiError(
            400, f"the prompt is {len(ids)} tokens: the context holds {context}, with room to generate", "prompt"
        )
    return ids


def parse_request(
    body: dict, chat: bool, tokenizer: Tokenizer, template: ChatTemplate, context: int, limits: Limits
) -> Request:
    """A checked ``Request`` from a completions (``chat`` False) or chat completions body."""
    ignored = unsupported(body, FIELDS[chat])
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, not {model!r}", "model")
    n = _number(body, "n", 1, 1, limits.max_choices, integer=True)
    given = [None] if chat else _completion_prompts(body)
    if len(given) * n > limits.max_choices:
        raise ApiError(400, f"{len(given)} prompts x n={n}: at most {limits.max_choices} choices per request", "n")
    vocab = tokenizer.vocab_size
    if chat:
        # A rendered chat template holds its special tokens (a BOS) already: the tokenizer adds none.
        prompts = [_encode(tokenizer, _chat_prompt(body, template), context, template.template is None)]
    else:
        special = _flag(body, "add_special_tokens", True)
        prompts = [_encode(tokenizer, p, context, special) for p in given]
    echo = not chat and _flag(body, "echo")
    room = context - max(len(p) for p in prompts)
    cap = min(room, limits.max_tokens or context)
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number(body, name, cap, 0 if echo else 1, math.inf, integer=True)
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
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    ignored += [f"stream_options.{key}" for key in sorted(set(options or {}) - STREAM_OPTIONS)]
    top_k = _number(body, "top_k", 0, -1, vocab, integer=True)
    shared = dict(
        max_tokens=max(max_tokens, 1),  # echo of the prompt alone: one token is generated, and dropped
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_k=max(top_k, 0),  # -1: every token, as 0
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        stop=_stop(body),
        logprobs=logprobs,
        return_routing=_flag(body, "return_routing"),
        prompt_logprobs=echo and logprobs is not None,
        min_tokens=_number(body, "min_tokens", 0, 0, max_tokens, integer=True),
        ignore_eos=_flag(body, "ignore_eos"),
        stop_token_ids=frozenset(_token_ids(body, "stop_token_ids", vocab)),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-9, 100.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, vocab),
    )
    params = [SamplingParams(seed=None if seed is None else seed + j, **shared) for j in range(n)]
    echoes = None
    if echo:
        texts = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(given, prompts, strict=True)]
        offsets = [prefix_offsets(tokenizer, ids) if logprobs is not None else [] for ids in prompts]
        echoes = [Echo(text, at) for text, at in zip(texts, offsets, strict=True)]
    stream = _flag(body, "stream")
    include_usage = _flag(options or {}, "include_usage")
    return Request(chat, model, prompts, n, stream, params, include_usage, echoes, echo and max_tokens == 0, ignored)
