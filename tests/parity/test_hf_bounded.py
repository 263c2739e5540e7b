"""Conversion of sharded bf16 checkpoints: the dtype is kept, memory is bounded by one tensor, and a
broken input is one line through the real command line. References: transformers' own model loaded
in the same dtype; tolerances stated beside each comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import hf_greedy, save_hf, save_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moekit.cli import main  # noqa: E402
from moekit.convert.stream import open_hf  # noqa: E402
from moekit.infer.generate import generate  # noqa: E402
from moekit.run.layout import latest_checkpoint  # noqa: E402
from moekit.run.load import load_run  # noqa: E402
from moekit.run.safetensors_io import read_header  # noqa: E402

FP32_TOL = 1e-4  # both sides compute in fp32 from the same (bf16-rounded) weights, in a different order
# bf16 keeps 8 significant bits: each model's rounding moves the logits by a few % of their scale
# (measured ~2-3% here, either side); the two bf16 models must agree within 5% of the logits' scale.
BF16_REL_TOL = 0.05
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    """A tiny Mixtral saved by transformers in bf16 as five shards, with a tokenizer."""
    root = tmp_path_factory.mktemp("bf16")
    model = save_hf("mixtral", root / "fp32", router_scale=3.0)
    model.to(torch.bfloat16).save_pretrained(root / "hf", max_shard_size="40KB")
    save_tokenizer(root / "hf")
    return root / "hf"


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _ids() -> torch.Tensor:
    return torch.randint(96, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_bf16_shards_convert_in_bf16_and_match_transformers(bf16_dir: Path, tmp_path: Path) -> None:
    assert len(list(bf16_dir.glob("model-*.safetensors"))) >= 5
    run = tmp_path / "run"
    assert main(["convert", str(bf16_dir), "--out", str(run)]) == 0
    stored = {e.dtype for e in read_header(latest_checkpoint(run) / "model.safetensors").values()}
    assert stored == {torch.bfloat16, torch.float32}  # parameters bf16; the routers' zero bias buffers fp32
    ours = load_run(run).model
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    hf16 = AutoModelForCausalLM.from_pretrained(bf16_dir).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()
    assert hf16.dtype == torch.bfloat16
    ids = _ids()
    reference = _logits(hf32, ids)
    gap = (_logits(hf16, ids) - _logits(ours, ids)).abs().max().item()
    assert gap < BF16_REL_TOL * reference.abs().max().item()
    prompt = ids[:1, :8]
    assert torch.equal(hf_greedy(hf16, prompt, 32), generate(ours, prompt, 32, temperature=0))


def test_dtype_flag_converts_to_fp32(bf16_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["convert", str(bf16_dir), "--out", str(run), "--dtype", "fp32"]) == 0
    ours = load_run(run).model
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    hf32 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()
    ids = _ids()
    assert (_logits(hf32, ids) - _logits(ours, ids)).abs().max().item() < FP32_TOL


def test_generate_dtype_flag_casts_a_bf16_run(bf16_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["convert", str(bf16_dir), "--out", str(run)]) == 0
    assert {p.dtype for p in load_run(run, dtype=torch.float32).model.parameters()} == {torch.float32}


def test_conversion_holds_one_tensor_at_a_time(bf16_dir: Path, tmp_path: Path) -> None:
    """The reader counts the bytes of every tensor it handed out until freed: streaming the whole
    checkpoint never holds more than a small part of one input shard."""
    checkpoint = open_hf(bf16_dir)
    checkpoint.write(tmp_path / "model.safetensors")
    source = checkpoint.source
    assert source.live_bytes == 0
    largest_tensor = max(e.end - e.begin for e in source.entries.values())
    assert 0 < source.peak_live_bytes <= 3 * largest_tensor  # q, k and v joined together, at most
    assert source.peak_live_bytes < max(source.shard_bytes.values())  # the bound the converter promises
    assert source.peak_live_bytes < sum(source.shard_bytes.values()) / 10


def _corrupt(hf: Path) -> str:
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + shard.read_bytes()[24:])
    return shard.name


def _truncate(hf: Path) -> str:
    shard = sorted(hf.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard.name


def _drop_shard(hf: Path) -> str:
    shard = sorted(hf.glob("model-*.safetensors"))[3]
    shard.unlink()
    return shard.name


def _misplace(hf: Path) -> str:
    index = hf / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = "model-00001-of-00005.safetensors"
    key = next(k for k, file in sorted(data["weight_map"].items()) if file != first)
    data["weight_map"][key] = first
    index.write_text(json.dumps(data))
    return key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "flags"),
    [(_corrupt, []), (_truncate, []), (_drop_shard, []), (_misplace, []), (None, ["--dtype", "bf17"])],
    ids=["corrupt-shard", "truncated-shard", "missing-shard", "index-misplaces", "dtype-flag"],
)
def test_bad_checkpoint_is_one_line_naming_it(bf16_dir: Path, tmp_path: Path, edit, flags: list[str]) -> None:
    import shutil

    hf, out = tmp_path / "hf", tmp_path / "out"
    shutil.copytree(bf16_dir, hf)
    named = edit(hf) if edit else "--dtype"
    done = subprocess.run(
        [sys.executable, "-m", "moekit", "convert", str(hf), "--out", str(out), *flags],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith("moekit convert: error: ") and named in lines[0], lines[0]
    assert not out.exists(), "a run directory was created"
