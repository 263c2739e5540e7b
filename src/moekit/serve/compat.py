"""Request fields moekit does not act on. Clients written for OpenAI or vLLM send many of them as a
matter of course, so a field moekit does not know is ignored, as vLLM ignores one, and named in a
logged warning. A field that would change the answer if it were ignored (a constraint on the output,
a change to the prompt, a different response shape) is refused by name unless it holds the value at
which it changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moekit.serve.errors import ApiError


def _unset(value: Any, body: dict) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def _none(value: Any, body: dict) -> bool:
    return value is None


def _one_of(*neutral: Any) -> Callable[[Any, dict], bool]:
    return lambda value, body: value is None or any(value == v and type(value) is type(v) for v in neutral)


def _best_of(value: Any, body: dict) -> bool:  # as many drawn as returned: nothing is chosen among them
    n = body.get("n") or 1
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value == n)


# Each field with the test of its neutral value (the only one accepted).
NEUTRAL: dict[str, Callable[[Any, dict], bool]] = {
    "suffix": _unset,
    "best_of": _best_of,
    "response_format": lambda value, body: value is None or value == {"type": "text"},
    "tool_choice": _one_of("none", "auto"),  # tools are not shown to the model: it may not be made to call one
    "function_call": _one_of("none", "auto"),
    "echo": _unset,  # chat (completions support it)
    "include_stop_str_in_output": _unset,
    "skip_special_tokens": _one_of(True),
    "use_beam_search": _unset,
    "length_penalty": _one_of(1, 1.0),
    "prompt_logprobs": _none,
    "allowed_token_ids": _none,
    "bad_words": _unset,
    "truncate_prompt_tokens": _none,
    "structured_outputs": _unset,
    "guided_json": _unset,
    "guided_regex": _unset,
    "guided_choice": _unset,
    "guided_grammar": _unset,
    "logits_processors": _unset,
    "return_tokens_as_token_ids": _unset,
    "return_token_ids": _unset,
    "logprob_token_ids": _none,
    "thinking_token_budget": _one_of(-1),
    "repetition_detection": _none,
    "chat_template": _unset,
    "chat_template_kwargs": _unset,
    "documents": _unset,
    "continue_final_message": _unset,
    "add_generation_prompt": _one_of(True),
}
SILENT = {"user"}  # OpenAI's, with no bearing on any answer: not worth a warning


def unsupported(body: dict, supported: set[str]) -> list[str]:
    """The fields of ``body`` outside ``supported`` that are ignored (sorted); raises ``ApiError`` for
    the first one that would change the answer."""
    ignored = []
    for name in sorted(set(body) - supported):
        neutral = NEUTRAL.get(name)
        if neutral is None:
            ignored += [] if name in SILENT else [name]
        elif not neutral(body[name], body):
            raise ApiError(400, f"'{name}'={body[name]!r}: not supported (ignoring it would change the answer)", name)
    return ignored
