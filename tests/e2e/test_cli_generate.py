"""``moekit generate``: bad sampling flags and a corrupt checkpoint are one line; an offloaded batch runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import budget_for, moekit_cli, moekit_clis, tiny

from moekit.experts.matmul import prepack, prepackable
from moekit.infer.offload import OffloadOptions, model_bytes
from moekit.run.layout import CheckpointError, latest_checkpoint
from moekit.run.load import load_run
from moekit.train.loop import train
from moekit.units import format_bytes


def test_cli_generate_offloaded_batch(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from moekit.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ab\nhello\n\nxyz\n")
    budget = str(budget_for(run_dir, 2))
    argv = ["generate", str(run_dir), "--prompts-file", str(prompts), "--batch-size", "2", "--max-new-tokens", "5"]
    assert main([*argv, "--memory-budget", budget, "--temperature", "0", "--policy", "lfu"]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 3 and out.out.startswith("ab")
    assert "tokens/s" in out.err and "hit rate" in out.err and "read " in out.err
    assert main([*argv, "--memory-budget", "10KB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "smaller than the non-expert weights" in err
    assert main([*argv, "--memory-budget", budget, "--policy", "mru"]) == 2
    assert "--policy=mru: choose from" in capsys.readouterr().err


@pytest.mark.slow
def test_offloaded_bf16_at_batch_one_decodes_without_native_bf16(run_dir: Path, tmp_path: Path) -> None:
    """``--dtype bf16 --memory-budget`` at batch 1 where the CPU has no native bf16 (oneDNN limited to
    AVX2, moekit's kernels to their AVX2 build): the resident weights take the row layout and the
    offloaded experts its kernel over their slots (oneDNN has no bf16 product there to pack for, and a
    packed one raised), and it decodes."""
    from moekit import kernels

    if "avx2" not in kernels.runnable_isas() or not kernels.rows_available():
        pytest.skip("this CPU does not run the AVX2 build, or no compiler builds it")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "MOEKIT_MAX_CPU_ISA": "avx2", "MOEKIT_CACHE": str(tmp_path)}
    argv = ["--dtype", "bf16", "--memory-budget", str(budget_for(run_dir, 2)), "--temperature", "0"]
    proc = moekit_cli("generate", str(run_dir), "--prompt", "ab", "--max-new-tokens", "6", *argv, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ab") and len(proc.stdout.splitlines()) == 1 and "hit rate" in proc.stderr
    assert len(list((tmp_path / "kernels").glob("decode-avx2-*.so"))) == 1 and "note:" not in proc.stderr


@pytest.mark.slow
def test_corrupt_checkpoint_is_named(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2"}), run, progress=False)
    weights = latest_checkpoint(run) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt"):
        load_run(run)
    proc = moekit_cli("generate", str(run), "--max-new-tokens", "5")
    assert proc.returncode == 2 and "model.safetensors: corrupt" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, message",
    [
        (["--top-p", "0"], "--top-p=0.0"),
        (["--top-k", "-3"], "--top-k=-3"),
        (["--temperature", "-1"], "--temperature=-1.0"),
    ],
)
def test_generate_rejects_bad_sampling_flags(flag: list[str], message: str, tmp_path: Path) -> None:
    proc = moekit_cli("generate", str(tmp_path), *flag)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("weights", ["expert", "dense"])
def test_cli_generates_with_weights_quantized_in_memory(write_run, tmp_path: Path, weights: str, fmt: str) -> None:
    """``--expert-format`` without ``--memory-budget`` quantizes the experts at load (it was ignored),
    ``--dense-format`` attention and the head: the text is the quantized model's, not the full-precision
    one's (a model whose weights move its greedy tokens: untied, larger weights), and no file is
    written into the run."""
    import torch

    from moekit.infer.generate import generate_text
    from moekit.model_dir import load_for_inference

    run = write_run(tmp_path / "run", **{"model.init_std": "0.2", "model.tie_embeddings": "false"})
    before = sorted(p.name for p in run.rglob("*"))
    argv = ["--prompt", "the king", "--temperature", "0", "--max-new-tokens", "16"]
    proc = moekit_cli("generate", str(run), f"--{weights}-format", fmt, *argv)
    assert proc.returncode == 0, proc.stderr
    with torch.no_grad():
        loaded = load_for_inference(run, **{f"{weights}_format": fmt})[0]
        quantized = generate_text(loaded, "the king", 16, temperature=0)
        full = generate_text(load_for_inference(run)[0], "the king", 16, temperature=0)
    assert quantized != full, "the test model must tell the formats apart"
    assert proc.stdout == quantized + "\n"
    assert sorted(p.name for p in run.rglob("*")) == before, "nothing written"


@pytest.mark.slow
def test_cli_refuses_a_bad_expert_format_and_a_dense_run(run_dir: Path, write_run, tmp_path: Path) -> None:
    dense = write_run(tmp_path / "dense", **{"model.moe_every": "0"})
    # Five separate commands, started side by side (each is its own process, as a user runs it).
    bad_expert, dense_expert, dense_offload, bad_dense, dense_offloaded = moekit_clis(
        ["generate", str(run_dir), "--expert-format", "int3"],
        ["generate", str(dense), "--expert-format", "int8"],
        ["generate", str(dense), "--memory-budget", "1GB"],  # load_run(offload=...) is --memory-budget
        ["generate", str(run_dir), "--dense-format", "int3"],
        ["generate", str(run_dir), "--dense-format", "int8", "--memory-budget", "1GB"],
    )
    proc = bad_expert
    assert (
        proc.returncode == 2 and "--expert-format=int3: choose from" in proc.stderr and "Traceback" not in proc.stderr
    )
    proc = dense_expert
    assert proc.returncode == 2 and "--expert-format=int8: " in proc.stderr and "dense model" in proc.stderr
    proc = dense_offload
    assert proc.returncode == 2 and "error: --memory-budget: " in proc.stderr and "no experts to offload" in proc.stderr
    proc = bad_dense
    assert proc.returncode == 2 and "--dense-format=int3: choose from fp, int8, int4" in proc.stderr
    proc = dense_offloaded
    assert proc.returncode == 2 and "--dense-format=int8: offloaded models keep" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_threads_flag_sets_torchs_threads_and_refuses_zero(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    from moekit.cli import main

    before = torch.get_num_threads()
    try:
        assert main(["generate", str(run_dir), "--threads", "1", "--max-new-tokens", "2"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
    proc = moekit_cli("generate", str(run_dir), "--threads", "0")
    assert proc.returncode == 2 and "--threads" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_offloaded_generate_says_what_the_budget_holds_and_prints_the_peak_rss(run_dir: Path, tmp_path: Path) -> None:
    """``--memory-budget`` holds the resident weights (the non-expert weights and the expert slots, as
    counted here from the model; fp32 experts multiplied by oneDNN's prepacked kernel are kept reordered
    beside their slots, so fewer slots: one slot and its copy); activations,
    the KV cache and the runtime are beside it, and the peak RSS printed is the one the OS reports for
    the process (``wait4``), within 3%."""
    probe = load_run(run_dir, offload=OffloadOptions(memory_budget=1 << 40))
    try:
        non_expert, slot = model_bytes(probe.model), probe.offloader.cache.slot_bytes
    finally:
        probe.offloader.close()
    budget = non_expert + 2 * slot
    argv = ["generate", str(run_dir), "--memory-budget", str(budget), "--max-new-tokens", "4", "--temperature", "0"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "moekit", *argv], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    stderr = (tmp_path / "err").read_text()
    assert os.waitstatus_to_exitcode(status) == 0, stderr
    line = stderr.strip().splitlines()[-1]
    held, total = f"2 expert slots of {format_bytes(slot)}", budget
    if prepackable(torch.empty(1)):  # fp32 experts kept reordered beside their slots: one slot and its copy
        experts = load_run(run_dir).model.moe_layers()[0].experts
        copy = sum(torch.ops.mkldnn._nbytes(prepack(w[0].t())) for w in (experts.w_in, experts.w_out))
        reordered = f"their experts reordered for the kernel, {format_bytes(copy)}"
        held, total = f"1 expert slot of {format_bytes(slot)} + {reordered}", non_expert + slot + copy
        assert total <= budget
    assert line.startswith(
        f"memory: --memory-budget {format_bytes(budget)} holds the resident weights, {format_bytes(total)}: "
        f"non-expert {format_bytes(non_expert)} + {held}; peak RSS "
    ), line
    printed = float(re.search(r"peak RSS ([0-9.]+) MB", line).group(1)) * 1e6
    measured = usage.ru_maxrss * 1024  # Linux: KiB
    assert 0.97 * measured <= printed <= measured + 0.05e6, (printed, measured)
    assert printed > budget, "the process holds more than the weights the budget counts"


@pytest.mark.slow
def test_cli_generates_bf16_through_the_row_kernel_at_batch_one(write_run, tmp_path: Path) -> None:
    """``moekit generate --dtype bf16`` at batch 1 loads the row layout (the row kernel built into the
    process's cache directory, as a user's first run builds it) and prints that layout's greedy text; at
    ``--batch-size 3`` it keeps the packed layout (oneDNN's: no kernel built), except on a CPU without
    native bf16, where every bf16 load takes the row layout (the kernel built): that layout's text."""
    import torch

    from moekit.experts.matmul import native_16bit
    from moekit.infer.generate import generate_text
    from moekit.infer.resident_experts import PackedExperts, RowExperts
    from moekit.kernels import rows_available, rows_unavailable_reason
    from moekit.model_dir import load_for_inference

    if not rows_available():
        pytest.skip(f"the row kernel does not run here: {rows_unavailable_reason()}")
    every_load = not native_16bit(torch.bfloat16)  # AVX2: the row layout whatever the batch
    run = write_run(tmp_path / "run", **{"model.tie_embeddings": "false"})
    argv = ["--dtype", "bf16", "--temperature", "0", "--max-new-tokens", "24"]
    with torch.no_grad():
        rows = load_for_inference(run, dtype=torch.bfloat16, few_rows=True)[0]
        packed = load_for_inference(run, dtype=torch.bfloat16)[0]
        assert all(isinstance(moe.experts, RowExperts) for moe in rows.model.moe_layers())
        kept = RowExperts if every_load else PackedExperts
        assert all(type(moe.experts) is kept for moe in packed.model.moe_layers())
        want_rows, want_packed = (generate_text(m, "the king", 24, temperature=0) for m in (rows, packed))
    env = {**os.environ, "MOEKIT_CACHE": str(tmp_path / "one")}
    one = moekit_cli("generate", str(run), "--prompt", "the king", *argv, env=env)
    assert one.returncode == 0, one.stderr
    assert one.stdout == want_rows + "\n" and len(list((tmp_path / "one" / "kernels").glob("decode-*.so"))) == 1
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king\n" * 3)
    env = {**os.environ, "MOEKIT_CACHE": str(tmp_path / "three")}
    three = moekit_cli("generate", str(run), "--prompts-file", str(prompts), "--batch-size", "3", *argv, env=env)
    assert three.returncode == 0, three.stderr
    assert three.stdout == "\n".join([want_packed] * 3) + "\n"
    assert len(list((tmp_path / "three").rglob("decode-*.so"))) == (1 if every_load else 0)


@pytest.mark.slow
def test_a_failed_kernel_build_is_said_and_the_packed_layout_decodes(
    run_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """No compiler where the CPU could run the row kernel: ``moekit generate`` says so in one line naming
    the compiler, decodes with torch's kernels (the greedy text of the model loaded with moekit's kernels
    off: the packed layout, or on a CPU without native bf16 the weights as loaded) and exits 0; nothing
    is left in the cache directory but an empty one."""
    import torch

    from moekit import kernels
    from moekit.infer.generate import generate_text
    from moekit.kernels import runnable_isas
    from moekit.model_dir import load_for_inference

    if not runnable_isas():
        pytest.skip("this CPU runs no build of the row kernel: none is tried")
    env = {**os.environ, "CC": "no-such-compiler-here", "MOEKIT_CACHE": str(tmp_path / "cache")}
    argv = ["--dtype", "bf16", "--temperature", "0", "--max-new-tokens", "12", "--prompt", "the king"]
    proc = moekit_cli("generate", str(run_dir), *argv, env=env)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: decoding with torch's kernels")]
    assert len(notes) == 1 and "no-such-compiler-here: No such file or directory" in notes[0]
    try:  # the reference without moekit's kernels, as the child decoded
        monkeypatch.setenv(kernels.ISA_VARIABLE, "none")
        kernels._library.cache_clear()
        with torch.no_grad():
            packed = load_for_inference(run_dir, dtype=torch.bfloat16)[0]
            assert proc.stdout == generate_text(packed, "the king", 12, temperature=0) + "\n"
    finally:
        monkeypatch.undo()
        kernels._library.cache_clear()
    assert not any((tmp_path / "cache").rglob("*.so")), "no partial build left"
