"""A prompt's tokens do not depend on what shares its batch: each row samples from a generator of its
own, and routing that depends on the whole batch is refused for batches of several prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moekit.cli import main
from moekit.infer.generate import generate
from moekit.run.load import load_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, write_run) -> Path:
    return write_run(tmp_path_factory.mktemp("batch") / "run")


def test_each_row_samples_what_its_prompt_alone_samples(run_dir: Path) -> None:
    """Two copies of one prompt in a batch draw the same tokens, the ones it draws alone (a hot
    temperature: one generator shared by the rows would give them different tokens)."""
    model = load_run(run_dir).model
    prompt = torch.tensor([[5, 17, 99, 42]])
    alone = generate(model, prompt, 12, temperature=5.0, seed=3)
    both = generate(model, prompt.repeat(2, 1), 12, temperature=5.0, seed=3)
    assert torch.equal(both[0], both[1]) and torch.equal(both[:1], alone)
    assert not torch.equal(alone, generate(model, prompt, 12, temperature=5.0, seed=4)), "the seed matters"
    assert torch.equal(generate(model, prompt, 6, top_k=0, seed=3), generate(model, prompt, 6, seed=3))  # 0: all


@pytest.mark.parametrize(
    ("field", "value"), [("moe.capacity_factor", "1.0"), ("moe.router", "expert_choice")], ids=["capacity", "choice"]
)
def test_batch_dependent_routing_generates_one_prompt_at_a_time(
    write_run, tmp_path: Path, field: str, value: str, capsys
) -> None:
    run = write_run(tmp_path / "run", **{field: value})
    (tmp_path / "prompts.txt").write_text("ab\nhello there\n")
    base = ["generate", str(run), "--prompts-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "3"]
    assert main([*base, "--batch-size", "1"]) == 0
    capsys.readouterr()
    assert main([*base, "--batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and "batch size 1" in err and len(err.splitlines()) == 1, err
