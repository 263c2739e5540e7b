"""The training loop: setup, then steps until the last or a Ctrl-C, each logged, evaluated and saved on
schedule (``schedules.py``). Deterministic on CPU for a given seed, so a resumed run reproduces the
losses of an uninterrupted one bit for bit. It reads the same with offloaded experts as without: they
sit behind the model/optimizer seam (``step.ExpertStorage``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from moekit.errors import OptionError
from moekit.fileio import write_bytes_atomic
from moekit.hostmem import keep_freed_memory
from moekit.parallel.compile import CompileWatch
from moekit.parallel.failures import collective_errors
from moekit.parallel.mesh import Layout, LayoutError
from moekit.parallel.runtime import ParallelModel, global_rank, init_distributed
from moekit.run.layout import LATEST, checkpoint_dir, complete_checkpoints
from moekit.run.manifest import load_manifest
from moekit.run.saver import Checkpointer
from moekit.run.sharded import local_model
from moekit.runconfig import RunConfig
from moekit.storage.files import StorageFile
from moekit.train.data import Corpus, prepare_corpus, resolve_files
from moekit.train.interrupt import StopOnInterrupt, agree
from moekit.train.metrics import MetricsLogger
from moekit.train.model_build import build_model
from moekit.train.offload import claim_offload_file
from moekit.train.optim import keeping_hyperparameters
from moekit.train.peak import peak_tflops
from moekit.train.resume import check_resumable
from moekit.train.schedules import Every, NonFiniteStreak
from moekit.train.step import ExpertStorage, TrainingError, autocast, last_good, train_step


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int  # steps completed, skipped ones included (the data position)
    losses: list[float]  # training loss of each step run in this call
    val_loss: float | None  # last validation loss
    checkpoint: Path | None  # newest checkpoint
    interrupted: bool = False
    skipped_steps: int = 0  # steps whose update was skipped for a non-finite gradient norm, over the whole run


@torch.no_grad()
def evaluate(pm: ParallelModel, corpus: Corpus, cfg: RunConfig, device: torch.device) -> float:
    """Mean validation cross-entropy over the same ``eval_iters`` batches every time (on every rank)."""
    pm.train(False)
    losses = []
    for i in range(cfg.train.eval_iters):
        x, y = corpus.batch("val", i, cfg.train.batch_size, cfg.model.context_length, cfg.train.seed)
        with autocast(cfg, device):
            losses.append(pm.lm_loss(x.to(device), y.to(device)).item())
    pm.train(True)
    return sum(losses) / len(losses)


def _has_checkpoint(run_dir: Path) -> bool:
    return (checkpoint_dir(run_dir) / LATEST).exists() or bool(complete_checkpoints(run_dir))


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    """Check (on every rank, before any collective) that the run directory fits the request."""
    if not resume and _has_checkpoint(run_dir):
        raise OptionError(
            "run_dir", "already holds a trained run; pass {resume}, or choose another directory", run_dir, resume=True
        )
    if resume and not _has_checkpoint(run_dir):
        raise OptionError("resume", f"{run_dir} has no checkpoint to resume from", True)
    if run_dir.exists() and not run_dir.is_dir():
        raise OptionError("run_dir", "is a file, not a directory", run_dir)


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
    run = _setup(cfg, Path(run_dir), resume, torch.device(device), progress, init, fallback)
    try:
        _announce(run, init if run.resume_from is None else None)
        return _steps(run, progress, on_step)
    finally:
        run.experts.close()


@dataclass
class _Run:
    """What setup hands the step loop: the model built, placed on the mesh and maybe resumed."""

    cfg: RunConfig
    run_dir: Path
    dev: torch.device
    main: bool  # rank 0: owns the console and the run directory
    say: Callable[[str], None]
    layout: Layout
    mesh: Any
    saver: Checkpointer
    corpus: Corpus
    model_summary: str  # sizes of the whole model, taken before it is split over ranks
    flops_per_token: float  # trained (forward + backward) per token
    pm: ParallelModel
    local: torch.nn.Module  # this rank's model, as checkpoints hold it
    optimizer: torch.optim.Optimizer
    start_step: int
    resume_from: Path | None
    manifest: dict[str, Any]
    experts: ExpertStorage  # where the experts' state lives: in the model, or offloaded (train.memory_budget)


def _setup(
    cfg: RunConfig, run_dir: Path, resume: bool, dev: torch.device, progress: bool, init: Path | None, fallback: bool
) -> _Run:
    """Check the request, claim the offload file, then build the run (``_build``)."""
    if dev.type == "cpu":
        keep_freed_memory()
    if init is not None and resume:
        raise OptionError(
            "init",
            "starts a new run from another run's weights; it cannot be combined with {resume}",
            init,
            resume=True,
        )
    main = global_rank() == 0  # before the process group
    say = tqdm.write if progress and main else (lambda msg: print(msg, file=sys.stderr))
    # A restarted worker continues the run from its own checkpoint, one started from init's weights too.
    resume = resume or _elastic_restart(run_dir)
    resolve_files(cfg.data.path)  # a corpus that is not there is reported before the run directory is made
    _check_run_dir(run_dir, resume)
    if resume:
        check_resumable(cfg, run_dir)
    storage = claim_offload_file(cfg, run_dir)  # refused (in use, unusable), it leaves nothing behind
    try:
        if main:  # rank 0 alone creates the run directory
            run_dir.mkdir(parents=True, exist_ok=True)
        return _build(cfg, run_dir, resume, dev, init, fallback, main, say, storage)
    except BaseException:
        if storage is not None:
            storage.remove()
        raise


def _build(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    dev: torch.device,
    init: Path | None,
    fallback: bool,
    main: bool,
    say: Callable[[str], None],
    storage: StorageFile | None,
) -> _Run:
    """Join the ranks, prepare the corpus, build the model (its experts offloaded into ``storage``) and resume it."""
    layout, mesh = init_distributed(cfg, dev)
    saver = Checkpointer(run_dir, cfg.train.keep_checkpoints, cfg.train.async_checkpoint, cfg.parallel.timeout_s)
    resume_from = saver.choose(fallback, say if main else lambda msg: None) if resume else None
    manifest = load_manifest(resume_from) if resume_from is not None else {}
    if resume_from is not None:
        cfg = _rebatch(cfg, manifest, layout, resume_from)
    torch.manual_seed(cfg.train.seed)
    # A resumed run encodes its text with its own tokenizer: one built again from other data would
    # give the same ids other meanings.
    own = run_dir if resume_from is not None and (run_dir / "tokenizer.json").is_file() else None
    corpus = _prepare_corpus_once(cfg, main, mesh is not None, own or init)
    if init is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size))
    elif corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise OptionError(
            "init",
            f"its tokenizer has {corpus.tokenizer.vocab_size} tokens, "
            f"more than model.vocab_size={cfg.model.vocab_size}",
            init,
        )
    if main and resume_from is None:
        write_bytes_atomic(run_dir / "config.json", cfg.to_json().encode())
        corpus.tokenizer.save(run_dir)
    model, pm, optimizer, experts = build_model(cfg, storage, dev, layout, mesh, init if resume_from is None else None)
    flops_per_token = model.flops_per_token()
    summary = (
        f"{model.num_params() / 1e6:.2f}M parameters ({model.num_active_params() / 1e6:.2f}M active per token, "
        f"{flops_per_token / 1e6:.1f} MFLOPs per token trained), {len(model.moe_layers())} MoE blocks"
    )
    local = local_model(pm.modules)
    start_step = 0
    if resume_from is not None:
        start_step = _restore(saver, resume_from, local, optimizer, model, experts)
        if start_step > cfg.train.steps:  # it would train nothing, and config.json would say fewer steps than ran
            reason = f"the run in {run_dir} is at step {start_step}: give at least that many to resume it"
            raise OptionError("train.steps", reason, cfg.train.steps)
        if main:  # the resumed run's settings (a new train.steps, ...), once its checkpoint has loaded
            write_bytes_atomic(run_dir / "config.json", cfg.to_json().encode())
    return _Run(
        cfg=cfg,
        run_dir=run_dir,
        dev=dev,
        main=main,
        say=say,
        layout=layout,
        mesh=mesh,
        saver=saver,
        corpus=corpus,
        model_summary=summary,
        flops_per_token=flops_per_token,
        pm=pm,
        local=local,
        optimizer=optimizer,
        start_step=start_step,
        resume_from=resume_from,
        manifest=manifest,
        experts=experts,
    )


def _restore(
    saver: Checkpointer,
    path: Path,
    local: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    whole: torch.nn.Module,
    experts: ExpertStorage,
) -> int:
    """Load checkpoint ``path`` into this rank's model and optimizer (its state; the hyperparameters stay
    this run's); returns its step. Offloaded experts are streamed from it into their file
    (``offload/checkpoint.py``)."""
    with experts.restoring(local) as streamed, keeping_hyperparameters(optimizer):
        return int(saver.restore(path, local, optimizer, whole, streamed=streamed)["step"])


def _announce(run: _Run, init: Path | None) -> None:
    """One line on the console (rank 0), one per other rank on its stderr."""
    layout = run.layout
    if not run.main:
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in run.pm.parameters())
        print(
            f"moekit rank {run.pm.ranks.rank}/{layout.world}: mesh {run.mesh}, {held / 1e6:.2f}M parameters held",
            file=sys.stderr,
        )
        return
    where = f"; {layout.world} ranks ({_describe(layout)})" if run.mesh is not None else ""
    run.say(
        f"moekit: {run.model_summary}; corpus {run.corpus.source}, {len(run.corpus.train):,} train tokens{where}"
        + (f"; resuming at step {run.start_step} from {run.resume_from}" if run.resume_from else "")
        + (f"; weights from {init}" if init is not None else "")
    )


def _steps(run: _Run, progress: bool, on_step: Callable[[dict[str, Any]], None] | None) -> TrainResult:
    """The optimizer steps, each logged, evaluated and checkpointed on schedule, until the last or a Ctrl-C."""
    cfg, pm, saver, main = run.cfg, run.pm, run.saver, run.main
    tc = cfg.train
    evals, saves = Every(tc.eval_every, tc.steps), Every(tc.ckpt_every, tc.steps)
    streak = NonFiniteStreak(
        tc.max_nonfinite_steps, int(run.manifest.get("skipped_steps", 0)), int(run.manifest.get("nonfinite_streak", 0))
    )
    meter = _Meter(run)
    losses: list[float] = []
    val_loss: float | None = None
    checkpoint = run.resume_from if main else None
    step = run.start_step
    bar = tqdm(total=tc.steps, initial=step, disable=not (progress and main), unit="step", dynamic_ncols=True)
    pm.train(True)
    logger = MetricsLogger(run.run_dir) if main else contextlib.nullcontext()
    with logger, StopOnInterrupt(run.mesh) as interrupt, saver, CompileWatch() as compiled:
        stopping = interrupt.agreed()
        while step < tc.steps and not stopping:
            started = time.perf_counter()
            record = train_step(pm, run.optimizer, run.corpus, cfg, run.dev, step, checkpoint, run.experts)
            step += 1
            record.update(meter.record(time.perf_counter() - started))
            if tc.compile:
                record.update(compiled.record())  # cumulative: a recompile after warm-up shows as a rise
                if main and step == run.start_step + 1:
                    run.say(f"moekit: torch.compile: {compiled.graphs} graphs compiled in {compiled.seconds:.1f}s")
            losses.append(record["loss"])
            streak.count(record["skipped"])
            record["skipped_steps"] = streak.skipped
            if record["skipped"] and main:
                run.say(streak.warning(step, record["grad_norm"]))
            if evals.due(step):
                val_loss = record["val_loss"] = evaluate(pm, run.corpus, cfg, run.dev)
            if main:
                logger.log(record)
            checkpoint = saver.poll() or checkpoint
            if streak.exceeded:
                checkpoint = saver.wait() or checkpoint
                raise TrainingError(streak.stop(step) + last_good(checkpoint))
            stopping = interrupt.agreed()  # one collective per step decides for every rank
            if saves.due(step) or stopping:
                checkpoint = _save(run, step, record, streak.streak, checkpoint)
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                val=f"{val_loss:.3f}" if val_loss else "-",
                **({"compile": f"{compiled.seconds:.0f}s", "recompiles": compiled.recompiles} if tc.compile else {}),
                refresh=False,
            )
            if on_step is not None:
                on_step(record)
        checkpoint = saver.wait() or checkpoint
    bar.close()
    if interrupt.requested and main:
        run.say(f"moekit: interrupted at step {step}; checkpoint {checkpoint}")
    return TrainResult(
        run.run_dir, step, losses, val_loss, checkpoint, interrupted=interrupt.requested, skipped_steps=streak.skipped
    )


class _Meter:
    """A step's speed: tokens per second and, on a device whose peak is known, MFU."""

    def __init__(self, run: _Run) -> None:
        tc = run.cfg.train
        self.tokens = tc.batch_size * run.cfg.model.context_length * tc.grad_accum * run.layout.batch_ranks
        self.peak = peak_tflops(tc.peak_tflops, run.dev, tc.dtype)
        self.flops_per_token, self.world = run.flops_per_token, run.layout.world

    def record(self, seconds: float) -> dict[str, float]:
        record = {"tokens_per_s": self.tokens / seconds}
        if self.peak is not None:  # an unknown GPU: no MFU rather than one read against a guess
            record["mfu"] = self.flops_per_token * record["tokens_per_s"] / (self.peak * 1e12 * self.world)
        return record


def _save(run: _Run, step: int, record: dict[str, Any], streak: int, checkpoint: Path | None) -> Path | None:
    """Start a checkpoint of finite weights (or stop the run); returns the newest published one. Offloaded
    experts are streamed from their file into it (``offload/checkpoint.py``)."""
    with run.experts.saving(run.local) as streamed:
        if not _weights_finite(run.local, run.mesh, run.experts):
            checkpoint = run.saver.wait() or checkpoint
            raise TrainingError(
                f"weights are not finite after step {step}: checkpoint not saved, training stopped; "
                + last_good(checkpoint)
            )
        info = _checkpoint_info(step, run.cfg, run.layout, record, streak)
        return run.saver.save(step, run.local, run.optimizer, info, run.pm.expert_slots(), streamed) or checkpoint


def _describe(layout) -> str:
    return " x ".join(f"{name}={getattr(layout, name)}" for name in ("dp", "ep", "tp", "pp"))


def _weights_finite(model: torch.nn.Module, mesh, experts: ExpertStorage) -> bool:
    """True on every rank if no rank holds a NaN or inf in a parameter or floating-point buffer: what a
    checkpoint would save (a DTensor's local shard is enough, the ranks' verdicts are combined). A tensor
    without storage is held outside the model (offloaded experts): ``experts`` checks those."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in (*model.parameters(), *model.buffers()):
        piece = t.to_local() if hasattr(t, "to_local") else t
        if piece.is_floating_point() and piece.untyped_storage().nbytes() > 0:
            by_device.setdefault(piece.device, []).append(piece.detach().isfinite().all())
    local = all(bool(torch.stack(flags).all()) for flags in by_device.values())  # one sync per device
    local = local and experts.weights_finite()
    return not agree(not local, mesh)


def _prepare_corpus_once(cfg: RunConfig, main: bool, distributed: bool, tokenizer_dir: Path | None) -> Corpus:
    """Rank 0 tokenises (and fills the cache) first; the other ranks then read the cache."""
    if not distributed:
        return prepare_corpus(cfg.data, cfg.model.context_length, tokenizer_dir=tokenizer_dir)
    corpus = prepare_corpus(cfg.data, cfg.model.context_length, tokenizer_dir=tokenizer_dir) if main else None
    dist.barrier()
    return corpus or prepare_corpus(cfg.data, cfg.model.context_length, tokenizer_dir=tokenizer_dir)


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
