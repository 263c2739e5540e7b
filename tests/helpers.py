"""Helpers shared by test files in more than one place (fixtures live in conftest.py); tests/ is on
sys.path through the rootdir conftest, so every test imports them as ``helpers``."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moekit import runconfig
from moekit.infer.generate import decode_step, left_pad, prefill
from moekit.infer.offload import OffloadOptions, model_bytes
from moekit.run.layout import MODEL_FILE, SHARDED, checkpoint_dir, step_dirs
from moekit.run.load import load_run
from moekit.run.sharded import METADATA, MODEL_PREFIX, read_metadata, read_tensors
from moekit.train.metrics import MetricsLogger
from moekit.train.offload import ExpertOffload
from moekit.train.step import train_step

# The MoE layer's router and expert configurations that its tests run against the per-token reference.
ROUTER_CASES = {
    "topk-softmax": dict(router="topk"),
    "topk-softmax-after": dict(router="topk", softmax_before_topk=False),
    "topk-unnormalised": dict(router="topk", normalize_topk=False),
    "topk-sigmoid": dict(router="topk", score_func="sigmoid", route_scale=2.5),
    "switch": dict(router="switch", top_k=1),
    "gshard": dict(router="gshard", top_k=2),
    "noisy_topk": dict(router="noisy_topk"),
    "expert_choice": dict(router="expert_choice"),
    "hash": dict(router="hash"),
    "capacity": dict(router="topk", capacity_factor=0.75),
    "shared+gelu": dict(num_shared_experts=2, activation="gelu"),
    "shared+gate": dict(num_shared_experts=2, shared_expert_gate=True),
    "residual": dict(residual=True),
    "gpt-oss": dict(
        softmax_before_topk=False, activation="clamped_swiglu", swiglu_limit=0.8, expert_ffn_bias=True, router_bias=True
    ),
}

PROSE = (
    "the expert router picks two of eight experts for every token and the load balancing loss keeps "
    "them busy while a shared expert sees all tokens; capacity factor drops overflow naïvely. "
    "def forward(self, x): return self.experts(x) + self.shared(x)  # ≈ 1.5× faster"
)


def prefill_and_decode_logits(
    model, prompt_BL: torch.Tensor, continuation_BT: torch.Tensor, left_pad_B: torch.Tensor | None = None
) -> torch.Tensor:
    """The prompt's prefill logits, then one decode step per continuation token: [B, T + 1, V]."""
    logits, cache = prefill(model, prompt_BL, left_pad_B)
    steps = [logits] + [
        decode_step(model, continuation_BT[:, i : i + 1], cache) for i in range(continuation_BT.shape[1])
    ]
    return torch.stack(steps, dim=1)


def assert_padded_rows_match_alone(model, prompts: list[list[int]], steps: int, atol: float = 1e-5) -> None:
    """Each row of a left-padded batch gets the prefill and decode logits of its prompt run alone
    (the same continuation fed to both), to ``atol`` in fp32. Logits, not greedy tokens: padding that
    leaks into attention moves them while the argmax of a sharpened random model stays put."""
    ids, pad = left_pad(prompts)
    draw = torch.Generator().manual_seed(0)
    continuation = torch.randint(0, model.cfg.vocab_size, (len(prompts), steps), generator=draw)
    batched = prefill_and_decode_logits(model, ids, continuation, pad)
    for row, prompt in enumerate(prompts):
        alone = prefill_and_decode_logits(model, torch.tensor([prompt]), continuation[row : row + 1])
        torch.testing.assert_close(batched[row], alone[0], atol=atol, rtol=0, msg=lambda m, row=row: f"row {row}: {m}")


def sample_text(seed: int, num_lines: int = 60) -> str:
    """A few KB of real-looking prose and code, different per seed."""
    rng, words = random.Random(seed), PROSE.split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(num_lines)]
    return "\n".join(lines) + "\n"


def write_file(path: Path, content: str | bytes) -> Path:
    """Text as UTF-8 or raw bytes, creating the parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    return path


def synthetic_record(step: int, moe: bool = True, offset: float = 0.0) -> dict[str, Any]:
    """A trainer-like record: 2 MoE layers of 4 experts, layer 0 drifting from skewed toward uniform."""
    record: dict[str, Any] = {
        "step": step,
        "loss": 6.0 * math.exp(-step / 15) + 3.0 + 0.05 * math.sin(step) + offset,
        "lr": 6e-4 * min(1.0, step / 5),
        "tokens_per_s": 5400.0,
        "mfu": 0.031,
    }
    if moe:
        skew = 0.3 * math.exp(-step / 10)
        layer0 = [0.25 + skew, 0.25 - skew / 3, 0.25 - skew / 3, 0.25 - skew / 3]
        layer1 = [0.26, 0.24, 0.25, 0.25]
        record |= {
            "aux_loss": 1.0 + skew,
            "z_loss": 0.35,
            "dropped_frac": 0.0,
            "load_max_over_mean": [max(layer0) * 4, max(layer1) * 4],
            "load_cv": [skew, 0.01],
            "expert_load": [layer0, layer1],
        }
    if step % 10 == 0:
        record["val_loss"] = record["loss"] + 0.1
    return record


def log_run(run_dir: Path, steps: range, moe: bool = True, offset: float = 0.0, tensorboard: bool = True) -> list[dict]:
    """Logs ``synthetic_record`` of each step through the real MetricsLogger; returns the records."""
    records = [synthetic_record(s, moe, offset) for s in steps]
    with MetricsLogger(run_dir, tensorboard=tensorboard) as logger:
        for r in records:
            logger.log(r)
    return records


def budget_for(run_dir: Path, experts: int, **options) -> int:
    """Bytes for the non-expert weights plus ``experts`` cache slots."""
    probe = load_run(run_dir, offload=OffloadOptions(memory_budget=1 << 40, **options))
    try:
        return model_bytes(probe.model) + experts * probe.offloader.cache.slot_bytes
    finally:
        probe.offloader.close()


def tiny(corpus: Path, cache: Path, **overrides: str):
    """The tiny preset reading ``corpus``, its token cache under ``cache``."""
    values = {"data.path": str(corpus), "data.cache_dir": str(cache)} | overrides
    return runconfig.resolve("tiny", values)


def moekit_cli(*args: str, preexec=None, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m moekit ARGS`` in a subprocess, as a user runs it (``env``: its environment, else ours)."""
    cmd = [sys.executable, "-m", "moekit", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec, env=env)


def moekit_clis(*argvs: list[str], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Several independent ``python -m moekit`` commands, each as ``moekit_cli`` runs it, started at once
    (most of a short command is importing torch: side by side they share the cores); their results in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "moekit", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for argv in argvs
    ]
    try:
        done = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return done
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


SERVE_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}


def start_serve(run_dir: Path, *flags: str, env: dict | None = None, preexec=None) -> tuple[subprocess.Popen, str]:
    """``moekit serve RUN_DIR FLAGS`` (port 0 unless FLAGS give one): the process and its URL, once it serves."""
    port = [] if any(f.startswith("--port") for f in flags) else ["--port", "0"]
    cmd = [sys.executable, "-m", "moekit", "serve", str(run_dir), *port, "--device", "cpu", *flags]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or SERVE_ENV, preexec_fn=preexec
    )
    line = proc.stdout.readline()
    assert " on " in line, line + proc.stderr.read()
    return proc, line.split(" on ")[1].split("/v1")[0]


def read_all(conn: socket.socket) -> bytes:
    """Everything a server sends on ``conn`` until it closes the connection."""
    conn.settimeout(30)
    reply = b""
    while chunk := conn.recv(65536):
        reply += chunk
    conn.close()
    return reply


@contextlib.contextmanager
def serving(run_dir: Path, *flags: str, **kwargs):
    """``start_serve``, and the process killed on the way out if it has not ended."""
    proc, url = start_serve(run_dir, *flags, **kwargs)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def toy_cluster():
    """A planner cluster of round numbers: nodes of 4 devices at 1 TFLOP/s and efficiency 1; 10 GB/s and
    10 us inside a node, 1 GB/s and 100 us across."""
    from moekit.parallel.planner import Cluster

    return Cluster("toy", 4, 4, 1.0, 1.0, 1.0, 10.0, 10.0, 1.0, 100.0)


def rewind(run: Path, to: Path, step: int) -> Path:
    """A copy of run directory ``run`` as it stood after ``step`` (later checkpoints removed)."""
    shutil.copytree(run, to)
    for later in (to / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (to / "checkpoints" / "latest").write_text(f"step_{step:06d}")
    return to


@dataclass
class RoutedRun:
    """What ``train_routed`` leaves: each step's record, this rank's final weights and AdamW state by
    name (this rank's pieces), and the offload's traffic, disk and host tier together (None in memory)."""

    records: list[dict[str, Any]]
    state: dict[str, Any]
    bytes_read: int | None = None
    bytes_written: int | None = None
    experts_skipped: dict[str, int] | None = None  # by kind: LayerFile.experts_skipped
    host_regions: list[tuple[int, str]] | None = None  # (layer, kind) held in the host tier


def train_routed(cfg, run_dir: Path, bias_at: Callable[[int, int], Any]) -> RoutedRun:
    """Train ``cfg`` step by step (no evaluation, no checkpoint), every MoE router's selection bias set
    to ``bias_at(step, micro)`` as each micro-batch's forward reaches it: a bias of -1e4 keeps an expert
    from every token. Offloaded, the last step's pending AdamW updates are run and every transfer has
    landed before the bytes are read; the state is then read as a checkpoint streams it, so the traffic
    counts training's only."""
    from moekit.experts.grouped import local_tensor
    from moekit.train import loop

    run = loop._setup(cfg, run_dir, False, torch.device("cpu"), False, None, False)
    routers = [moe.router for moe in run.pm.moe_layers()]
    forwards = itertools.count()  # of the first router: one per micro-batch
    bias = {}

    def set_bias(router: Any, _args: Any) -> None:
        if router is routers[0]:
            n = next(forwards)
            bias["now"] = bias_at(n // cfg.train.grad_accum, n % cfg.train.grad_accum)
        router.expert_bias.copy_(bias["now"])

    for router in routers:
        router.register_forward_pre_hook(set_bias)
    records = [
        train_step(run.pm, run.optimizer, run.corpus, cfg, run.dev, step, None, run.experts)
        for step in range(cfg.train.steps)
    ]
    result = RoutedRun(records, {})
    offload = run.experts
    if isinstance(offload, ExpertOffload):
        offload.settle()
        offload.ws.flush()
        file = offload.file  # either tier
        result.bytes_read, result.bytes_written = (
            file.bytes_read + file.host_bytes_read,
            file.bytes_written + file.host_bytes_written,
        )
        result.experts_skipped = dict(offload.file.experts_skipped)
        result.host_regions = sorted(offload.file.host)
    names = {id(p): name for name, p in run.local.named_parameters()}
    try:
        with offload.saving(run.local) as streamed:
            streamed_keys = streamed.keys if streamed is not None else ()

            def take(key: str, tensor: Any) -> Any:  # as a checkpoint saves it: this rank's piece
                return streamed.read(key).clone() if key in streamed_keys else local_tensor(tensor).clone()

            result.state = {k: take(MODEL_PREFIX + k, v) for k, v in run.local.state_dict().items()}
            for p, moments in run.optimizer.state.items():
                name = names[id(p)]
                result.state |= {f"{name}:{k}": take(f"optim.state.{name}.{k}", v) for k, v in moments.items()}
    finally:
        offload.close()
    return result


def saved_tensors(sharded: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint at its full size, read through DCP in this process."""
    metadata = read_metadata(sharded).state_dict_metadata
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    read_tensors(sharded, state)
    return state


def assert_same_checkpoints(run: Path, reference: Path, steps: list[int]) -> None:
    """``run``'s checkpoints are ``reference``'s, of ``steps``: the same keys, every tensor equal (read
    back at full size), and the same bytes in every data file (and the consolidated weights, if any)."""
    mine, theirs = step_dirs(checkpoint_dir(run)), step_dirs(checkpoint_dir(reference))
    assert [d.name for d in mine] == [d.name for d in theirs] == [f"step_{s:06d}" for s in steps]
    for a, b in zip(theirs, mine, strict=True):
        keys = read_metadata(a / SHARDED).state_dict_metadata.keys()
        assert keys == read_metadata(b / SHARDED).state_dict_metadata.keys()
        ta, tb = saved_tensors(a / SHARDED), saved_tensors(b / SHARDED)
        assert any(".experts." in k and k.endswith("exp_avg_sq") for k in ta), "expert moments saved"
        for key in ta:
            assert torch.equal(ta[key], tb[key]), f"{a.name} {key}"
        files = sorted(f"{SHARDED}/{p.name}" for p in (a / SHARDED).iterdir() if p.name != METADATA)
        assert files == sorted(f"{SHARDED}/{p.name}" for p in (b / SHARDED).iterdir() if p.name != METADATA)
        files += [MODEL_FILE] if (a / MODEL_FILE).exists() else []
        for name in files:
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"{a.name} {name}"


def tiny_spec(**overrides: str):
    """The planner's view of the tiny preset at 4 blocks (unless overridden): a batch of 16 sequences of
    4-byte values; what the planner's unit tests count by hand."""
    from moekit.parallel.planner import ModelSpec, Workload

    cfg = runconfig.resolve("tiny", {"model.n_layers": "4", **overrides})
    return ModelSpec("tiny", cfg.model, cfg.moe, Workload(global_batch=16, dtype_bytes=4))
