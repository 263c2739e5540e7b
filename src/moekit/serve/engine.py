"""The model runner: one thread steps the running batch through the model, as ``plan_step`` says, and
hands each choice its tokens as events. The API only queues sequences and forwards events.

Each step packs every scheduled sequence's new tokens into one row, so with offloaded experts one
read of an expert serves every active sequence in that layer.

Legend: T tokens this step, R sequences that sample this step, V vocabulary.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import threading
import time
import traceback
from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.errors import OptionError
from moekit.experts.matmul import single_token_kernels
from moekit.hostmem import available_memory
from moekit.infer.token_step import takes, token_step
from moekit.run.load import LoadedRun
from moekit.serve.kv import Chunk, KVPool, PagedStep
from moekit.serve.sampling import TopLogprobs, sample_rows, top_logprobs
from moekit.serve.scheduler import Budget, Seq, plan_step, share_prompt
from moekit.serve.text import TextStream


@dataclass(frozen=True)
class EngineOptions:
    """The serving budgets; each a flag of ``moekit serve``."""

    kv_budget: int = 256 << 20  # bytes of the paged KV cache: bounds the tokens in flight
    block_size: int = 16  # positions per KV block
    max_running: int = 64  # sequences decoding together
    prefill_chunk: int = 128  # prompt tokens one sequence feeds per step (long prompts take several)
    prefill_tokens: int = 1024  # prompt tokens all sequences feed per step, on top of the decodes: a
    # burst of short prompts joins in a step or two, while one long prompt still feeds prefill_chunk
    max_queue: int = 256  # choices waiting for admission; more get 429

    @property
    def budget(self) -> Budget:
        """Each step: every running sequence's decode, and up to ``prefill_tokens`` prompt tokens."""
        return Budget(self.max_running, self.max_running + self.prefill_tokens, self.prefill_chunk)


@dataclass(frozen=True)
class Token:
    """A choice's next token and the text it releases (maybe empty: held back)."""

    choice: int
    token: int
    text: str
    offset: int  # where this token's text begins in the choice's text (in characters)
    logprobs: TopLogprobs | None
    routing: list[list[int]] | None  # per MoE layer, the experts that computed this token's logits


@dataclass(frozen=True)
class PromptLogprobs:
    """Each prompt token's log-probability after the ones before it (the first has none), sent
    before a choice's first token when its request echoes the prompt with logprobs."""

    choice: int
    scores: list[TopLogprobs]  # prompt tokens 1..


@dataclass(frozen=True)
class Finish:
    """A choice is over: ``reason`` is stop | length | cancelled | timeout | error."""

    choice: int
    reason: str
    text: str  # the text still held back, released now
    prompt_tokens: int
    completion_tokens: int
    message: str = ""
    stop_reason: str | int | None = None  # the stop string or stop_token_ids token that ended it (vLLM's)


class StepAborted(Exception):
    """A model step given up between two layers: the engine is stopping at once."""


class QueueFull(RuntimeError):
    """More choices are waiting than ``EngineOptions.max_queue``."""


class Engine:
    """Continuous batching over one loaded run, on a thread of its own (``start`` / ``stop``)."""

    def __init__(self, run: LoadedRun, options: EngineOptions, metrics=None, stop_tokens: frozenset[int] = frozenset()):
        self.run, self.options, self.metrics = run, options, metrics
        self.stop_tokens = stop_tokens
        model = run.model.eval()
        self.device = model.embed.weight.device
        dtype = model.embed.weight.dtype
        bs = options.block_size
        per_block = KVPool.bytes_per_block(model.cfg, bs, dtype)
        num_blocks = options.kv_budget // per_block
        context = model.cfg.context_length
        if num_blocks * bs < context:
            need = -(-context // bs) * per_block
            raise OptionError(
                "kv_budget",
                f"holds {num_blocks * bs} positions, less than one context of {context}: give at least {need} bytes",
                options.kv_budget,
            )
        pool_bytes = num_blocks * per_block
        available = available_memory() if self.device.type == "cpu" else None
        if available is not None and pool_bytes > available:
            # NOTE: writing a pool beyond memory gets the process killed by the OS, with no word of why.
            raise OptionError(
                "kv_budget",
                f"needs {pool_bytes} bytes, more than the {available} this machine has available",
                options.kv_budget,
            )
        self.pool = KVPool(model.cfg, num_blocks, bs, self.device, dtype)
        self.budget = options.budget
        self.running: list[Seq] = []
        self.waiting: collections.deque[Seq] = collections.deque()
        self._inbox: list[Seq] = []
        self._forks_waiting = 0  # choices held by a sequence prefilling their prompt (under _cond)
        self._cond = threading.Condition()
        self._stopping = False
        self._abort = False  # stop between two layers of the step under way (read by a hook per block)
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what ended the engine thread, if it was not ``stop``
        self.steps = 0
        self.preemptions = 0  # running sequences sent back to the queue for want of KV blocks
        # Seconds of the engine thread by phase since the start (read by /metrics): where a step goes.
        self.seconds = dict.fromkeys(("schedule", "forward", "emit", "idle"), 0.0)
        # Tokens routed to each expert, per MoE layer, since the start (read by /metrics).
        self.moe_layers = model.moe_layers()
        # One buffer, a view of it per layer: a step adds every layer's counts in one op.
        self._load = torch.zeros(sum(moe.cfg.num_experts for moe in self.moe_layers), dtype=torch.long)
        self.expert_load = list(self._load.split([moe.cfg.num_experts for moe in self.moe_layers]))
        self._routing: list = [None] * len(self.expert_load)

    # --- the API's side (any thread) -----------------------------------------------------------

    def submit(self, seqs: list[Seq]) -> None:
        """Queue a request's choices (all or none: ``QueueFull``). Consecutive choices of one prompt
        (a request's ``n``) share its prefill and its KV blocks (``share_prompt``)."""
        queued = [
            first
            for _, choices in itertools.groupby(seqs, key=lambda seq: seq.prompt)
            for first in share_prompt(list(choices), self.options.max_running)
        ]
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            waiting = self.in_flight[1]
            if waiting + len(seqs) > self.options.max_queue:
                raise QueueFull(f"{waiting} choices are waiting already")
            self._inbox += queued
            self._forks_waiting += len(seqs) - len(queued)
            self._cond.notify()

    @property
    def in_flight(self) -> tuple[int, int]:
        """(running, waiting) choices."""
        return len(self.running), len(self.waiting) + len(self._inbox) + self._forks_waiting

    @property
    def thread_id(self) -> int | None:
        """The engine thread's id in the kernel (``None`` before ``start``): /metrics reads its CPU time."""
        return None if self._thread is None else self._thread.native_id

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="moekit-engine", daemon=True)
        self._thread.start()

    def stop(self, abort: bool = False, timeout: float | None = None) -> bool:
        """End the thread after its step under way, or (``abort``) between two layers of it; every choice
        still in flight ends "cancelled". False if the thread still runs after ``timeout`` seconds."""
        with self._cond:
            self._stopping = True
            self._abort = self._abort or abort
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    # --- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        hooks = [block.register_forward_pre_hook(self._abort_between_layers) for block in self.run.model.blocks]
        try:
            self._loop()
        except BaseException as err:  # kept for the server's exit code, then reported as any thread's
            self.failure = err
            raise
        finally:
            for hook in hooks:
                hook.remove()

    def _abort_between_layers(self, module, args) -> None:
        if self._abort:
            raise StepAborted

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self.running or self.waiting):
                    self._cond.wait()
                if self._stopping:
                    break
                self.waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                stepped = self.step()
            except StepAborted:
                break
            except Exception:  # a failed step fails its sequences, not the server
                message = traceback.format_exc(limit=1).strip().splitlines()[-1]
                for seq in [*self.running, *self.waiting]:
                    self._finish(seq, "error", message)
                stepped = True
            if not stepped:
                t = time.perf_counter()
                with self._cond:
                    self._cond.wait(0.01)
                self.seconds["idle"] += time.perf_counter() - t
        for seq in [*self.running, *self.waiting, *self._inbox]:
            self._finish(seq, "cancelled", "the server stopped")

    # NOTE: in inference mode, its ops without autograd's dispatch: d1024 bf16, in one process taking
    # turns (ad hoc), 8.97 ms a step against 9.81 under no_grad at 1 sequence, 36.5 against 38.1 at 16,
    # 54.8 against 58.6 at 64. The KV pool, made outside it, is written in place inside, as allowed.
    @torch.inference_mode()
    def step(self) -> bool:
        """Retire cancelled and late sequences, admit, run one step and sample; False if nothing ran."""
        t0 = time.perf_counter()
        now = time.monotonic()
        for seq in [*self.running, *self.waiting]:
            if seq.cancelled or now > seq.deadline:
                self._finish(seq, "cancelled" if seq.cancelled else "timeout", "")
        pool = self.pool
        plan = plan_step(self.running, self.waiting, pool.free_blocks, pool.block_size, self.budget, pool.refs)
        for seq in plan.preempt:  # newest first: the oldest of them ends up at the front of the queue
            self.running.remove(seq)
            self.pool.release(seq.blocks)
            seq.blocks, seq.computed = [], 0
            self.waiting.appendleft(seq)
        self.preemptions += len(plan.preempt)
        for seq in plan.admit:
            assert self.waiting[0] is seq, "admission is first come first served"
            self.waiting.popleft()
            blocks = self.pool.allocate(self.pool.blocks_for(len(seq.tokens)))
            assert blocks is not None, "plan_step admits only what fits"
            seq.blocks = blocks
            self._begin(seq)
            self.running.append(seq)
        if not plan.chunks:
            return False
        for seq, n in plan.chunks:
            self._make_room(seq, n)
        ids: list[int] = []
        starts: list[int] = []  # packed index of each chunk's first token
        sampling: list[tuple[int, Seq]] = []  # (packed index of its last token, sequence)
        for seq, n in plan.chunks:
            starts.append(len(ids))
            ids += seq.tokens[seq.computed : seq.computed + n]
            if seq.computed + n == len(seq.tokens):  # its forks sample from the same logits
                sampling += [(len(ids) - 1, s) for s in (seq, *self._fork(seq, seq.computed + n))]
        step = PagedStep(self.pool, [Chunk(s.blocks, s.computed, n) for s, n in plan.chunks], self.device)
        # the output head projects only the positions scored (prompt_logprobs) and sampled from, in that order
        scoring = self._prompt_scoring(plan.chunks, starts)
        projected = [i for i, _, _ in scoring] + [i for i, _ in sampling]
        at = torch.tensor(projected, dtype=torch.long, device=self.device)
        hooks = []
        if any(seq.params.return_routing for _, seq in sampling):  # hooks only on the steps that record
            hooks = [moe.router.register_forward_hook(self._keep_routing(i)) for i, moe in enumerate(self.moe_layers)]
        t1 = time.perf_counter()
        try:
            one_token = len(ids) == 1 and len(sampling) == 1 and not scoring and not hooks
            logits, loads = self._forward(ids, step, at, one_token)
        finally:
            for hook in hooks:
                hook.remove()
        if scoring:
            self._score_prompts(scoring, logits[: len(scoring)])
        for seq, n in plan.chunks:
            seq.computed += n
        if loads:
            assert len(loads) == len(self.expert_load), "a routing count per MoE layer"
            self._load += torch.cat(loads).cpu()
        self.steps += 1
        t2 = time.perf_counter()
        if sampling:
            self._emit(sampling, logits[len(scoring) :])
        self._account(t0, t1, t2)
        return True

    def _forward(self, ids: list[int], step: PagedStep, at: Tensor, one_token: bool) -> tuple[Tensor, list[Tensor]]:
        """The logits of the positions ``at`` ``[P, V]`` and each MoE layer's tokens per expert. A step of
        ``one_token`` (one sequence's, sampled from, nothing scored or recorded) takes ``token_step``
        where it computes what the model does (``takes``)."""
        model, tokens = self.run.model, torch.tensor([ids], device=self.device)
        with single_token_kernels(len(ids)):
            if one_token and takes(model, tokens):
                loads: list[Tensor] = []
                return token_step(model, tokens, step, loads), loads
            out = model(tokens, cache=step, logits_at=at)
        return out.logits[0], [stats.tokens_per_expert for stats in out.moe_stats]

    def _begin(self, seq: Seq) -> None:
        """A choice's text state and sampling generator, on its first admission (a preempted choice
        coming back keeps its own: its text and sampling go on)."""
        if seq.state is None:
            seq.state = TextStream(self.run.tokenizer, seq.params.stop)
            seed = seq.params.seed if seq.params.seed is not None else secrets.randbits(63)
            seq.generator = torch.Generator().manual_seed(seed) if seq.params.temperature > 0 else None

    def _make_room(self, seq: Seq, n: int) -> None:
        """Blocks for ``seq``'s next ``n`` positions: new ones past its last, and a copy of the block
        it writes into when others hold that block too (only a fork's decode can find one, in its
        prompt's last block: every position before ``computed`` is written already)."""
        P = self.pool.block_size
        written = seq.computed // P
        if written < len(seq.blocks) and self.pool.refs[seq.blocks[written]] > 1:
            assert n == 1, "only decodes write into shared blocks"
            copy = self.pool.allocate(1)
            assert copy is not None, "plan_step preempts until the copies fit"
            self.pool.copy(seq.blocks[written], copy[0])
            self.pool.release([seq.blocks[written]])
            seq.blocks[written] = copy[0]
        missing = self.pool.blocks_for(seq.computed + n) - len(seq.blocks)
        if missing > 0:  # a decode crossing into a new block
            grown = self.pool.allocate(missing)
            assert grown is not None, "plan_step preempts until the decodes fit"
            seq.blocks += grown

    def _fork(self, seq: Seq, computed: int) -> list[Seq]:
        """``seq``'s forks, as this step caches their prompt (``computed`` positions): each holds the
        prompt's blocks and joins the batch, to sample from the same logits as ``seq``."""
        forks = self._take_forks(seq)
        for fork in forks:
            fork.blocks, fork.computed = self.pool.share(seq.blocks), computed
            fork.prompt_scores = seq.prompt_scores  # the same prompt, scored as it is prefilled
            self._begin(fork)
            self.running.append(fork)
        return forks

    def _take_forks(self, seq: Seq) -> list[Seq]:
        """``seq``'s forks, no longer waiting on it (they join the batch, or end with it)."""
        forks, seq.forks = seq.forks, []
        with self._cond:
            self._forks_waiting -= len(forks)
        return forks

    def _account(self, t0: float, t1: float, t2: float) -> None:
        self.seconds["schedule"] += t1 - t0
        self.seconds["forward"] += t2 - t1
        self.seconds["emit"] += time.perf_counter() - t2

    @staticmethod
    def _prompt_scoring(chunks: list[tuple[Seq, int]], starts: list[int]) -> list[tuple[int, Seq, int]]:
        """The prompt tokens this step's chunks let it score (``prompt_logprobs``), as (packed position
        whose logits score it, its sequence, the token): position i's logits give token i + 1's. A
        sequence prefilled again after a preemption keeps its first scores."""
        out = []
        for (seq, n), start in zip(chunks, starts, strict=True):
            if not seq.params.prompt_logprobs:
                continue
            scored, end = len(seq.prompt_scores), min(seq.computed + n, len(seq.prompt) - 1)
            out += [(start + i - seq.computed, seq, seq.prompt[i + 1]) for i in range(max(seq.computed, scored), end)]
        return out

    @staticmethod
    def _score_prompts(scoring: list[tuple[int, Seq, int]], logits_RV: Tensor) -> None:
        """Each scored prompt token's logprob (and its ``logprobs`` likeliest) from its row of ``logits``."""
        owners = [seq for _, seq, _ in scoring]
        targets = torch.tensor([token for _, _, token in scoring], device=logits_RV.device)
        scores = top_logprobs(logits_RV, targets, [seq.params.logprobs or 0 for seq in owners])
        for seq, score in zip(owners, scores, strict=True):
            seq.prompt_scores.append(score)

    def _ends(self, seq: Seq) -> frozenset[int]:
        """The tokens that end ``seq``: the model's (unless ``ignore_eos``) and its ``stop_token_ids``."""
        p = seq.params
        return p.stop_token_ids if p.ignore_eos else self.stop_tokens | p.stop_token_ids

    def _emit(self, sampling: list[tuple[int, Seq]], logits_RV: Tensor) -> None:
        seqs = [seq for _, seq in sampling]
        ends = [self._ends(seq) for seq in seqs]
        tokens = sample_rows(seqs, logits_RV, ends)
        wanted = [r for r, seq in enumerate(seqs) if seq.params.logprobs is not None]
        counts = [seqs[r].params.logprobs for r in wanted]
        logprobs = top_logprobs(logits_RV[wanted], tokens[wanted], counts) if wanted else []  # no empty indexing
        logprobs_of = dict(zip(wanted, logprobs, strict=True))
        now = time.monotonic()
        for r, ((index, seq), token) in enumerate(zip(sampling, tokens.tolist(), strict=True)):
            p = seq.params
            if p.prompt_logprobs and seq.generated == 0:
                seq.emit(PromptLogprobs(seq.choice, list(seq.prompt_scores)))
            seq.tokens.append(token)
            if token in ends[r]:  # it ends the choice: its text is not part of the answer, what was held back is
                offset, text, stopped = len(seq.state.text), seq.state.flush(), True
                stop_reason = token if token in p.stop_token_ids else None  # None: the model's end (vLLM's)
            else:
                text, stop_reason = seq.state.add(token, check_stops=seq.generated >= p.min_tokens)
                offset, stopped = seq.state.offset, stop_reason is not None
            routing = self._routing_of(index) if p.return_routing else None
            seq.emit(Token(seq.choice, token, text, offset, logprobs_of.get(r), routing))
            if self.metrics is not None:
                self.metrics.token(now - (seq.last_token_at or seq.arrived), first=seq.last_token_at is None)
            seq.last_token_at = now
            if stopped:
                self._finish(seq, "stop", "", stop_reason)
            elif seq.generated >= p.max_tokens:
                self._finish(seq, "length", "")

    def _finish(self, seq: Seq, reason: str, message: str, stop_reason: str | int | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.pool.release(seq.blocks)
            seq.blocks = []
        elif seq in self.waiting:
            self.waiting.remove(seq)
        for fork in self._take_forks(seq):  # they end with it: a request's choices end together
            self._finish(fork, reason, message)
        text = seq.state.flush() if reason == "length" and seq.state is not None else ""
        seq.emit(Finish(seq.choice, reason, text, len(seq.prompt), seq.generated, message, stop_reason))
        if self.metrics is not None:
            self.metrics.finished(reason, len(seq.prompt), seq.generated)

    # --- routing traces --------------------------------------------------------------------------

    def _keep_routing(self, layer: int):
        def hook(module, args, output) -> None:
            self._routing[layer] = output

        return hook

    def _routing_of(self, index: int) -> list[list[int]]:
        """Per MoE layer, the experts the token at packed position ``index`` was routed to."""
        return [out.expert_idx[out.token_idx == index].tolist() for out in self._routing]
