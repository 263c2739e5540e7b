"""The parallel layout of a run: sizes checked against the model and the world, then a DeviceMesh.

Mesh dimensions, outermost first: ``pp, dp, ep_node, ep_local, tp``. ``ep`` is ``ep_node x ep_local``
flattened (nodes of ``node_size`` ep ranks, for the two-level all-to-all), and ``batch`` is
``dp x ep``: every rank of it reads different data, as expert parallelism is data parallel outside
the experts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moekit.config import TOKEN_CHOICE_ROUTERS
from moekit.runconfig import RunConfig


class LayoutError(ValueError):
    """A parallel layout that cannot run this model on this world; raised before any collective."""


@dataclass(frozen=True)
class Layout:
    dp: int
    ep: int
    tp: int
    pp: int
    node_size: int  # ep ranks per node (ep when the all-to-all is flat)

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.tp * self.pp

    @property
    def batch_ranks(self) -> int:
        """Ranks that read different micro-batches (dp x ep)."""
        return self.dp * self.ep


def resolve_layout(cfg: RunConfig, world_size: int, local_world_size: int | None = None) -> Layout:
    """Check ``cfg.parallel`` against the model and ``world_size``; fill in dp and node_size."""
    p, m = cfg.parallel, cfg.model
    fixed = p.ep * p.tp * p.pp
    if p.dp == 0:
        if world_size % fixed:
            raise LayoutError(
                f"parallel: ep*tp*pp = {p.ep}*{p.tp}*{p.pp} = {fixed} does not divide the world size {world_size}"
            )
        dp = world_size // fixed
    else:
        dp = p.dp
        if dp * fixed != world_size:
            raise LayoutError(
                f"parallel: dp*ep*tp*pp = {dp}*{p.ep}*{p.tp}*{p.pp} = {dp * fixed} != world size {world_size}"
            )
    experts = m.experts_per_layer or ([cfg.moe.num_experts] if cfg.is_moe else [])
    bad = [n for n in experts if n % p.ep]
    if p.ep > 1 and not experts:
        raise LayoutError(f"parallel.ep={p.ep}: the model has no MoE blocks to spread")
    if bad:
        raise LayoutError(f"parallel.ep={p.ep} must divide the experts of every MoE block (got {bad[0]})")
    if p.tp > 1 and m.attention == "mla":
        raise LayoutError(f"parallel.tp={p.tp}: tensor parallelism does not shard MLA (model.attention=mla); use ep/dp")
    if m.kv_heads % p.tp:
        raise LayoutError(f"parallel.tp={p.tp} must divide the key/value heads (model.n_kv_heads={m.kv_heads})")
    if p.tp > 1 and m.attn_sinks:
        raise LayoutError("parallel.tp > 1 with model.attn_sinks: splitting the sinks by head is not built")
    if p.tp > 1 and (m.d_ff % p.tp or (cfg.is_moe and cfg.moe.shared_hidden % p.tp)):
        raise LayoutError(
            f"parallel.tp={p.tp} must divide model.d_ff={m.d_ff} and the shared experts' width "
            f"({cfg.moe.shared_hidden if cfg.is_moe else 0})"
        )
    stages = p.pp * p.stages_per_rank
    if stages > m.n_layers:
        raise LayoutError(
            f"parallel.pp={p.pp} with {p.pp_schedule} needs {stages} pipeline stages but the model has "
            f"{m.n_layers} layers"
        )
    if p.pp > 1 and cfg.train.batch_size % microbatches(cfg):
        raise LayoutError(
            f"parallel.pp_microbatches={microbatches(cfg)} must divide train.batch_size={cfg.train.batch_size}"
        )
    if p.placement_every and cfg.is_moe and cfg.moe.expert_ffn_bias:
        raise LayoutError("parallel.placement_every with moe.expert_ffn_bias: moving expert biases is not built")
    if p.placement_every and p.ep > 1:
        if p.pp > 1:
            raise LayoutError("parallel.placement_every needs parallel.pp = 1 (placement across stages is not built)")
        if dp > 1 and p.expert_sharding == "shard":
            raise LayoutError(
                "parallel.placement_every with parallel.dp > 1 needs parallel.expert_sharding = replicate "
                "(moving FSDP-sharded experts is not built)"
            )
    if p.dispatch_dedup and p.ep > 1:
        _check_dedup(cfg)
    node_size = p.ep
    if p.all_to_all == "two_level":
        node_size = p.node_size or infer_node_size(cfg, world_size, local_world_size)
        if p.ep % node_size:
            raise LayoutError(f"parallel.node_size={node_size} must divide parallel.ep={p.ep}")
    return Layout(dp, p.ep, p.tp, p.pp, node_size)


def _check_dedup(cfg: RunConfig) -> None:
    """The deduplicated dispatch runs each expert at its home rank, dropless, in one exchange each way."""
    p = cfg.parallel
    if p.overlap_chunks > 1:
        raise LayoutError(
            f"parallel.dispatch_dedup with parallel.overlap_chunks={p.overlap_chunks}: chunked overlap is built "
            "for the per-expert dispatch only; set one of them"
        )
    if p.placement_every:
        raise LayoutError(
            "parallel.dispatch_dedup with parallel.placement_every: re-placed and shadow experts are built "
            "for the per-expert dispatch only; set one of them"
        )
    if cfg.is_moe and cfg.moe.router not in TOKEN_CHOICE_ROUTERS:
        raise LayoutError(
            f"parallel.dispatch_dedup with moe.router={cfg.moe.router!r}: the deduplicated dispatch is tested "
            f"with the token-choice routers ({', '.join(TOKEN_CHOICE_ROUTERS)}) only"
        )
    if cfg.is_moe and cfg.moe.capacity_factor is not None:
        raise LayoutError(
            f"parallel.dispatch_dedup with moe.capacity_factor={cfg.moe.capacity_factor}: the deduplicated "
            "dispatch is dropless; unset moe.capacity_factor or parallel.dispatch_dedup"
        )


def infer_node_size(cfg: RunConfig, world_size: int, local_world_size: int | None = None) -> int:
    """The ep ranks per node for the two-level all-to-all, from the ranks per node (``LOCAL_WORLD_SIZE``).

    The mesh puts ``node_size x tp`` consecutive ranks in one ``ep_local`` group, which is only within a
    node if each node holds a consecutive block of ranks of the same size. torchrun numbers ranks so;
    other launchers may not (round-robin placement), so under a launcher the environment is checked:
    rank = node index (``GROUP_RANK``) x ranks per node + local rank, on every rank.
    """
    p = cfg.parallel
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node_size = max(1, min(p.ep, local // p.tp))
    how = "set parallel.node_size, or start every node with the same number of ranks, numbered node by node"
    if local_world_size is None and "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        node = int(os.environ.get("GROUP_RANK", rank // local))
        if world_size % local or rank != node * local + local_rank:
            raise LayoutError(
                f"parallel.all_to_all=two_level cannot infer parallel.ep's node size: rank {rank} is local rank "
                f"{local_rank} of {local} on node {node}, so the nodes do not hold consecutive blocks of "
                f"{local} ranks (world size {world_size}); {how}"
            )
    if local % (node_size * p.tp):
        raise LayoutError(
            f"parallel.all_to_all=two_level: groups of node_size x tp = {node_size} x {p.tp} ranks would span "
            f"two nodes of {local} ranks; {how}"
        )
    return node_size


def microbatches(cfg: RunConfig) -> int:
    return cfg.parallel.pp_microbatches or 2 * cfg.parallel.pp


class RunMesh:
    """The run's DeviceMesh by dimension name, including the flattened ``ep`` and ``batch`` (dp x ep)."""

    def __init__(self, root: DeviceMesh, group_options: tuple[str, dist.Backend.Options] | None = None) -> None:
        self.root = root
        self._flat = {
            "ep": root["ep_node", "ep_local"]._flatten("ep", backend_override=group_options),
            "batch": root["dp", "ep_node", "ep_local"]._flatten("batch", backend_override=group_options),
        }

    def __getitem__(self, name: str) -> DeviceMesh:
        return self._flat[name] if name in self._flat else self.root[name]

    def __repr__(self) -> str:
        return repr(self.root)


def build_mesh(layout: Layout, device_type: str, timeout: timedelta) -> RunMesh:
    """The mesh over the joined world, every process group of it failing a collective after ``timeout``.

    NOTE: DeviceMesh creates its sub-groups with torch's default timeout (30 minutes on gloo), not the
    default group's, so a rank hung in an expert-parallel exchange would go unnoticed for half an hour;
    passing the options to every dimension keeps ``parallel.timeout_s`` true for all collectives.
    """
    names = ("pp", "dp", "ep_node", "ep_local", "tp")
    shape = (layout.pp, layout.dp, layout.ep // layout.node_size, layout.node_size, layout.tp)
    options = group_options(device_type, timeout)
    root = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=dict.fromkeys(names, options))
    return RunMesh(root, options)


def group_options(device_type: str, timeout: timedelta) -> tuple[str, dist.Backend.Options]:
    """The backend and its options (the collective timeout) for every process group a run creates."""
    if device_type == "cuda":
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options
