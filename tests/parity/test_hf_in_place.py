"""Offloaded generation straight from a Hugging Face directory (experts read by byte range from its
shards, no converted copy) against convert-then-generate and transformers' own greedy decoding (fp32).

Reference: ``generate`` on the converted run with the same budget, and ``transformers.generate``:
the same 16 greedy tokens, exactly. The budget holds the non-expert weights and 2 experts, fewer
than one layer has, so the cache evicts on every layer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import hf_greedy, save_hf, save_tokenizer  # noqa: E402
from test_hf_deepseek import V2_LITE, V3, save_deepseek  # noqa: E402
from test_hf_parity import tokens  # noqa: E402

from moekit.cli import main  # noqa: E402
from moekit.convert import ConversionError  # noqa: E402
from moekit.infer import resident_experts  # noqa: E402
from moekit.infer.generate import generate  # noqa: E402
from moekit.infer.offload import OffloadOptions, model_bytes  # noqa: E402
from moekit.model_dir import load_for_inference  # noqa: E402
from moekit.run.load import load_run  # noqa: E402

NEW_TOKENS = 16
SLOTS = 2  # experts the cache holds


def _budget(path: Path) -> int:
    probe, _ = load_for_inference(path, offload=OffloadOptions(1 << 40), prepack=False)
    try:
        return model_bytes(probe.model) + SLOTS * probe.offloader.cache.slot_bytes
    finally:
        probe.offloader.close()


def _greedy(path: Path, budget: int, prompt: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loaded, _ = load_for_inference(path, offload=OffloadOptions(budget, prefetch="off"))
    try:
        return generate(loaded.model, prompt, NEW_TOKENS, temperature=0), vars(loaded.offloader.stats).copy()
    finally:
        loaded.offloader.close()


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.rglob("*"))}


def _save(family: str, directory: Path) -> torch.nn.Module:
    if family.startswith("deepseek"):
        config = V3 if family == "deepseek_v3" else V2_LITE
        return save_deepseek(family, directory, **config)
    return save_hf(family, directory, shard_size="40KB" if family == "mixtral" else None, router_scale=3.0)


SLOW_FAMILIES = ("olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3")  # the fast tier reads Mixtral and Qwen2-MoE


@pytest.mark.parametrize(
    "family",
    ["mixtral", "qwen2_moe", *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW_FAMILIES)],
)
def test_in_place_greedy_equals_converted_and_transformers(family: str, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf_model = _save(family, hf)
    save_tokenizer(hf)
    if family == "mixtral":
        assert len(list(hf.glob("model-*.safetensors"))) > 1, "experts spread over several shards"
    before = _files(hf)
    budget = _budget(hf)
    prompt = tokens(hf_model.config.vocab_size, (1, 8))
    got, stats = _greedy(hf, budget, prompt)
    assert _files(hf) == before, "nothing written into the Hugging Face directory"
    assert stats["misses"] > stats["hits"] and stats["reads"] > SLOTS, "the cache evicted"

    run = tmp_path / "run"
    assert main(["convert", str(hf), "--out", str(run)]) == 0
    converted = load_run(run, offload=OffloadOptions(1 << 40))
    converted_budget = model_bytes(converted.model) + SLOTS * converted.offloader.cache.slot_bytes
    converted.offloader.close()
    expected, _ = _greedy(run, converted_budget, prompt)
    assert torch.equal(got, expected)
    assert torch.equal(got, hf_greedy(hf_model, prompt, NEW_TOKENS))


@pytest.mark.slow
def test_cli_generates_from_a_hugging_face_directory_writing_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m moekit generate HF_DIR --memory-budget B`` in a child process whose temporary directory
    is empty: nothing appears there or in the Hugging Face directory; the text is the resident model's,
    in the checkpoint's bf16 (the resident model's weights prepacked, where this CPU has the kernels)."""
    hf, temp = tmp_path / "hf", tmp_path / "tmp"
    model = save_hf("qwen3_moe", tmp_path / "fp32", router_scale=3.0, hidden_size=128, moe_intermediate_size=2048)
    model.to(torch.bfloat16).save_pretrained(hf)
    save_tokenizer(hf)
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    before, budget = _files(hf), str(_budget(hf))
    argv = ["generate", str(hf), "--prompt", "w1 w2 w3", "--temperature", "0", "--max-new-tokens", "12"]
    cli = [sys.executable, "-m", "moekit", *argv]
    proc = subprocess.run([*cli, "--memory-budget", budget], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:3] == ["w1", "w2", "w3"] and len(proc.stdout.split()) == 15
    assert "experts read in place from" in proc.stderr and "no copy written" in proc.stderr
    assert "hit rate" in proc.stderr
    assert _files(hf) == before and not list(temp.iterdir())
    resident = subprocess.run(cli, capture_output=True, text=True, timeout=300)  # converted in memory
    assert resident.returncode == 0 and resident.stdout == proc.stdout


def test_layouts_that_cannot_be_read_in_place_are_refused(tmp_path: Path, capsys) -> None:
    save_hf("gpt_oss", tmp_path / "gpt")
    save_tokenizer(tmp_path / "gpt")
    with pytest.raises(ConversionError, match=r"gpt_oss stores all experts in one tensor .*gate and up interleaved"):
        load_for_inference(tmp_path / "gpt", offload=OffloadOptions(1 << 40))
    save_hf("mixtral", tmp_path / "mix")
    save_tokenizer(tmp_path / "mix")
    argv = ["generate", str(tmp_path / "mix"), "--memory-budget", "1GB", "--expert-format", "int8"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--expert-format=int8: " in err and "convert it first" in err


def test_experts_in_another_dtype_than_the_run_are_refused(tmp_path: Path) -> None:
    """Experts are read as stored: a bf16 run of an fp32 checkpoint, or an FP8 checkpoint (its experts
    need their scales), must be converted first, not computed in the wrong dtype."""
    from test_hf_fp8 import quantize_dir

    save_hf("qwen3_moe", tmp_path / "hf", vocab_size=97)
    save_tokenizer(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"dtype='bfloat16': .* stored as float32 .*convert first"):
        load_for_inference(tmp_path / "hf", offload=OffloadOptions(1 << 40), dtype=torch.bfloat16)
    quantize_dir(tmp_path / "hf", tmp_path / "dequantized")
    with pytest.raises(ValueError, match=r"stored as float8_e4m3fn .*dequantised, convert first"):
        load_for_inference(tmp_path / "hf", offload=OffloadOptions(1 << 40))


@pytest.mark.parametrize(
    ("dtype", "source", "prepack"),
    [
        (torch.bfloat16, "hf", True),  # the CLI's route: prepacked weights where the CPU has the kernels
        (torch.bfloat16, "hf", False),
        (torch.float16, "hf", True),
        (torch.bfloat16, "run", True),
        (torch.bfloat16, "run", False),
        (torch.float32, "hf", True),
        (torch.float16, "hf", False),
    ],
)
@pytest.mark.parametrize("slots", [2, None])
def test_offloaded_experts_compute_exactly_what_resident_ones_compute(
    dtype, source, prepack, slots, tmp_path, monkeypatch
) -> None:
    """A Hugging Face directory read in place, or its conversion to a run (16-bit experts stored [in,
    out]): offloaded experts (a budget of 2 slots, evicting in every layer, or one holding them all) give
    the resident model's logits bit for bit, prefill and decode, prepacked or not. Both multiply each
    expert's rows with the same kernel over the same weights: plain, or oneDNN's prepacked experts'
    kernel, which the offloaded ones call on their slot's weight (16-bit: reordered on each call; fp32:
    reordered once per read and kept, the budget's 2 slots becoming 1 and its copy), or, for bf16 on a
    CPU without native bf16, the row layout's kernel. An offloaded fp32 model keeps the packed layout
    everywhere, so the resident one compared is loaded packed too (where fp32 is otherwise kept plain)."""
    from moekit.experts.matmul import prepackable
    from moekit.infer.generate import decode_step, prefill
    from moekit.kernels import rows_available

    # NOTE: experts 2048 wide: from there oneDNN's one-row products sum in another order than ATen's GEMV
    hf_model = save_hf("mixtral", tmp_path / "fp32", router_scale=3.0, hidden_size=128, intermediate_size=2048)
    hf_model.to(dtype).save_pretrained(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    path = tmp_path / source
    if source == "run":
        assert main(["convert", str(tmp_path / "hf"), "--out", str(path)]) == 0
    monkeypatch.setattr(resident_experts, "plain_fp32", lambda: False)  # as an offloaded fp32 model
    resident, _ = load_for_inference(path, prepack=prepack)
    assert resident.model.embed.weight.dtype == dtype
    budget = _budget(path) + (0 if slots else 1 << 30)
    offloaded, _ = load_for_inference(path, offload=OffloadOptions(budget, prefetch="off"), prepack=prepack)
    packs = prepack and prepackable(resident.model.embed.weight)
    rows = prepack and not packs and dtype == torch.bfloat16 and rows_available()  # the row layout (AVX2)
    assert offloaded.offloader.kernel == ("packed" if packs else "rows" if rows else "mm")
    assert any(type(m).__name__ == "PackedExperts" for m in resident.model.modules()) == packs
    try:
        prompt = tokens(hf_model.config.vocab_size, (1, 8))
        for batch in (prompt, torch.cat([prompt, prompt.flip(1)])):  # one sequence (GEMV kernels) and two
            logits = [prefill(run.model, batch) for run in (resident, offloaded)]
            assert torch.equal(logits[0][0], logits[1][0])
            token = logits[0][0].argmax(-1, keepdim=True)
            for _ in range(4):
                steps = [
                    decode_step(run.model, token, cache)
                    for run, (_, cache) in zip((resident, offloaded), logits, strict=True)
                ]
                assert torch.equal(steps[0], steps[1])
                token = steps[0].argmax(-1, keepdim=True)
        stats = offloaded.offloader.stats
        assert (stats.misses > stats.hits) == bool(slots), "a cache of 2 evicts; a large one does not"
    finally:
        offloaded.offloader.close()


@pytest.mark.slow
def test_served_offloaded_logprobs_equal_the_resident_servers(tmp_path: Path) -> None:
    """Through the real server, as a client sees it: the same bf16 Hugging Face directory served resident
    (weights prepacked where the CPU has the kernels) and with ``--memory-budget`` (a cache of 2 experts,
    evicting in every layer) answer a greedy request with the same tokens and the same logprobs, to the
    last bit of each float the server prints: oneDNN's kernel and ATen's order their sums differently
    over 2048 inputs, which shows in the logprobs long before it changes a greedy token."""
    import json
    import urllib.request

    from helpers import serving

    hf = tmp_path / "hf"
    model = save_hf("mixtral", tmp_path / "fp32", router_scale=3.0, hidden_size=128, intermediate_size=2048)
    model.to(torch.bfloat16).save_pretrained(hf)
    save_tokenizer(hf)
    body = json.dumps({"prompt": "w1 w2 w3 w4", "max_tokens": 12, "temperature": 0, "logprobs": 5}).encode()
    answers = []
    for flags in ([], ["--memory-budget", str(_budget(hf))]):
        with serving(hf, *flags) as (_, url):
            request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            answers.append(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0])
    assert len(answers[0]["logprobs"]["token_logprobs"]) == 12
    assert answers[0]["text"] == answers[1]["text"] and answers[0]["logprobs"] == answers[1]["logprobs"]
