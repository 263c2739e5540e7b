"""How a run is spread over ranks (``[parallel]`` of a run)."""

from __future__ import annotations

from dataclasses import dataclass

from moekit.config.fields import NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, check_fields, choice, option, require

ALL_TO_ALL = ("flat", "two_level")
EXPERT_SHARDING = ("shard", "replicate")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")


@dataclass
class ParallelConfig:
    """How a run is spread over ranks; the world size must equal dp * ep * tp * pp."""

    dp: int = option(
        0, "data-parallel (FSDP) degree; 0 = what the world size leaves after ep * tp * pp", NONNEGATIVE_INT
    )
    ep: int = option(
        1, "expert-parallel degree: each ep rank holds num_experts / ep experts of every MoE layer", POSITIVE_INT
    )
    tp: int = option(1, "tensor-parallel degree for attention and dense MLPs", POSITIVE_INT)
    pp: int = option(1, "pipeline stages (layers split into pp ranks)", POSITIVE_INT)
    all_to_all: str = option(
        "flat", "flat | two_level (within a node, then across nodes: Tutel 2DH)", choice(*ALL_TO_ALL)
    )
    node_size: int = option(
        0, "ep ranks per node for the two-level all-to-all; 0 = ranks on this host / tp", NONNEGATIVE_INT
    )
    overlap_chunks: int = option(
        1, ">1: split each dispatch so one chunk's all-to-all overlaps another's GEMM", POSITIVE_INT
    )
    dispatch_dedup: bool = option(
        False, "send a token once per ep rank holding any of its experts, not once per expert"
    )
    expert_sharding: str = option(
        "shard", "expert weights over dp: shard (FSDP) | replicate (all-reduced grads)", choice(*EXPERT_SHARDING)
    )
    pp_schedule: str = option("1f1b", "gpipe | 1f1b | interleaved_1f1b | looped_bfs", choice(*PP_SCHEDULES))
    pp_microbatches: int = option(
        0, "micro-batches per pipeline step; 0 = 2 * pp (must divide train.batch_size)", NONNEGATIVE_INT
    )
    timeout_s: float = option(
        300.0, "a collective waiting longer than this (a dead rank) ends the run with an error", POSITIVE
    )
    placement_every: int = option(
        0, ">0: every this many steps, re-place experts by the loads seen since (SmartMoE)", NONNEGATIVE_INT
    )
    placement_min_gain: float = option(
        0.05, "re-place only when the busiest rank's predicted load drops by this fraction"
    )
    placement_max_moves: int = option(
        0, "most experts one re-placement may move per layer (bounds the bytes); 0 = any", NONNEGATIVE_INT
    )
    shadow_experts: int = option(
        0, ">0: replicate up to this many popular experts on every ep rank (FasterMoE)", NONNEGATIVE_INT
    )

    def __post_init__(self) -> None:
        check_fields(self, "parallel.")
        ok = 0 <= self.placement_min_gain < 1
        require(ok, "parallel.placement_min_gain", self.placement_min_gain, "must be in [0, 1)")
        if self.shadow_experts:
            require(
                self.placement_every > 0,
                "parallel.shadow_experts",
                self.shadow_experts,
                "needs parallel.placement_every > 0 (shadows are chosen at each placement check)",
            )

    @property
    def stages_per_rank(self) -> int:
        """Interleaved schedules hold two model chunks per pipeline rank."""
        return 2 if self.pp_schedule in ("interleaved_1f1b", "looped_bfs") else 1
