"""``GET /metrics``: the server's counters in Prometheus' text format (prometheus_client), one registry
per server so that several can live in one process.

Updated on the engine thread as tokens come out; what the engine already counts (queue, KV blocks,
expert load, the expert cache) is read at scrape time instead of being copied every step, and so is
the engine thread's CPU time from the kernel: a step slower in the server than in a quiet process
shows there as time spent waiting for a CPU (other threads or processes) or asleep (the GIL).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from moekit.serve.engine import Engine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Requests, tokens and latencies of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moekit_requests", "requests answered, by HTTP status", ["status"], registry=r)
        self.choices = Counter("moekit_choices", "choices finished, by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("moekit_prompt_tokens", "prompt tokens of finished choices", registry=r)
        self.generation_tokens = Counter("moekit_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "moekit_time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "moekit_inter_token_latency_seconds", "between a choice's tokens", buckets=LATENCY_BUCKETS, registry=r
        )

    def token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.choices.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def watch(self, engine: Engine) -> None:
        """Report ``engine``'s queue, KV cache, expert load and expert cache on every scrape."""
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def thread_cpu_seconds(thread_id: int) -> tuple[float, float] | None:
    """Seconds a thread of this process has run on a CPU, and waited ready to run for one, as the kernel
    counts them (Linux ``schedstat``); ``None`` where the kernel does not say."""
    try:
        with open(f"/proc/self/task/{thread_id}/schedstat") as f:
            running, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(running) / 1e9, int(waiting) / 1e9


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        running, waiting = e.in_flight
        yield GaugeMetricFamily("moekit_queue_length", "choices waiting for admission", value=waiting)
        yield GaugeMetricFamily("moekit_running_sequences", "choices in the running batch", value=running)
        used = 1 - e.pool.free_blocks / e.pool.num_blocks
        yield GaugeMetricFamily("moekit_kv_cache_usage", "share of KV blocks reserved", value=used)
        yield CounterMetricFamily("moekit_steps", "scheduler steps run", value=e.steps)
        yield CounterMetricFamily(
            "moekit_preemptions", "running sequences sent back to the queue for want of KV blocks", value=e.preemptions
        )
        phases = CounterMetricFamily("moekit_engine_seconds", "engine thread time by phase", labels=["phase"])
        for phase, seconds in e.seconds.items():
            phases.add_metric([phase], seconds)
        yield phases
        scheduled = None if e.thread_id is None else thread_cpu_seconds(e.thread_id)
        if scheduled is not None:
            cpu = CounterMetricFamily(
                "moekit_engine_thread_seconds",
                "engine thread time on a CPU (running) and ready to run while other threads or processes held "
                "the CPUs (waiting); the rest of its time it sleeps (idle, or waiting for the GIL)",
                labels=["state"],
            )
            for state, seconds in zip(("running", "waiting"), scheduled, strict=True):
                cpu.add_metric([state], seconds)
            yield cpu
        load = CounterMetricFamily("moekit_expert_tokens", "tokens routed to each expert", labels=["layer", "expert"])
        for layer, counts in enumerate(e.expert_load):
            for expert, n in enumerate(counts.tolist()):
                load.add_metric([str(layer), str(expert)], n)
        yield load
        offloader = e.run.offloader
        if offloader is not None:
            stats = offloader.stats
            yield GaugeMetricFamily("moekit_expert_cache_hit_rate", "needed experts found resident", stats.hit_rate)
            yield CounterMetricFamily("moekit_expert_bytes_read", "expert bytes read from disk", stats.bytes_read)
