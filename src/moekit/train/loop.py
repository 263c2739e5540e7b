"""The training loop: one process, one device. Deterministic on CPU for a given seed, so a resumed
run reproduces the losses of an uninterrupted one bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from moekit.model import Transformer
from moekit.runconfig import RunConfig
from moekit.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_model_weights,
    load_trainer_state,
    read_manifest,
    save_checkpoint,
)
from moekit.train.data import Corpus, prepare_corpus
from moekit.train.metrics import MetricsLogger
from moekit.train.optim import build_optimizer, lr_at


class TrainingError(RuntimeError):
    """Training stopped for a reason the user must see (a NaN loss, a run dir in the way)."""


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int  # optimizer steps completed
    losses: list[float]  # training loss of each step run in this call
    val_loss: float | None  # last validation loss
    checkpoint: Path | None  # newest checkpoint
    interrupted: bool = False


def autocast(cfg: RunConfig, device: torch.device):
    if cfg.train.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, cfg: RunConfig, device: torch.device) -> float:
    """Mean validation cross-entropy over the same ``eval_iters`` batches every time."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(cfg.train.eval_iters):
        x, y = corpus.batch("val", i, cfg.train.batch_size, cfg.model.context_length, cfg.train.seed)
        with autocast(cfg, device):
            losses.append(model(x.to(device), y.to(device)).lm_loss.item())
    model.train(was_training)
    return sum(losses) / len(losses)


class StepStats:
    """Accumulates one optimizer step's MoE statistics over its micro-batches."""

    def __init__(self) -> None:
        self.aux: list[float] = []
        self.z: list[float] = []
        self.loads: list[torch.Tensor] = []
        self.dropped = 0
        self.routed = 0

    def add(self, moe_stats) -> None:
        for i, s in enumerate(moe_stats):
            self.aux.append(s.aux_loss.item())
            self.z.append(s.z_loss.item())
            load = s.tokens_per_expert.detach().cpu()
            if i < len(self.loads):
                self.loads[i] = self.loads[i] + load
            else:
                self.loads.append(load)
            self.dropped += int(s.dropped_per_expert.sum())
            self.routed += int(s.tokens_per_expert.sum())

    def record(self) -> dict[str, Any]:
        if not self.loads:
            return {}
        fractions = [(load / load.sum()).tolist() for load in self.loads]
        mean = [load.float().mean() for load in self.loads]
        return {
            "aux_loss": sum(self.aux) / len(self.aux),
            "z_loss": sum(self.z) / len(self.z),
            "load_max_over_mean": [(load.max() / m).item() for load, m in zip(self.loads, mean, strict=True)],
            "load_cv": [
                (load.float().std(unbiased=False) / m).item() for load, m in zip(self.loads, mean, strict=True)
            ],
            "dropped_frac": self.dropped / max(1, self.routed),
            "expert_load": fractions,
        }


def _prepare_run_dir(run_dir: Path, resume: bool) -> None:
    if not resume and latest_checkpoint(run_dir) is not None:
        raise TrainingError(f"{run_dir} already holds a trained run: pass --resume, or choose another --run-dir")
    if resume and latest_checkpoint(run_dir) is None:
        raise TrainingError(f"--resume: {run_dir} has no checkpoint to resume from")
    run_dir.mkdir(parents=True, exist_ok=True)


def train(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    init: Path | None = None,
) -> TrainResult:
    """Train ``cfg`` into ``run_dir``: metrics, TensorBoard logs, checkpoints, config and tokenizer.

    ``init``: a run directory whose latest weights and tokenizer the model starts from (a converted or
    upcycled model), with a fresh optimizer at step 0; ``cfg.model`` must describe those weights.
    """
    run_dir = Path(run_dir)
    dev = torch.device(device)
    if init is not None and resume:
        raise TrainingError("--init starts a new run from another run's weights; it cannot be combined with --resume")
    _prepare_run_dir(run_dir, resume)
    torch.manual_seed(cfg.train.seed)
    corpus = prepare_corpus(cfg.data, cfg.model.context_length, tokenizer_dir=init)
    if init is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size))
    elif corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise TrainingError(
            f"--init {init}: its tokenizer has {corpus.tokenizer.vocab_size} tokens, "
            f"more than model.vocab_size={cfg.model.vocab_size}"
        )
    (run_dir / "config.json").write_text(cfg.to_json())
    corpus.tokenizer.save(run_dir)

    model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None).to(dev)
    optimizer = build_optimizer(model, cfg.train)
    start_step = 0
    if resume:
        start_step = _restore(run_dir, model, optimizer)
    if init is not None:
        _load_init(Path(init), model)
    forward = torch.compile(model) if cfg.train.compile else model
    say = tqdm.write if progress else (lambda msg: print(msg, file=sys.stderr))
    total, active = model.num_params() / 1e6, model.num_active_params() / 1e6
    flops_per_token = model.flops_per_token()
    say(
        f"moekit: {total:.2f}M parameters ({active:.2f}M active per token, "
        f"{flops_per_token / 1e6:.1f} MFLOPs per token trained), {len(model.moe_layers())} MoE blocks; "
        f"corpus {corpus.source}, {len(corpus.train):,} train tokens"
        + (f"; resuming at step {start_step}" if resume else "")
        + (f"; weights from {init}" if init is not None else "")
    )

    tokens_per_step = cfg.train.batch_size * cfg.model.context_length * cfg.train.grad_accum
    losses: list[float] = []
    val_loss: float | None = None
    checkpoint = latest_checkpoint(run_dir)
    step = start_step
    bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not progress, unit="step", dynamic_ncols=True)
    model.train()
    with MetricsLogger(run_dir) as logger, _StopOnInterrupt() as interrupt:
        while step < cfg.train.steps and not interrupt.requested:
            started = time.perf_counter()
            record = _train_step(forward, model, optimizer, corpus, cfg, dev, step, checkpoint)
            step += 1
            elapsed = time.perf_counter() - started
            record["tokens_per_s"] = tokens_per_step / elapsed
            record["mfu"] = flops_per_token * record["tokens_per_s"] / (cfg.train.peak_tflops * 1e12)
            losses.append(record["loss"])
            if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                val_loss = record["val_loss"] = evaluate(forward, corpus, cfg, dev)
            logger.log(record)
            periodic = cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0
            if periodic or step == cfg.train.steps or interrupt.requested:
                checkpoint = _save(run_dir, step, model, optimizer, cfg, record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", val=f"{val_loss:.3f}" if val_loss else "-", refresh=False)
    bar.close()
    if interrupt.requested:
        say(f"moekit: interrupted at step {step}; checkpoint {checkpoint} (continue with --resume)")
    return TrainResult(run_dir, step, losses, val_loss, checkpoint, interrupted=interrupt.requested)


class _StopOnInterrupt:
    """Turns the first Ctrl-C into a request to stop at the end of the current step (which is then
    checkpointed), so no half-applied step is ever saved; a second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _train_step(forward, model, optimizer, corpus, cfg: RunConfig, dev, step: int, checkpoint) -> dict[str, Any]:
    """One optimizer step over ``grad_accum`` micro-batches; returns the step's metrics."""
    tc = cfg.train
    lr = lr_at(step, tc)
    for group in optimizer.param_groups:
        group["lr"] = lr
    for moe in model.moe_layers():
        moe.set_step(step)
    stats = StepStats()
    lm_loss = 0.0
    for micro in range(tc.grad_accum):
        x, y = corpus.batch("train", step * tc.grad_accum + micro, tc.batch_size, cfg.model.context_length, tc.seed)
        with autocast(cfg, dev):
            out = forward(x.to(dev), y.to(dev))
        loss_value = out.loss.item()
        if not math.isfinite(loss_value):
            where = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
            raise TrainingError(f"loss is {loss_value} at step {step + 1}: training stopped; {where}")
        (out.loss / tc.grad_accum).backward()
        lm_loss += out.lm_loss.item() / tc.grad_accum
        stats.add(out.moe_stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"), foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for moe, load in zip(model.moe_layers(), stats.loads, strict=False):
        moe.update_bias(load.to(dev))
    return {"step": step + 1, "loss": lm_loss, "lr": lr, "grad_norm": grad_norm.item(), **stats.record()}


def _save(run_dir: Path, step: int, model, optimizer, cfg: RunConfig, record: dict[str, Any]) -> Path:
    state = {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    info = {
        "data_position": {"train_batches": step * cfg.train.grad_accum},
        "loss": record.get("loss"),
        "val_loss": record.get("val_loss"),
    }
    return save_checkpoint(run_dir, step, model, state, info, cfg.train.keep_checkpoints)


def _restore(run_dir: Path, model, optimizer) -> int:
    """Load the latest checkpoint's weights, optimizer and RNG; return its step."""
    path = latest_checkpoint(run_dir)
    assert path is not None
    manifest = read_manifest(path)
    load_model_weights(path, model)
    state = load_trainer_state(path)
    if "optimizer" not in state:
        raise CheckpointError(f"{path}: holds weights only (a converted or upcycled model): start from it with --init")
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: optimizer state does not fit this model ({err})") from None
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(manifest["step"])


def _load_init(init: Path, model: torch.nn.Module) -> None:
    """Load the latest weights of run ``init`` (checksums verified) into ``model``."""
    path = latest_checkpoint(init)
    if path is None:
        raise CheckpointError(f"--init {init}: has no checkpoint to start from")
    read_manifest(path)
    load_model_weights(path, model)
