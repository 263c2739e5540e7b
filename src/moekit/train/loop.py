"""The training loop: one process, one device. Deterministic on CPU for a given seed, so a resumed
run reproduces the losses of an uninterrupted one bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from moekit.hostmem import keep_freed_memory
from moekit.model import Transformer
from moekit.parallel.mesh import Layout, LayoutError
from moekit.parallel.runtime import ParallelModel, collective_errors, init_distributed
from moekit.run.layout import LATEST, CheckpointError, checkpoint_dir, complete_checkpoints, latest_checkpoint
from moekit.run.load import load_model_weights
from moekit.run.manifest import load_manifest, read_manifest
from moekit.run.saver import Checkpointer
from moekit.run.sharded import local_model
from moekit.runconfig import RunConfig
from moekit.train.data import Corpus, prepare_corpus, resolve_files
from moekit.train.metrics import MetricsLogger
from moekit.train.optim import build_optimizer, lr_at


class TrainingError(RuntimeError):
    """Training stopped for a reason the user must see (a NaN loss or weights, a run dir in the way)."""


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int  # steps completed, skipped ones included (the data position)
    losses: list[float]  # training loss of each step run in this call
    val_loss: float | None  # last validation loss
    checkpoint: Path | None  # newest checkpoint
    interrupted: bool = False
    skipped_steps: int = 0  # steps whose update was skipped for a non-finite gradient norm, over the whole run


def autocast(cfg: RunConfig, device: torch.device):
    if cfg.train.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(pm: ParallelModel, forward, corpus: Corpus, cfg: RunConfig, device: torch.device) -> float:
    """Mean validation cross-entropy over the same ``eval_iters`` batches every time (on every rank)."""
    pm.train(False)
    losses = []
    for i in range(cfg.train.eval_iters):
        x, y = corpus.batch("val", i, cfg.train.batch_size, cfg.model.context_length, cfg.train.seed)
        with autocast(cfg, device):
            losses.append(pm.lm_loss(x.to(device), y.to(device), forward).item())
    pm.train(True)
    return sum(losses) / len(losses)


class StepStats:
    """One optimizer step's MoE statistics, per MoE layer, summed over its micro-batches.

    Each layer is one vector ``[aux sum, z sum, micro-batches, dropped, tokens per expert...]`` so that
    sums over ranks (and a gather over pipeline stages) reduce them exactly.
    """

    def __init__(self) -> None:
        self.layers: list[torch.Tensor] = []

    def add(self, moe_stats) -> None:
        for i, s in enumerate(moe_stats):
            head = torch.stack([s.aux_loss.detach().float(), s.z_loss.detach().float()]).cpu()
            dropped = s.dropped_per_expert.sum().float().cpu().view(1)
            row = torch.cat([head, torch.ones(1), dropped, s.tokens_per_expert.detach().float().cpu()])
            if i < len(self.layers):
                self.layers[i] = self.layers[i] + row
            else:
                self.layers.append(row)

    @property
    def loads(self) -> list[torch.Tensor]:
        return [layer[4:] for layer in self.layers]

    def record(self) -> dict[str, Any]:
        if not self.layers:
            return {}
        loads = self.loads
        mean = [load.mean() for load in loads]
        micro = sum(layer[2] for layer in self.layers)
        routed = sum(load.sum() for load in loads)
        return {
            "aux_loss": (sum(layer[0] for layer in self.layers) / micro).item(),
            "z_loss": (sum(layer[1] for layer in self.layers) / micro).item(),
            "load_max_over_mean": [(load.max() / m).item() for load, m in zip(loads, mean, strict=True)],
            "load_cv": [(load.std(unbiased=False) / m).item() for load, m in zip(loads, mean, strict=True)],
            "dropped_frac": (sum(layer[3] for layer in self.layers) / routed.clamp(min=1)).item(),
            "expert_load": [(load / load.sum()).tolist() for load in loads],
        }


def _has_checkpoint(run_dir: Path) -> bool:
    return (checkpoint_dir(run_dir) / LATEST).exists() or bool(complete_checkpoints(run_dir))


def _prepare_run_dir(run_dir: Path, resume: bool, create: bool = True) -> None:
    """Check (on every rank, before any collective) that the run directory fits the request."""
    if not resume and _has_checkpoint(run_dir):
        raise TrainingError(f"{run_dir} already holds a trained run: pass --resume, or choose another --run-dir")
    if resume and not _has_checkpoint(run_dir):
        raise TrainingError(f"--resume: {run_dir} has no checkpoint to resume from")
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)


def _elastic_restart(run_dir: Path) -> bool:
    """True when torch's elastic agent restarted this worker (a rank died) and the run has a checkpoint."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and _has_checkpoint(run_dir)


def _rebatch(cfg: RunConfig, manifest: dict[str, Any], layout: Layout, path: Path) -> RunConfig:
    """Keep the checkpoint's global batch at this layout: each rank's grad_accum becomes the global
    micro-batches per step divided by the data ranks, so step s reads the same samples at any layout."""
    total = manifest.get("global_microbatches")
    if total is None:
        return cfg
    if total % layout.batch_ranks:
        raise LayoutError(
            f"{path}: its global batch of {total} micro-batches per step cannot be split over "
            f"{layout.batch_ranks} data ranks (dp x ep = {layout.dp} x {layout.ep})"
        )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=total // layout.batch_ranks))


def train(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    init: Path | None = None,
    fallback: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train ``cfg`` into ``run_dir``: metrics, TensorBoard logs, checkpoints, config and tokenizer.

    Under torchrun every rank calls this; rank 0 owns the console and the run directory.
    ``init``: a run directory whose latest weights and tokenizer the model starts from (a converted or
    upcycled model), with a fresh optimizer at step 0; ``cfg.model`` must describe those weights.
    ``resume`` continues from the latest checkpoint at any layout (and is implied after an elastic
    restart); ``fallback`` resumes from the newest intact checkpoint when the latest is corrupt.
    ``on_step`` is called on every rank after each optimizer step (and its logging and checkpoint)
    with the step's metrics record, for callers that watch or pace a run.
    """
    with collective_errors(cfg.parallel.timeout_s):  # setup, resume and every step
        return _train(cfg, run_dir, resume, device, progress, init, fallback, on_step)


def _train(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    device: str,
    progress: bool,
    init: Path | None,
    fallback: bool,
    on_step: Callable[[dict[str, Any]], None] | None,
) -> TrainResult:
    run_dir = Path(run_dir)
    dev = torch.device(device)
    if dev.type == "cpu":
        keep_freed_memory()
    if init is not None and resume:
        raise TrainingError("--init starts a new run from another run's weights; it cannot be combined with --resume")
    main = int(os.environ.get("RANK", "0")) == 0
    resume = resume or (init is None and _elastic_restart(run_dir))
    resolve_files(cfg.data.path)  # a corpus that is not there is reported before the run directory is made
    _prepare_run_dir(run_dir, resume, create=main)
    layout, mesh = init_distributed(cfg, dev)
    say = tqdm.write if progress and main else (lambda msg: print(msg, file=sys.stderr))
    saver = Checkpointer(run_dir, cfg.train.keep_checkpoints, cfg.train.async_checkpoint, cfg.parallel.timeout_s)
    resume_from = saver.choose(fallback, say if main else lambda msg: None) if resume else None
    manifest = load_manifest(resume_from) if resume_from is not None else {}
    if resume_from is not None:
        cfg = _rebatch(cfg, manifest, layout, resume_from)
    torch.manual_seed(cfg.train.seed)
    corpus = _prepare_corpus_once(cfg, main, mesh is not None, init)
    if init is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size))
    elif corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise TrainingError(
            f"--init {init}: its tokenizer has {corpus.tokenizer.vocab_size} tokens, "
            f"more than model.vocab_size={cfg.model.vocab_size}"
        )
    if main:
        (run_dir / "config.json").write_text(cfg.to_json())
        corpus.tokenizer.save(run_dir)

    model = Transformer(cfg.model, cfg.moe if cfg.is_moe else None).to(dev)
    if init is not None:
        _load_init(Path(init), model)
    total, active = model.num_params() / 1e6, model.num_active_params() / 1e6
    flops_per_token = model.flops_per_token()
    n_moe = len(model.moe_layers())
    pm = ParallelModel(model, cfg, dev, layout, mesh)
    local = local_model(pm.modules)
    optimizer = build_optimizer(pm.parameters(), cfg.train)
    start_step = 0
    if resume_from is not None:
        start_step = int(saver.restore(resume_from, local, optimizer, model)["step"])
    forward = torch.compile(model) if cfg.train.compile and mesh is None else None
    progress = progress and main
    say = tqdm.write if progress else (lambda msg: print(msg, file=sys.stderr))
    if not main:
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pm.parameters())
        print(
            f"moekit rank {pm.ranks.rank}/{layout.world}: mesh {mesh}, {held / 1e6:.2f}M parameters held",
            file=sys.stderr,
        )
    if main:
        where = f"; {layout.world} ranks ({_describe(layout)})" if mesh is not None else ""
        say(
            f"moekit: {total:.2f}M parameters ({active:.2f}M active per token, "
            f"{flops_per_token / 1e6:.1f} MFLOPs per token trained), {n_moe} MoE blocks; "
            f"corpus {corpus.source}, {len(corpus.train):,} train tokens{where}"
            + (f"; resuming at step {start_step} from {resume_from}" if resume_from else "")
            + (f"; weights from {init}" if init is not None else "")
        )

    tokens_per_step = cfg.train.batch_size * cfg.model.context_length * cfg.train.grad_accum * layout.batch_ranks
    losses: list[float] = []
    val_loss: float | None = None
    checkpoint = resume_from if main else None
    step = start_step
    # Carried in the manifest so that a resumed run counts (and stops) as the uninterrupted one would.
    skipped_steps, streak = int(manifest.get("skipped_steps", 0)), int(manifest.get("nonfinite_streak", 0))
    bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not progress, unit="step", dynamic_ncols=True)
    pm.train(True)
    logger = MetricsLogger(run_dir) if main else contextlib.nullcontext()
    with logger, _StopOnInterrupt() as interrupt, saver:
        stopping = _agree(interrupt.requested, mesh)
        while step < cfg.train.steps and not stopping:
            started = time.perf_counter()
            record = _train_step(pm, forward, optimizer, corpus, cfg, dev, step, checkpoint)
            step += 1
            elapsed = time.perf_counter() - started
            record["tokens_per_s"] = tokens_per_step / elapsed
            record["mfu"] = flops_per_token * record["tokens_per_s"] / (cfg.train.peak_tflops * 1e12 * layout.world)
            losses.append(record["loss"])
            streak = streak + 1 if record["skipped"] else 0
            skipped_steps += record["skipped"]
            record["skipped_steps"] = skipped_steps
            if record["skipped"] and main:
                say(
                    f"moekit: warning: gradient norm is {record['grad_norm']} at step {step}: update skipped "
                    f"({streak} in a row; train.max_nonfinite_steps={cfg.train.max_nonfinite_steps})"
                )
            if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                val_loss = record["val_loss"] = evaluate(pm, forward, corpus, cfg, dev)
            if main:
                logger.log(record)
            checkpoint = saver.poll() or checkpoint
            if streak >= cfg.train.max_nonfinite_steps:
                checkpoint = saver.wait() or checkpoint
                raise TrainingError(
                    f"gradient norm is not finite for {streak} steps in a row at step {step} "
                    f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}): training stopped; "
                    + _last_good(checkpoint)
                )
            periodic = cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0
            stopping = _agree(interrupt.requested, mesh)  # one collective per step decides for every rank
            if periodic or step == cfg.train.steps or stopping:
                if not _weights_finite(local, mesh):
                    checkpoint = saver.wait() or checkpoint
                    raise TrainingError(
                        f"weights are not finite after step {step}: checkpoint not saved, training stopped; "
                        + _last_good(checkpoint)
                    )
                info = _checkpoint_info(step, cfg, layout, record, streak)
                checkpoint = saver.save(step, local, optimizer, info, pm.expert_slots()) or checkpoint
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", val=f"{val_loss:.3f}" if val_loss else "-", refresh=False)
            if on_step is not None:
                on_step(record)
        checkpoint = saver.wait() or checkpoint
    bar.close()
    if interrupt.requested and main:
        say(f"moekit: interrupted at step {step}; checkpoint {checkpoint} (continue with --resume)")
    return TrainResult(
        run_dir, step, losses, val_loss, checkpoint, interrupted=interrupt.requested, skipped_steps=skipped_steps
    )


def _describe(layout) -> str:
    return " x ".join(f"{name}={getattr(layout, name)}" for name in ("dp", "ep", "tp", "pp"))


def _agree(flag: bool, mesh) -> bool:
    """True on every rank if it is true on any (a Ctrl-C reaches ranks at different steps)."""
    if mesh is None:
        return flag
    value = torch.tensor(float(flag))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _weights_finite(model: torch.nn.Module, mesh) -> bool:
    """True on every rank if no rank holds a NaN or inf in a parameter or floating-point buffer: what a
    checkpoint would save (a DTensor's local shard is enough, the ranks' verdicts are combined)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in (*model.parameters(), *model.buffers()):
        piece = t.to_local() if hasattr(t, "to_local") else t
        if piece.is_floating_point():
            by_device.setdefault(piece.device, []).append(piece.detach().isfinite().all())
    local = all(bool(torch.stack(flags).all()) for flags in by_device.values())  # one sync per device
    return not _agree(not local, mesh)


def _last_good(checkpoint: Path | None) -> str:
    return f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"


def _prepare_corpus_once(cfg: RunConfig, main: bool, distributed: bool, init: Path | None) -> Corpus:
    """Rank 0 tokenises (and fills the cache) first; the other ranks then read the cache."""
    if not distributed:
        return prepare_corpus(cfg.data, cfg.model.context_length, tokenizer_dir=init)
    corpus = prepare_corpus(cfg.data, cfg.model.context_length, tokenizer_dir=init) if main else None
    dist.barrier()
    return corpus or prepare_corpus(cfg.data, cfg.model.context_length, tokenizer_dir=init)


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


def _train_step(pm: ParallelModel, forward, optimizer, corpus, cfg: RunConfig, dev, step: int, checkpoint):
    """One optimizer step over ``grad_accum`` micro-batches per rank; returns the step's metrics.

    Rank b of the N data-reading ranks takes micro-batches b, b + N, ...: the same samples, in the
    same order, as one process with N times the gradient accumulation. A step whose gradient norm is
    NaN or inf is skipped (``record["skipped"]``): its data is consumed but nothing is updated.
    """
    tc = cfg.train
    lr = lr_at(step, tc)
    for group in optimizer.param_groups:
        group["lr"] = lr
    for moe in pm.moe_layers():
        moe.set_step(step)
    stats = StepStats()
    lm_loss = torch.zeros(())
    ranks = pm.ranks
    for micro in range(tc.grad_accum):
        index = (step * tc.grad_accum + micro) * ranks.batch_ranks + ranks.batch_rank
        x, y = corpus.batch("train", index, tc.batch_size, cfg.model.context_length, tc.seed)
        with autocast(cfg, dev):
            loss, lm, moe_stats = pm.forward_backward(x.to(dev), y.to(dev), 1.0 / tc.grad_accum, forward)
        lm_loss = lm_loss + lm.float().cpu() / tc.grad_accum
        loss_value = pm.mean_over_batch(pm.broadcast_from_last_stage(loss)).item()
        if not math.isfinite(loss_value):
            raise TrainingError(f"loss is {loss_value} at step {step + 1}: training stopped; {_last_good(checkpoint)}")
        stats.add(moe_stats)
    pm.finish_gradients()
    grad_norm = pm.clip_gradients(tc.grad_clip)
    # NOTE: the norm is all-reduced over every rank, so all ranks skip the same steps. A skipped step
    # leaves the weights, the optimizer state (its step count too) and the router biases as they were;
    # the learning rate is a function of the step index (the data position), so no schedule is held back.
    skipped = not math.isfinite(grad_norm.item())
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats.layers = pm.reduce_layers(stats.layers)
    placement = pm.rebalance(step, stats.loads, optimizer)
    whole_model_index = {id(m): i for i, m in enumerate(pm.full_model.moe_layers())}
    if not skipped:
        for moe in pm.moe_layers():
            moe.update_bias(stats.loads[whole_model_index[id(moe)]].to(dev))
    lm_loss = pm.mean_over_batch(pm.broadcast_from_last_stage(lm_loss))
    record = {"step": step + 1, "loss": lm_loss.item(), "lr": lr, "grad_norm": grad_norm.item(), "skipped": skipped}
    return {**record, **stats.record(), **placement}


def _checkpoint_info(step: int, cfg: RunConfig, layout: Layout, record: dict[str, Any], streak: int) -> dict[str, Any]:
    """What the manifest records beside the files: where the data stands and how the run was laid out."""
    total = cfg.train.grad_accum * layout.batch_ranks
    return {
        "global_microbatches": total,  # per optimizer step; kept when resumed at another layout
        "data_position": {"train_batches": step * total},
        "world": layout.world,
        "layout": _describe(layout),
        "loss": record.get("loss"),
        "val_loss": record.get("val_loss"),
        "skipped_steps": record.get("skipped_steps", 0),  # steps whose update a non-finite gradient norm skipped
        "nonfinite_streak": streak,  # of them, how many in a row end at this step
    }


def _load_init(init: Path, model: torch.nn.Module) -> None:
    """Load the latest weights of run ``init`` (checksums verified) into ``model``."""
    path = latest_checkpoint(init)
    if path is None:
        raise CheckpointError(f"--init {init}: has no checkpoint to start from")
    read_manifest(path)
    load_model_weights(path, model)
