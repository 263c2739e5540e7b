"""Collective times, alpha-beta: a latency per message plus bytes over the link's bandwidth, with the
slower (inter-node) link for traffic that leaves the node.

A ring's steps wait for each other, so its latencies add up. An all-to-all's messages to its peers do
not: NCCL's all-to-all is one group of ``ncclSend``/``ncclRecv`` calls, one pair a peer (what
``torch.distributed.all_to_all_single`` issues, and Megatron-Core's ``alltoall`` dispatcher with it), and
"calls within a group can be seen as progressing independently" (NCCL user guide, Point-to-point
communication, https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html); DeepEP's
internode kernels likewise write to every remote node at once (https://github.com/deepseek-ai/DeepEP).
On devices their latencies overlap: one latency a link, the bytes paced by the link (across nodes, the
device's own NIC: one a GPU on DGX-H100). CPU ranks (``Cluster.cores``) are charged one latency a peer:
a core copies each peer's chunk in turn, which is how ``benchmarks/planner_calibration.py`` measures it.

Ranks follow a mesh with the given group's members ``stride`` ranks apart, so a group of ``n`` ranks
has ``min(n, G // stride)`` members per node of ``G`` devices.
"""

from __future__ import annotations

from moekit.parallel.planner.presets import Cluster


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many ranks of a mesh group (``size`` ranks, ``stride`` apart) share a node."""
    return 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))


def posted_latency(peers: int, latency_us: float, c: Cluster) -> float:
    """Seconds of latency of messages posted together to ``peers`` ranks over one link: one
    ``latency_us`` on devices, one a peer on CPU ranks (see the module docstring)."""
    return 0.0 if peers <= 0 else latency_us * 1e-6 * (peers if c.cores else 1)


def all_to_all_time(nbytes: float, size: int, stride: int, c: Cluster, two_level: bool = False) -> float:
    """One exchange in which each rank holds ``nbytes`` spread evenly over the ``size`` ranks. Flat: the
    node's peers over NVLink and the other nodes' peers over the NIC at once, the slower path setting the
    time. Two-level: first within the node, then across it, one stage after the other."""
    if size == 1:
        return 0.0
    local = members_per_node(size, stride, c.gpus_per_node)
    b_in, b_out = c.intra_gbps * 1e9, c.inter_gbps * 1e9
    within = posted_latency(local - 1, c.intra_latency_us, c)
    within += nbytes * (local - 1) / (local if two_level else size) / b_in
    if local == size:
        return within
    if two_level and local > 1:
        nodes = size // local
        return within + posted_latency(nodes - 1, c.inter_latency_us, c) + nbytes * (nodes - 1) / nodes / b_out
    across = posted_latency(size - local, c.inter_latency_us, c) + nbytes * (size - local) / size / b_out
    return max(within, across)


def remote_nodes(top_k: int, nodes: int, reach: int) -> float:
    """Expected nodes other than its own that one token's ``top_k`` expert copies land on, ``nodes``
    nodes in the expert group, the router confining each token to ``reach`` of them (DeepSeek-V3's
    node-limited routing; ``reach`` = ``nodes`` without it), experts picked uniformly: ``reach (1 -
    (1 - 1 / reach)^top_k)`` distinct nodes, each the token's own with probability ``1 / nodes``."""
    reach = max(1, min(reach, nodes))
    return (nodes - 1) / nodes * reach * (1 - (1 - 1 / reach) ** top_k)


def deduplicated_time(
    rows: float, row_bytes: float, top_k: int, size: int, stride: int, c: Cluster, reach: int
) -> float:
    """One hierarchical dispatch (or combine) of ``rows`` tokens of ``row_bytes`` each, ``top_k`` copies a
    token (DeepEP's internode kernels): a token crosses the inter-node link once per destination node,
    deduplicated (``remote_nodes``), to the rank of the same local index there, which forwards it over
    NVLink to the ranks holding its experts (a copy's rank is another one of the node's with
    probability ``(local - 1) / local``); the combine reduces within the node first and sends back the
    same bytes. The two stages are pipelined: the slower one sets the time, after the latency of each."""
    if size == 1:
        return 0.0
    local = members_per_node(size, stride, c.gpus_per_node)
    nodes = size // local
    across = rows * row_bytes * remote_nodes(top_k, nodes, reach) / (c.inter_gbps * 1e9)
    within = rows * row_bytes * top_k * (local - 1) / local / (c.intra_gbps * 1e9)
    latency = posted_latency(local - 1, c.intra_latency_us, c) + posted_latency(nodes - 1, c.inter_latency_us, c)
    return latency + max(across, within)


def ring_time(nbytes: float, size: int, stride: int, c: Cluster, passes: float = 2.0) -> float:
    """A ring collective over ``nbytes``: all-reduce is 2 passes, reduce-scatter or all-gather 1."""
    if size == 1:
        return 0.0
    local = members_per_node(size, stride, c.gpus_per_node)
    alpha, bw = (c.intra_latency_us, c.intra_gbps) if local == size else (c.inter_latency_us, c.inter_gbps)
    return passes * ((size - 1) * alpha * 1e-6 + nbytes * (size - 1) / size / (bw * 1e9))


def p2p_time(nbytes: float, stride: int, c: Cluster, size: int = 2) -> float:
    """One send to the next rank of a ring or pipeline of ``size`` ranks ``stride`` apart: over the
    inter-node link as soon as the group leaves a node, since its slowest hop paces every step."""
    same_node = members_per_node(size, stride, c.gpus_per_node) == size
    alpha, bw = (c.intra_latency_us, c.intra_gbps) if same_node else (c.inter_latency_us, c.inter_gbps)
    return alpha * 1e-6 + nbytes / (bw * 1e9)
