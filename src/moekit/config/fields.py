"""How a config field is declared: its default, its one-line reason (what ``moekit train --help`` shows)
and what a valid value is (one of a few choices, or within a bound), all in the dataclass field's metadata, so the help
text and the error a bad value gets come from the field itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REQUIRED: Any = dataclasses.MISSING  # a field without a default (``option(REQUIRED, ...)``)


@dataclass(frozen=True)
class Check:
    """What one field's valid values are: ``ok(value)``, else ``{field}={value!r}: {why}``."""

    ok: Callable[[Any], bool]
    why: str


def choice(*values: str) -> Check:
    """One of ``values``."""
    return Check(lambda v: v in values, f"must be one of {', '.join(values)}")


POSITIVE_INT = Check(lambda v: isinstance(v, int) and v > 0, "must be a positive integer")
NONNEGATIVE_INT = Check(lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0")
POSITIVE = Check(lambda v: v > 0, "must be > 0")
NONNEGATIVE = Check(lambda v: v >= 0, "must be >= 0")


def option(default: Any, help: str, check: Check | None = None) -> Any:
    """A config field: its default, its one-line reason and what a valid value is (``choice(...)`` or a
    bound; a field whose default is None may be None: unset)."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


def require(ok: bool, field: str, value: object, why: str) -> None:
    """A check across fields (or one no ``Check`` says): ``ValueError`` naming the field and its value."""
    if not ok:
        raise ValueError(f"{field}={value!r}: {why}")


def check_fields(config: Any, prefix: str = "") -> None:
    """Each field of ``config`` against its own check, in field order; errors name ``prefix + name``
    (``model.n_layers``)."""
    for f in dataclasses.fields(config):
        value, check = getattr(config, f.name), f.metadata.get("check")
        if check is not None and not (value is None and f.default is None):  # None: an optional field unset
            require(check.ok(value), prefix + f.name, value, check.why)
