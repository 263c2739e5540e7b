"""``moekit plan``: the ranked table, and one-line errors for an unknown model or a bad cluster file."""

from __future__ import annotations

from importlib import resources

from moekit.cli import main


def test_plan_cli(capsys, tmp_path) -> None:
    assert main(["plan", "--model", "deepseek-moe-16b", "--cluster", "dgx-h100", "--nodes", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "step s" in out and "tok/s/GPU" in out and "global batch 1024" in out
    assert len(out.strip().splitlines()) == 6
    assert main(["plan", "--model", "nope", "--cluster", "dgx-h100"]) == 2
    assert "--model: unknown preset 'nope'" in capsys.readouterr().err
    bad = tmp_path / "c.toml"
    bad.write_text("nodes = 1\ngpus_per_node = 8\n")
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", str(bad)]) == 2
    assert "missing field(s) peak_tflops" in capsys.readouterr().err
    preset = (resources.files("moekit.configs") / "clusters" / "dgx-h100.toml").read_text()
    bad.write_text(preset + "pass_overhead_us = -1\n")
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", str(bad)]) == 2
    assert "pass_overhead_us=-1 must be a number >= 0" in capsys.readouterr().err
