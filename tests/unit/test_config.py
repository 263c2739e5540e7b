"""The config dataclasses on their own, as the CLI builds them."""

from __future__ import annotations

from moekit.config import ModelConfig, MoEConfig


def test_config_dataclasses_have_defaults_for_the_cli() -> None:
    assert ModelConfig().moe_layers() == [0, 1, 2, 3]
    assert MoEConfig(d_model=8, d_ff=8).router == "topk"
