"""Continuous batching as a pure function of the queues and the budgets: which waiting sequences join
the running batch this step, and how many of its tokens each scheduled sequence feeds.

Every step, in order: each running sequence past its prompt decodes one token (decodes are never
stalled); sequences still in their prompt prefill a chunk of it (at most ``prefill_chunk`` tokens,
within what is left of the step's token budget); then waiting sequences are admitted first come first
served while their KV blocks (prompt plus ``max_tokens``, reserved whole so a running sequence never
runs out) and a running slot are free. The head of the queue is never overtaken, so a long request
is not starved by short ones behind it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One choice's sampling, as the API validated it."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; N: the chosen token's and the N likeliest
    return_routing: bool = False


@dataclass(eq=False)
class Seq:
    """One choice being generated: its tokens, its place in the KV pool and where its output goes."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Any], None]  # called on the scheduler thread with each event for this choice
    choice: int = 0
    deadline: float = math.inf  # time.monotonic() after which it is cut off
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    computed: int = 0  # positions whose keys and values are cached
    blocks: list[int] = field(default_factory=list)
    cancelled: bool = False  # set by the API when the client goes away; read at the next step
    arrived: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    generator: torch.Generator | None = None
    state: Any = None  # the engine's per-sequence text state

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def reserved_positions(self) -> int:
        return len(self.prompt) + self.params.max_tokens


@dataclass(frozen=True)
class Budget:
    """What one step may hold: sequences in the batch and tokens fed (decodes + prefill chunks)."""

    max_running: int
    max_step_tokens: int
    prefill_chunk: int

    def __post_init__(self) -> None:
        if min(self.max_running, self.max_step_tokens, self.prefill_chunk) < 1:
            raise ValueError(f"{self}: every limit must be >= 1")


@dataclass(frozen=True)
class Plan:
    """One step: the waiting sequences to admit (in order), and (sequence, tokens to feed) to run."""

    admit: list[Seq]
    chunks: list[tuple[Seq, int]]


def plan_step(running: Sequence[Seq], waiting: Sequence[Seq], free_blocks: int, block_size: int, b: Budget) -> Plan:
    """The next step's admissions and chunks; mutates nothing."""
    chunks: list[tuple[Seq, int]] = []
    left = b.max_step_tokens
    for seq in running:  # decodes first: one token each
        if seq.computed >= len(seq.prompt) and left > 0:
            chunks.append((seq, 1))
            left -= 1
    for seq in running:  # then the prompts under way
        if seq.computed < len(seq.prompt) and left > 0:
            n = min(b.prefill_chunk, len(seq.prompt) - seq.computed, left)
            chunks.append((seq, n))
            left -= n
    admit: list[Seq] = []
    for seq in waiting:
        need = -(-seq.reserved_positions // block_size)
        if left <= 0 or len(running) + len(admit) >= b.max_running or need > free_blocks:
            break
        free_blocks -= need
        admit.append(seq)
        n = min(b.prefill_chunk, len(seq.prompt), left)
        chunks.append((seq, n))
        left -= n
    return Plan(admit, chunks)
