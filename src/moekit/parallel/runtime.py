"""One training step's work on any layout: the single process, or ranks under torchrun.

``ParallelModel`` is what the training loop drives. It builds the layout from ``cfg.parallel``
(checked before any collective), applies the parallelisms to the single-device model in one order
(pipeline split -> tensor parallel -> expert parallel -> FSDP -> per-block torch.compile), and offers
the few operations the loop needs: forward+backward of a micro-batch, evaluation, gradient finishing
and clipping, reduced and statistics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moekit.layer import MoE
from moekit.model import Transformer
from moekit.parallel.compile import apply_compile
from moekit.parallel.ep import apply_ep
from moekit.parallel.fsdp import apply_fsdp, finish_expert_grads
from moekit.parallel.grads import clip_grad_norm
from moekit.parallel.mesh import Layout, LayoutError, RunMesh, build_mesh, microbatches, resolve_layout
from moekit.parallel.pp import Pipeline, build_pipeline, build_stages
from moekit.parallel.rebalance import Rebalancer
from moekit.parallel.tp import apply_tp
from moekit.runconfig import RunConfig
from moekit.stats import MoEStats, merge_micro_batches


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_rank() -> int:
    """This process's rank as torchrun set it (0 alone), readable before the process group exists."""
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Ranks:
    """Where this process sits."""

    rank: int = 0
    world: int = 1
    batch_rank: int = 0  # index among the ranks that read different data (dp x ep)
    batch_ranks: int = 1


def init_distributed(cfg: RunConfig, device: torch.device) -> tuple[Layout, RunMesh | None]:
    """Check the layout against the world (before any collective), then join the process group."""
    world = world_size()
    layout = resolve_layout(cfg, world)
    if world == 1:
        return layout, None
    if cfg.model.tie_embeddings and layout.pp > 1:
        raise LayoutError("parallel.pp > 1 needs model.tie_embeddings = false (the first and last stages differ)")
    if layout.pp > 1 and cfg.moe.router == "hash" and cfg.is_moe:
        raise LayoutError("parallel.pp > 1 cannot carry the token ids hash routing needs past the first stage")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.parallel.timeout_s)
        dist.init_process_group(backend, timeout=timeout, **_restart_store(timeout))
    return layout, build_mesh(layout, device.type, timedelta(seconds=cfg.parallel.timeout_s))


def _restart_store(timeout: timedelta) -> dict:
    """After an elastic restart, a store namespace of this attempt's own.

    NOTE: the elastic agent keeps its store across restarts, so the restarted ranks would find the
    dead ranks' gloo addresses under the same keys and fail to connect; a prefix per attempt avoids it.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        return {}
    rank, world = int(os.environ["RANK"]), world_size()
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, not hosted and rank == 0, timeout
    )
    return {"store": dist.PrefixStore(f"moekit/attempt{attempt}", store), "rank": rank, "world_size": world}


class ParallelModel:
    """The model as this rank holds it, and the step operations over it."""

    def __init__(
        self, model: Transformer, cfg: RunConfig, device: torch.device, layout: Layout, mesh: RunMesh | None
    ) -> None:
        self.cfg, self.device = cfg, device
        self.layout, self.mesh = layout, mesh
        self.full_model = model  # single-device structure; its modules are shared with the shards
        self.pipeline: Pipeline | None = None
        self.rebalancer: Rebalancer | None = None  # expert placement and shadows (ep > 1)
        if self.mesh is None:
            self.ranks = Ranks()
            self.modules: list[nn.Module] = [model]
            if cfg.train.compile:
                apply_compile(list(model.blocks))
            return
        mesh, layout = self.mesh, self.layout
        self.ranks = Ranks(dist.get_rank(), dist.get_world_size(), mesh["batch"].get_local_rank(), layout.batch_ranks)
        if layout.pp > 1:
            self.modules = build_stages(model, mesh["pp"], cfg.parallel.stages_per_rank)
        else:
            self.modules = [model]
        for module in self.modules:
            apply_tp(module, mesh["tp"])
            apply_ep(module, mesh, layout, cfg.parallel)
            blocks = list(module.blocks.values()) if isinstance(module.blocks, nn.ModuleDict) else list(module.blocks)
            apply_fsdp(module, blocks, mesh, layout, cfg.parallel)
            if cfg.train.compile:
                apply_compile(blocks)
        if layout.ep > 1:
            self.rebalancer = Rebalancer(self.moe_layers(), mesh["ep"].get_group(), cfg.parallel)
        if layout.pp > 1:
            self.pipeline = build_pipeline(
                self.modules, mesh["pp"], cfg.parallel.pp_schedule, microbatches(cfg), device
            )

    # --- what the loop calls -----------------------------------------------------------------------

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter this rank holds, once (pipeline stages may share one), by its model name."""
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for module in self.modules:
            for name, p in module.named_parameters():
                seen.setdefault(id(p), (name, p))
        return list(seen.values())

    def moe_layers(self) -> list[MoE]:
        return [m for module in self.modules for m in module.moe_layers()]

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)

    def forward_backward(self, x: Tensor, y: Tensor, scale: float) -> tuple[Tensor, Tensor, list[MoEStats]]:
        """One micro-batch: backward of ``loss * scale``; returns (loss, lm loss, this rank's MoE stats).

        Under pipeline parallelism both losses are the last stage's lm loss (NaN on other stages
        until broadcast) and the stats are the local stages' merged over the schedule's micro-batches.
        """
        if self.pipeline is None:
            out = self.modules[0](x, y)
            (out.loss * scale).backward()
            return out.loss.detach(), out.lm_loss.detach(), out.moe_stats
        per_micro = scale / self.pipeline.microbatches
        for stage in self.pipeline.stages:
            stage.aux_scale = per_micro
        self.pipeline.loss.scale = per_micro
        losses: list[Tensor] = []
        kwargs = {"target": y, "losses": losses} if self.pipeline.has_last else {}
        args = (x,) if self.pipeline.has_first else ()
        self.pipeline.schedule.step(*args, **kwargs)
        lm = torch.stack(losses).mean().detach() / per_micro if losses else torch.full((), float("nan"))
        return lm, lm, merge_micro_batches(self.pipeline.collect_stats())

    @torch.no_grad()
    def lm_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Validation cross-entropy of one batch (the same on every rank)."""
        if self.pipeline is None:
            return self.modules[0](x, y).lm_loss
        losses: list[Tensor] = []
        kwargs = {"target": y, "losses": losses} if self.pipeline.has_last else {}
        self.pipeline.loss.scale = 1.0
        self.pipeline.schedule.eval(*((x,) if self.pipeline.has_first else ()), **kwargs)
        self.pipeline.collect_stats()
        return self.broadcast_from_last_stage(torch.stack(losses).mean() if losses else torch.zeros(()))

    def broadcast_from_last_stage(self, value: Tensor) -> Tensor:
        """Every rank gets the last pipeline stage's value (the lm loss lives there)."""
        if self.mesh is None or self.layout.pp == 1:
            return value
        value = value.detach().float().cpu().clone()
        pp_mesh = self.mesh["pp"]
        dist.broadcast(value, group_src=pp_mesh.size() - 1, group=pp_mesh.get_group())
        return value

    def mean_over_batch(self, value: Tensor) -> Tensor:
        if self.mesh is None or self.layout.batch_ranks == 1:
            return value
        value = value.detach().float().cpu().clone()
        dist.all_reduce(value, group=self.mesh["batch"].get_group())
        return value / self.layout.batch_ranks

    def finish_gradients(self) -> None:
        if self.rebalancer is not None:
            self.rebalancer.finish_shadow_grads()
        if self.mesh is not None:
            for module in self.modules:
                finish_expert_grads(module, self.mesh, self.layout, self.cfg.parallel)

    def clip_gradients(self, max_norm: float) -> Tensor:
        stage_ranks = self.ranks.world // self.layout.pp
        return clip_grad_norm(self.parameters(), max_norm, stage_ranks, distributed=self.mesh is not None)

    def rebalance(self, step: int, loads: list[Tensor], optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """After the optimizer step: expert placement's metrics, and any re-placement it decides."""
        if self.rebalancer is None:
            return {}
        return self.rebalancer.after_step(step, loads, optimizer)

    def expert_slots(self) -> dict[str, tuple[int, ...]]:
        """Where re-placed experts run now, for a checkpoint to write (and read) them in canonical order
        without moving them: each expert parameter's name in the local model -> its layer's
        ``expert_to_slot``. Layers in canonical order are left out (empty without re-placement, which
        is all there is with pipeline stages: the layout refuses placement with pp > 1)."""
        if self.rebalancer is None:
            return {}
        # Stage models name their blocks as the whole model does (blocks.3), as the local model does.
        names = {id(m): name for module in self.modules for name, m in module.named_modules()}
        out = {}
        for moe, slots in self.rebalancer.moved_layers().items():
            for param, _ in moe.experts.named_parameters(recurse=False):
                out[f"{names[id(moe)]}.experts.{param}"] = slots
        return out

    def reduce_layers(self, layers: list[Tensor]) -> list[Tensor]:
        """Per-layer statistic vectors of this rank's MoE layers -> the whole model's, in layer order,
        summed over all data-reading ranks."""
        if self.mesh is None:
            return layers
        if layers and self.layout.batch_ranks > 1:
            flat = torch.cat(layers)
            dist.all_reduce(flat, group=self.mesh["batch"].get_group())
            layers = list(flat.split([t.numel() for t in layers]))
        if self.layout.pp > 1:
            every: list[list[tuple[int, Tensor]] | None] = [None] * self.layout.pp
            mine = [(m.index, t) for m, t in zip(self.moe_layers(), layers, strict=True)]
            dist.all_gather_object(every, mine, group=self.mesh["pp"].get_group())
            return [t for _, t in sorted(item for stage in every for item in stage)]
        return layers
