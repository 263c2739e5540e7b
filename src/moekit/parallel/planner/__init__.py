"""The auto-parallel planner (SmartMoE's two stages): a cost model over numbers only, no process group.

Stage one (``search``) enumerates dp x ep x etp x tp x cp x pp x vp x micro-batches x all-to-all form x
overlap for a cluster, with the techniques switched on (``Techniques``), drops the layouts that do not
fit in memory (``memory``) and ranks the rest by predicted step time (``cost``, over ``layout``'s
schedule and ``traffic``'s elementwise bytes). Stage two (``rescore``) re-scores
candidates with measured expert loads, with and without load-aware placement, and says whether
switching pays. ``presets`` reads clusters and models, ``flops`` counts FLOPs and parameters,
``comm`` times collectives.
"""

from moekit.parallel.planner.comm import (
    all_to_all_time,
    deduplicated_time,
    members_per_node,
    p2p_time,
    remote_nodes,
    ring_time,
)
from moekit.parallel.planner.cost import (
    OVERLAP_CHUNKS,
    Estimate,
    estimate,
    gradient_sync_time,
    route_reach,
)
from moekit.parallel.planner.flops import (
    attention_dims,
    layer_flops,
    model_flops_per_token,
    param_counts,
    training_flops_per_token,
)
from moekit.parallel.planner.fsdp import fsdp_collectives, fsdp_exposed, fsdp_state_bytes
from moekit.parallel.planner.layout import Candidate, in_flight, micro_tokens, paired_share, stage_blocks
from moekit.parallel.planner.memory import MEMORY_USABLE, block_activation_bytes, memory_bytes
from moekit.parallel.planner.presets import Cluster, ModelSpec, Shape, Workload, load_cluster, load_model
from moekit.parallel.planner.rescore import Rescored, layout_imbalance, rescore
from moekit.parallel.planner.search import (
    ALL,
    MOEKIT,
    Techniques,
    Throughput,
    candidates,
    format_table,
    least_recompute,
    parse_techniques,
    plan,
    throughput,
)
from moekit.parallel.planner.traffic import elementwise_bytes, fp8_cast_values

__all__ = [
    "ALL",
    "MEMORY_USABLE",
    "MOEKIT",
    "OVERLAP_CHUNKS",
    "Candidate",
    "Cluster",
    "Estimate",
    "ModelSpec",
    "Rescored",
    "Shape",
    "Techniques",
    "Throughput",
    "Workload",
    "all_to_all_time",
    "attention_dims",
    "block_activation_bytes",
    "candidates",
    "deduplicated_time",
    "elementwise_bytes",
    "estimate",
    "fp8_cast_values",
    "format_table",
    "fsdp_collectives",
    "fsdp_exposed",
    "fsdp_state_bytes",
    "gradient_sync_time",
    "in_flight",
    "layer_flops",
    "layout_imbalance",
    "least_recompute",
    "load_cluster",
    "load_model",
    "members_per_node",
    "memory_bytes",
    "micro_tokens",
    "model_flops_per_token",
    "p2p_time",
    "paired_share",
    "param_counts",
    "parse_techniques",
    "plan",
    "remote_nodes",
    "rescore",
    "ring_time",
    "route_reach",
    "stage_blocks",
    "throughput",
    "training_flops_per_token",
]
