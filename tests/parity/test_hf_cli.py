"""``moekit convert``, ``export`` and ``upcycle`` on Hugging Face directories, checked against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import TINY, save_hf, save_tokenizer  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

from moekit.cli import main  # noqa: E402
from moekit.run.load import load_run  # noqa: E402
from moekit.serve.chat import ChatTemplate  # noqa: E402
from moekit.serve.server import end_tokens  # noqa: E402

TOL = 1e-4


def max_gap(hf_model: torch.nn.Module, ours: torch.nn.Module) -> float:
    ids = torch.randint(TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return (hf_model(ids).logits - ours(ids).logits).abs().max().item()


CHAT = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {{ eos_token }} {% endfor %}"


def test_convert_generate_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The chat template (transformers 5's chat_template.jinja), special tokens and generation ends go
    with the weights both ways: ``moekit serve`` and transformers chat and stop as the original does."""
    hf_model = save_hf("qwen2_moe", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text(CHAT)
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w5"}))
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    run = tmp_path / "run"
    assert main(["convert", str(tmp_path / "hf"), "--out", str(run)]) == 0
    assert max_gap(hf_model, load_run(run).model) < TOL
    template = ChatTemplate(run)
    assert template.template == CHAT and end_tokens(run, load_run(run).tokenizer, template) == {3, 4, 5}
    capsys.readouterr()
    greedy = ["generate", str(run), "--prompt", "w1 w2 w3", "--temperature", "0", "--max-new-tokens", "6"]
    assert main(greedy) == 0
    assert capsys.readouterr().out.split()[:3] == ["w1", "w2", "w3"]

    out = tmp_path / "out"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").read_text() == CHAT
    assert GenerationConfig.from_pretrained(out).eos_token_id == [3, 4]
    assert max_gap(AutoModelForCausalLM.from_pretrained(out).eval(), load_run(run).model) < TOL
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 2  # never over another model
    half = tmp_path / "bf16"
    assert main(["export", str(run), "--format", "hf", "--out", str(half), "--dtype", "bf16"]) == 0
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    full, bf16 = load_file(out / "model.safetensors"), load_file(half / "model.safetensors")
    assert full.keys() == bf16.keys() and all(torch.equal(full[k].bfloat16(), bf16[k]) for k in full)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"  # the run's own


def test_upcycle_a_hugging_face_dense_model(tmp_path: Path) -> None:
    hf_model = save_hf("llama", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert main(["upcycle", str(tmp_path / "hf"), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "up")]) == 0
    up = load_run(tmp_path / "up")
    assert up.config.is_moe and up.tokenizer.vocab_size == TINY["vocab_size"]
    assert json.loads((tmp_path / "up" / "generation_config.json").read_text()) == {"eos_token_id": 2}
    assert max_gap(hf_model, up.model) < TOL


def test_upcycled_qwen2_exports_with_its_biases(tmp_path: Path) -> None:
    """Qwen2's q/k/v biases survive ``upcycle`` then ``export --format hf`` (as Qwen2-MoE, not Mixtral,
    which has no place for them); noise makes the experts differ, so routing counts too."""
    hf_model = save_hf("qwen2", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    up = tmp_path / "up"
    argv = ["upcycle", str(tmp_path / "hf"), "--experts", "4", "--top-k", "2", "--noise", "0.3", "--out", str(up)]
    assert main(argv) == 0
    ours = load_run(up).model
    assert ours.cfg.qkv_bias and max_gap(hf_model, ours) > 1e-3  # the noise moved it away from the dense model
    out = tmp_path / "out"
    assert main(["export", str(up), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]
    assert max_gap(AutoModelForCausalLM.from_pretrained(out).eval(), ours) < TOL


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_hf("olmoe", tmp_path / "olmoe")
    save_tokenizer(tmp_path / "olmoe")
    assert main(["convert", str(tmp_path / "olmoe"), "--out", str(tmp_path / "run")]) == 0
    save_hf("llama", tmp_path / "dense")
    save_tokenizer(tmp_path / "dense")
    config = json.loads((tmp_path / "olmoe" / "config.json").read_text())
    for name, edited in [
        ("null_top_k", config | {"num_experts_per_tok": None}),
        ("rope_string", config | {"rope_parameters": "yarn"}),
        ("list", [config]),
    ]:
        shutil.copytree(tmp_path / "olmoe", tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(edited))
    capsys.readouterr()
    cases = [
        (["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "o")], "model.qk_norm=True"),
        (["convert", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")], "no config.json"),
        (["convert", str(tmp_path / "olmoe"), "--out", str(tmp_path / "run")], "already holds a run"),
        (["upcycle", str(tmp_path / "run"), "--experts", "4", "--out", str(tmp_path / "u")], "already has MoE blocks"),
        (["convert", str(tmp_path / "null_top_k"), "--out", str(tmp_path / "x")], "config.json: a field of the wrong"),
        (["convert", str(tmp_path / "rope_string"), "--out", str(tmp_path / "x")], "config.json: a field of the wrong"),
        (["convert", str(tmp_path / "list"), "--out", str(tmp_path / "x")], "config.json: a field of the wrong"),
        (["upcycle", str(tmp_path / "dense"), "--top-k", "1", "--out", str(tmp_path / "u")], "--top-k=1: upcycling"),
        (["export", str(tmp_path / "run"), "--out", str(tmp_path / "s"), "--dtype", "bf16"], "only with --format hf"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
