"""Continuous batching as a pure function of the queues and the budgets: which waiting sequences join
the running batch this step, and how many of its tokens each scheduled sequence feeds.

Every step, in order: each running sequence past its prompt decodes one token (decodes are never
stalled); sequences still in their prompt prefill a chunk of it (at most ``prefill_chunk`` tokens,
within what is left of the step's token budget); then waiting sequences are admitted first come first
served while a running slot and the KV blocks of the tokens they hold now are free. The head of the
queue is never overtaken, so a long request is not starved by short ones behind it.

A decode that crosses into a new block and finds none free preempts (vLLM's recompute): the most
recently admitted running sequence gives all its blocks back and returns to the front of the queue
with its tokens, to be prefilled again (prompt and generated tokens) when readmitted. The oldest
running sequence is never preempted, so it always finishes. No sequence is admitted in a step that
preempts.
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
    def pending(self) -> int:
        """Tokens to feed before it samples again: 1 when decoding; a prompt, or after a preemption
        the prompt and generated tokens, to prefill."""
        return len(self.tokens) - self.computed


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
    """One step: the running sequences to preempt (newest first), the waiting sequences to admit (in
    order), and (sequence, tokens to feed) to run."""

    preempt: list[Seq]
    admit: list[Seq]
    chunks: list[tuple[Seq, int]]


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def plan_step(running: Sequence[Seq], waiting: Sequence[Seq], free_blocks: int, block_size: int, b: Budget) -> Plan:
    """The next step's preemptions, admissions and chunks; mutates nothing. A running sequence holds
    the blocks of the tokens it was admitted with and of every position computed since, so only a
    decode may need one more."""
    chunks: list[tuple[Seq, int]] = []
    left = b.max_step_tokens
    kept = list(running)
    preempt: list[Seq] = []
    for seq in running:  # decodes first: one token each, a block more where it crosses into one
        if seq in preempt or seq.pending != 1 or left <= 0:
            continue
        need = blocks_for(seq.computed + 1, block_size) - len(seq.blocks)
        while need > free_blocks and kept[-1] is not seq:
            victim = kept.pop()  # the newest (its decode, after this one's, is not planned yet)
            preempt.append(victim)
            free_blocks += len(victim.blocks)
        if need > free_blocks:  # it is the newest itself
            preempt.append(kept.pop())
            free_blocks += len(seq.blocks)
            continue
        free_blocks -= need
        chunks.append((seq, 1))
        left -= 1
    for seq in kept:  # then the prompts under way (their blocks are held since admission)
        if seq.pending > 1 and left > 0:
            n = min(b.prefill_chunk, seq.pending, left)
            chunks.append((seq, n))
            left -= n
    admit: list[Seq] = []
    for seq in waiting if not preempt else ():
        need = blocks_for(len(seq.tokens), block_size)
        if left <= 0 or len(running) + len(admit) >= b.max_running or need > free_blocks:
            break
        free_blocks -= need
        admit.append(seq)
        n = min(b.prefill_chunk, len(seq.tokens), left)
        chunks.append((seq, n))
        left -= n
    return Plan(preempt, admit, chunks)
