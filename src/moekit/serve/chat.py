"""Chat messages -> one prompt string.

A run directory with a ``chat_template.jinja`` (as transformers 5 saves a template), or a
``tokenizer_config.json`` that has a ``chat_template`` (a Hugging Face model's, copied beside its
converted run by ``moekit convert``) is rendered by transformers' own Jinja renderer, with the
generation prompt appended and the config's ``bos_token`` / ``eos_token`` in scope, as
``apply_chat_template`` does. Without one (a moekit-trained run) the template is plain text: each
message as ``role: content`` on its own line, then ``assistant:`` (no space after the colon), which a
model trained on such transcripts continues.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moekit.fileio import read_json_object

ROLES = ("system", "user", "assistant", "tool", "developer")


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an ``AddedToken`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """The chat format of one run directory (see the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.template: str | None = None
        self.special: dict[str, str] = {}
        config = read_json_object(Path(run_dir) / "tokenizer_config.json")
        special_map = read_json_object(Path(run_dir) / "special_tokens_map.json")  # older directories keep BOS/EOS here
        jinja = Path(run_dir) / "chat_template.jinja"
        try:
            template = jinja.read_text("utf-8") if jinja.is_file() else config.get("chat_template")  # as transformers
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{jinja}: unreadable ({err})") from None
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.template = template if isinstance(template, str) else None
        for name in ("bos_token", "eos_token"):
            if (text := _token_text(config.get(name)) or _token_text(special_map.get(name))) is not None:
                self.special[name] = text

    @property
    def eos_token(self) -> str | None:
        return self.special.get("eos_token")

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for ``messages`` (each ``{"role", "content"}``, already checked)."""
        if self.template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            raise ValueError("this run's chat template needs transformers: pip install transformers") from None
        rendered, _ = render_jinja_template(
            [messages], chat_template=self.template, add_generation_prompt=True, **self.special
        )
        return rendered[0]
