"""Presets, dotted overrides, typed values, and a one-line reason for every field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moekit import runconfig


def test_every_preset_resolves() -> None:
    names = runconfig.preset_names()
    assert {"tiny", "default", "shakespeare-dense", "shakespeare-moe"} <= set(names)
    for name in names:
        cfg = runconfig.resolve(name, {})
        assert cfg.moe.d_model == cfg.model.d_model
    assert not runconfig.resolve("shakespeare-dense", {}).is_moe
    assert runconfig.resolve("shakespeare-moe", {}).is_moe


def test_overrides_are_typed() -> None:
    cfg = runconfig.resolve(
        "tiny",
        {
            "moe.num_experts": "16",
            "moe.capacity_factor": "1.25",
            "model.tie_embeddings": "false",
            "model.n_kv_heads": "none",
            "model.n_layers": "3",
            "model.experts_per_layer": "4,8,16",
        },
    )
    assert cfg.moe.num_experts == 16 and cfg.moe.capacity_factor == 1.25
    assert cfg.model.tie_embeddings is False and cfg.model.n_kv_heads is None
    assert cfg.model.experts_per_layer == [4, 8, 16]


def test_resolved_config_round_trips_through_json(tmp_path) -> None:
    cfg = runconfig.resolve("default", {"moe.d_ff": "64"})
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    again = runconfig.from_json(path)
    assert again == cfg
    assert json.loads(path.read_text())["moe"]["d_ff"] == 64


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"moe.nope": "1"}, "unknown field 'nope'"),
        ({"optim.lr": "1"}, "unknown section 'optim'"),
        ({"model.experts_per_layer": "4,8,16"}, "model.experts_per_layer"),
        ({"model.n_heads": "3"}, "model.n_heads=3"),
        ({"train.min_lr": "1.0"}, "train.min_lr=1.0"),
        ({"moe.router": "magic"}, "moe.router='magic'"),
    ],
)
def test_bad_overrides_name_the_field(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        runconfig.resolve("tiny", overrides)


def test_every_field_has_a_reason() -> None:
    for cls in runconfig.SECTIONS.values():
        missing = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
        assert not missing, f"{cls.__name__}: fields without a one-line reason: {missing}"


def test_max_nonfinite_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"train.max_nonfinite_steps=0: must be a positive integer"):
        runconfig.resolve("tiny", {"train.max_nonfinite_steps": "0"})
