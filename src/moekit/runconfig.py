"""A training run's configuration: TOML presets, dotted command-line overrides, resolved JSON.

A run has five sections, one dataclass each: ``model`` (ModelConfig), ``moe`` (MoEConfig, whose
d_model comes from the model and whose d_ff defaults to model.d_ff), ``data``, ``train`` and
``parallel`` (how the run is spread over ranks).
``--moe.num_experts 16`` on the command line overrides ``[moe] num_experts`` of the preset.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from moekit.config import DataConfig, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moekit.errors import OptionError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
}
_MOE_FROM_MODEL = ("d_model",)  # moe fields the model section decides


@dataclass
class RunConfig:
    model: ModelConfig
    moe: MoEConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @property
    def is_moe(self) -> bool:
        return bool(self.model.moe_layers())


def preset_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml") for p in resources.files("moekit.configs").iterdir() if p.name.endswith(".toml")
    )


def load_preset(name: str) -> dict[str, dict[str, Any]]:
    """The raw section tree of a preset shipped in ``moekit/configs`` (or of a TOML file path)."""
    path = Path(name)
    if path.suffix == ".toml" and path.is_file():
        text = path.read_text()
    else:
        if name not in preset_names():
            raise OptionError(
                "preset", f"unknown preset {name!r} (choose from {', '.join(preset_names())}, or a .toml file)"
            )
        text = resources.files("moekit.configs").joinpath(f"{name}.toml").read_text()
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"preset {name}: invalid TOML: {err}") from None
    return _checked(tree, f"preset {name}")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_value(text: str, annotation: Any, name: str) -> Any:
    """Convert a command-line string to the field's type (int, float, bool, str, X | None, list[int])."""
    args = typing.get_args(annotation)
    if type(annotation) is types.UnionType or typing.get_origin(annotation) is typing.Union:
        if text.lower() in ("none", "null"):
            return None
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    try:
        if annotation is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typing.get_origin(annotation) is list:
            return [args[0](item) for item in text.strip("[]").replace(" ", "").split(",") if item]
        return annotation(text)
    except (ValueError, TypeError):
        raise ValueError(f"--{name}: cannot read {text!r} as {getattr(annotation, '__name__', annotation)}") from None


def check_value(value: Any, annotation: Any, name: str) -> Any:
    """``value`` from a TOML or JSON config as the field's type (an int where a float is wanted widens)."""
    if type(annotation) is types.UnionType or typing.get_origin(annotation) is typing.Union:
        if value is None:
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        if isinstance(value, list):
            item = typing.get_args(annotation)[0]
            return [check_value(v, item, name) for v in value]
    elif annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, annotation) and not (annotation is int and isinstance(value, bool)):
        return value
    wanted = getattr(annotation, "__name__", str(annotation))
    raise ValueError(f"{name} = {value!r}: expected {wanted}")


def apply_overrides(tree: dict[str, dict[str, Any]], overrides: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A copy of ``tree`` with ``{"section.field": "text"}`` overrides applied, typed by the dataclasses."""
    merged = {section: dict(tree.get(section, {})) for section in SECTIONS}
    for dotted, text in overrides.items():
        section, _, name = dotted.partition(".")
        cls = SECTIONS.get(section)
        if cls is None:
            raise ValueError(f"--{dotted}: unknown section {section!r} (sections: {', '.join(SECTIONS)})")
        types_ = _field_types(cls)
        if name not in types_:
            raise ValueError(f"--{dotted}: unknown field {name!r} of [{section}] (see moekit train --help)")
        merged[section][name] = parse_value(text, types_[name], dotted)
    return merged


def _typed(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Known sections and fields only, each value of its field's type."""
    unknown_sections = set(tree) - set(SECTIONS)
    if unknown_sections:
        raise ValueError(f"unknown config section [{sorted(unknown_sections)[0]}] (sections: {', '.join(SECTIONS)})")
    typed = {}
    for section, cls in SECTIONS.items():
        values = tree.get(section, {})
        if not isinstance(values, dict):
            raise ValueError(f"config section [{section}] must be a table of fields, not {values!r}")
        types_ = _field_types(cls)
        for key in values:
            if key not in types_:
                raise ValueError(f"unknown config field {section}.{key}")
        typed[section] = {key: check_value(v, types_[key], f"{section}.{key}") for key, v in values.items()}
    return typed


def build(tree: dict[str, dict[str, Any]]) -> RunConfig:
    """Validate a section tree into a RunConfig; every error names section.field."""
    tree = _typed(tree)
    model = ModelConfig(**tree.get("model", {}))
    moe_values = dict(tree.get("moe", {}))
    for key in _MOE_FROM_MODEL:
        if key in moe_values and moe_values[key] != getattr(model, key):
            raise ValueError(f"moe.{key}={moe_values[key]!r}: set by model.{key} ({getattr(model, key)})")
    moe_values["d_model"] = model.d_model
    moe_values.setdefault("d_ff", model.d_ff)
    moe = _with_prefix("moe", lambda: MoEConfig(**moe_values))
    for n in model.experts_per_layer or []:
        if n < moe.top_k:
            raise ValueError(
                f"model.experts_per_layer={model.experts_per_layer!r}: each needs >= moe.top_k={moe.top_k}"
            )
    data, train = DataConfig(**tree.get("data", {})), TrainConfig(**tree.get("train", {}))
    return RunConfig(model, moe, data, train, ParallelConfig(**tree.get("parallel", {})))


def for_model(model: ModelConfig, moe: MoEConfig | None, data: DataConfig | None = None) -> RunConfig:
    """The run config of a model made outside training (converted, upcycled); train at its defaults."""
    moe_values = {} if moe is None else {k: v for k, v in dataclasses.asdict(moe).items() if k != "d_model"}
    data_values = dataclasses.asdict(data) if data is not None else {}
    return build({"model": dataclasses.asdict(model), "moe": moe_values, "data": data_values})


def _with_prefix(section: str, make):
    """MoEConfig names its fields bare (it is also used on its own); prefix them with the section."""
    try:
        return make()
    except ValueError as err:
        raise ValueError(f"{section}.{err}") from None


def resolve(preset: str, overrides: dict[str, str]) -> RunConfig:
    return build(apply_overrides(load_preset(preset), overrides))


def read_tree(path: Path) -> dict[str, dict[str, Any]]:
    """The section tree of a resolved config a run wrote (``RUN_DIR/config.json``)."""
    try:
        tree = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read the run's config: {err}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: not a run config (a JSON object of sections)")
    for key in _MOE_FROM_MODEL:
        section = tree.get("moe")
        if isinstance(section, dict):
            section.pop(key, None)
    return _checked(tree, str(path))


def _checked(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """``tree`` with its fields type-checked; a mistake names ``source`` and the field."""
    try:
        return _typed(tree)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def from_json(path: Path) -> RunConfig:
    """The resolved config a run wrote into its directory."""
    return build(read_tree(path))
