"""Continuous batching as a pure function of the queues and the budgets: which waiting sequences join
the running batch this step, and how many of its tokens each scheduled sequence feeds.

Every step, in order: each running sequence past its prompt decodes one token (decodes are never
stalled); sequences still in their prompt prefill a chunk of it (at most ``prefill_chunk`` tokens,
within what is left of the step's token budget); then waiting sequences are admitted first come first
served while a running slot and the KV blocks of the tokens they hold now are free. The head of the
queue is never overtaken, so a long request is not starved by short ones behind it.

The choices of one prompt (a request's ``n``) share it: the first prefills it holding the others
(``forks``), which join the batch when its prompt is cached, each holding the prompt's blocks too.
A block held by several sequences is copied when one of them first writes into it (only the prompt's
last, partly filled block ever is), so a decode into a shared block needs one block more. Admission
counts a prompt's blocks once and its running slots ``1 + len(forks)``.

A decode that crosses into a new block (or copies one) and finds none free preempts (vLLM's
recompute): the most recently admitted running sequence gives all its blocks back (those others
still hold stay theirs) and returns to the front of the queue with its tokens, to be prefilled again
(prompt and generated tokens) into blocks of its own when readmitted. The oldest running sequence is
never preempted, so it always finishes. No sequence is admitted in a step that preempts.
"""

from __future__ import annotations

import math
import time
from collections import Counter
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
    prompt_logprobs: bool = False  # each prompt token's too (echo with logprobs), with its ``logprobs`` likeliest
    min_tokens: int = 0  # end tokens and stop strings end the choice only from this many tokens on
    ignore_eos: bool = False  # the model's end tokens do not end the choice (``stop_token_ids`` still do)
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end this choice, besides the model's
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and the text so far
    presence_penalty: float = 0.0  # subtracted from each token generated at least once
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest (after the temperature)


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
    forks: list[Seq] = field(default_factory=list)  # choices of the same prompt, waiting for its prefill
    prompt_scores: list[Any] = field(default_factory=list)  # prompt tokens 1.. scored (``prompt_logprobs``)

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


def share_prompt(choices: list[Seq], max_running: int) -> list[Seq]:
    """``choices`` of one prompt as the sequences to queue: each prefills the prompt once for up to
    ``max_running - 1`` of the others, which it holds as ``forks``."""
    assert all(c.prompt == choices[0].prompt and not c.forks for c in choices), "choices of one prompt"
    firsts = choices[::max_running]
    for i, first in enumerate(firsts):
        first.forks = choices[i * max_running + 1 : (i + 1) * max_running]
    return firsts


def plan_step(
    running: Sequence[Seq],
    waiting: Sequence[Seq],
    free_blocks: int,
    block_size: int,
    b: Budget,
    refs: Sequence[int] | None = None,
) -> Plan:
    """The next step's preemptions, admissions and chunks; mutates nothing. A running sequence holds
    the blocks of the tokens it was admitted with and of every position computed since, so only a
    decode may need one more, or a copy of a block others hold too. ``refs``: each block's holders
    (None: no block is shared)."""
    dropped: Counter[int] = Counter()  # holds given up this step, by preemption or a copy on write

    def holders(block: int) -> int:
        return (1 if refs is None else refs[block]) - dropped[block]

    def release(seq: Seq) -> int:
        """Blocks freed when ``seq`` gives its holds back."""
        freed = sum(holders(block) == 1 for block in seq.blocks)
        dropped.update(seq.blocks)
        return freed

    chunks: list[tuple[Seq, int]] = []
    left = b.max_step_tokens
    kept = list(running)
    preempt: list[Seq] = []
    for seq in running:  # decodes first: one token each, a block more where it crosses into one
        if seq in preempt or seq.pending != 1 or left <= 0:
            continue
        need = blocks_for(seq.computed + 1, block_size) - len(seq.blocks)
        written = seq.computed // block_size
        copies = need == 0 and holders(seq.blocks[written]) > 1
        need += copies
        while need > free_blocks and kept[-1] is not seq:
            victim = kept.pop()  # the newest (its decode, after this one's, is not planned yet)
            preempt.append(victim)
            free_blocks += release(victim)
        if copies and holders(seq.blocks[written]) == 1:  # the preempted held it too: written in place
            need, copies = need - 1, False
        if need > free_blocks:  # it is the newest itself
            preempt.append(kept.pop())
            free_blocks += release(seq)
            continue
        if copies:
            dropped[seq.blocks[written]] += 1
        free_blocks -= need
        chunks.append((seq, 1))
        left -= 1
    for seq in kept:  # then the prompts under way (their blocks are held since admission)
        if seq.pending > 1 and left > 0:
            n = min(b.prefill_chunk, seq.pending, left)
            chunks.append((seq, n))
            left -= n
    admit: list[Seq] = []
    slots = b.max_running - sum(1 + len(seq.forks) for seq in running)
    for seq in waiting if not preempt else ():
        need = blocks_for(len(seq.tokens), block_size)
        if left <= 0 or 1 + len(seq.forks) > slots or need > free_blocks:
            break
        free_blocks -= need
        slots -= 1 + len(seq.forks)
        admit.append(seq)
        n = min(b.prefill_chunk, len(seq.tokens), left)
        chunks.append((seq, n))
        left -= n
    return Plan(preempt, admit, chunks)
