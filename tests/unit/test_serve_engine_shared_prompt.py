"""The choices of one prompt (``n > 1``) prefill it once and share its KV blocks: their tokens equal
``generate``'s (greedy, and seeded with seed + j) and the same choices submitted one by one; the pool
holds the prompt once; every block comes back after completion, cancellation and preemption."""

from __future__ import annotations

import pytest
import torch

from moekit.infer.generate import generate
from moekit.run.load import LoadedRun, load_run
from moekit.serve.engine import Engine, EngineOptions, Finish, Token
from moekit.serve.kv import KVPool
from moekit.serve.scheduler import Budget, SamplingParams, Seq, plan_step

PROMPT = list(b"the king and queen wal")  # 22 tokens: 5 full blocks of 4 and 2 positions of a sixth


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, write_run) -> LoadedRun:
    return load_run(write_run(tmp_path_factory.mktemp("shared") / "run", **{"model.tie_embeddings": "false"}))


def engine_of(run: LoadedRun, blocks: int = 64, prefill_chunk: int = 32) -> Engine:
    per_block = KVPool.bytes_per_block(run.model.cfg, 4, torch.float32)
    return Engine(run, EngineOptions(kv_budget=blocks * per_block, block_size=4, prefill_chunk=prefill_chunk))


def choices(params: list[SamplingParams], events: list, prompt: list[int] = PROMPT) -> list[Seq]:
    return [Seq(prompt, p, events.append, choice=j) for j, p in enumerate(params)]


def step(engine: Engine) -> None:
    """One step of the engine thread's loop (the queue taken in, then the step)."""
    engine.waiting.extend(engine._inbox)
    engine._inbox.clear()
    engine.step()


def drain(engine: Engine) -> None:
    while engine.running or engine.waiting or engine._inbox:
        step(engine)


def tokens_of(events: list, choice: int) -> list[int]:
    return [e.token for e in events if isinstance(e, Token) and e.choice == choice]


def used(engine: Engine) -> int:
    return engine.pool.num_blocks - engine.pool.free_blocks


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_n_choices_equal_generate_and_single_requests(run: LoadedRun, temperature: float) -> None:
    """n = 3 in one submit: choice j equals ``generate`` with seed 11 + j, and the three submitted as
    separate requests (each prefilling the prompt itself), token for token and in the log-probability
    of each (which sees any key or value written into another choice's block); the prompt is fed once,
    not three times."""
    params = [SamplingParams(9, temperature, seed=11 + j, logprobs=0) for j in range(3)]
    shared, alone = engine_of(run), engine_of(run)
    events: list = []
    shared.submit(choices(params, events))
    drain(shared)
    separate: list = []
    for seq in choices(params, separate):
        alone.submit([seq])
    drain(alone)
    ids = torch.tensor([PROMPT])
    for j in range(3):
        want = generate(run.model, ids, 9, temperature, None, 1.0, 11 + j)[0, len(PROMPT) :].tolist()
        assert tokens_of(events, j) == tokens_of(separate, j) == want
        logprobs = [
            [e.logprobs.logprob for e in got if isinstance(e, Token) and e.choice == j] for got in (events, separate)
        ]
        torch.testing.assert_close(*logprobs, rtol=0, atol=1e-5)
    assert sorted(e.choice for e in events if isinstance(e, Finish)) == [0, 1, 2]
    fed = [
        int(e.expert_load[0].sum()) // run.model.moe_layers()[0].cfg.top_k for e in (shared, alone)
    ]  # tokens through the model
    assert fed == [22 + 3 * 8, 3 * 22 + 3 * 8]  # the prompt once, against once per choice
    assert shared.pool.free_blocks == shared.pool.num_blocks and shared.in_flight == (0, 0)


def test_the_pool_holds_the_prompt_once(run: LoadedRun) -> None:
    """22 prompt tokens in blocks of 4, n = 4: 6 blocks after the prefill (the last one shared too),
    5 + 4 once each choice has written its first token into its own copy of the partly filled block
    (20+ if each stored the prompt); a cancelled choice gives back only its copy; at the end, all."""
    engine = engine_of(run)
    events: list = []
    seqs = choices([SamplingParams(8, 0.9, seed=j) for j in range(4)], events)
    engine.submit(seqs)
    assert engine.in_flight == (0, 4)
    step(engine)  # the prefill: every choice samples its first token from it
    assert used(engine) == 6 and [len(tokens_of(events, j)) for j in range(4)] == [1] * 4
    assert engine.in_flight == (4, 0) and [engine.pool.refs[b] for b in seqs[0].blocks] == [4] * 6
    step(engine)
    assert used(engine) == 5 + 4 and len({s.blocks[5] for s in seqs}) == 4
    assert all(s.blocks[:5] == seqs[0].blocks[:5] for s in seqs)
    seqs[1].cancelled = True
    step(engine)
    assert used(engine) == 5 + 3 and [engine.pool.refs[b] for b in seqs[0].blocks[:5]] == [3] * 5
    drain(engine)
    assert engine.pool.free_blocks == engine.pool.num_blocks and engine.pool.refs == [0] * engine.pool.num_blocks
    assert [e.reason for e in events if isinstance(e, Finish)] == ["cancelled", "length", "length", "length"]


def test_cancelled_while_prefilling_ends_every_choice(run: LoadedRun) -> None:
    """A request cancelled while its prompt is still being prefilled (chunks of 8): the choices waiting
    for the prompt end with it, and every block comes back."""
    engine = engine_of(run, prefill_chunk=8)
    events: list = []
    seqs = choices([SamplingParams(8, 0.0)] * 3, events)
    engine.submit(seqs)
    step(engine)
    assert used(engine) == 6 and engine.in_flight == (1, 2)
    for seq in seqs:
        seq.cancelled = True
    step(engine)
    assert sorted((e.choice, e.reason) for e in events) == [(0, "cancelled"), (1, "cancelled"), (2, "cancelled")]
    assert engine.pool.free_blocks == engine.pool.num_blocks and engine.in_flight == (0, 0)


def test_more_choices_than_running_slots_and_choices_that_end_at_once(run: LoadedRun) -> None:
    """n = 5 with two running slots: the prompt is prefilled once per two choices (groups of 2, 2, 1),
    and the tokens still equal ``generate``'s; n = 3 of one token each end at the prefill, blocks back."""
    per_block = KVPool.bytes_per_block(run.model.cfg, 4, torch.float32)
    engine = Engine(run, EngineOptions(kv_budget=64 * per_block, block_size=4, max_running=2))
    events: list = []
    engine.submit(choices([SamplingParams(5, 0.9, seed=j) for j in range(5)], events))
    assert [len(s.forks) for s in engine._inbox] == [1, 1, 0]
    drain(engine)
    for j in range(5):
        assert (
            tokens_of(events, j) == generate(run.model, torch.tensor([PROMPT]), 5, 0.9, None, 1.0, j)[0, 22:].tolist()
        )
    events.clear()
    engine.submit(choices([SamplingParams(1, 0.9, seed=j) for j in range(3)], events))
    step(engine)  # the first two: prefilled, sampled and ended in one step
    assert engine.in_flight == (0, 1) and used(engine) == 0
    drain(engine)
    assert [(e.choice, e.reason) for e in events if isinstance(e, Finish)] == [
        (0, "length"),
        (1, "length"),
        (2, "length"),
    ]
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_preempted_choice_leaves_the_shared_blocks_to_the_others(run: LoadedRun) -> None:
    """A pool of one context (12 blocks of 4) for n = 3 choices of 22 + 14 positions: the newest
    choices are preempted and recomputed in blocks of their own while the others go on over the shared
    prompt; every choice still equals ``generate``'s, and every block comes back."""
    engine = engine_of(run, blocks=12)
    events: list = []
    params = [SamplingParams(14, 0.8, seed=5 + j) for j in range(3)]
    engine.submit(choices(params, events))
    drain(engine)
    ids = torch.tensor([PROMPT])
    for j in range(3):
        assert tokens_of(events, j) == generate(run.model, ids, 14, 0.8, None, 1.0, 5 + j)[0, 22:].tolist()
    assert engine.preemptions > 0
    assert engine.pool.free_blocks == engine.pool.num_blocks and engine.pool.refs == [0] * 12


def test_plan_copies_a_shared_block_once_and_frees_only_unshared_blocks() -> None:
    """The plan as a pure function of the blocks' holders: two choices decoding into their shared last
    block need one copy between them (the last writes in place); preempting a sharer frees only what
    nobody else holds, so a decode that needs a block preempts both."""
    a = Seq([1] * 6, SamplingParams(4), lambda e: None)
    b = Seq([1] * 6, SamplingParams(4), lambda e: None)
    for s in (a, b):
        s.tokens.append(0)
        s.computed, s.blocks = 6, [0, 1]  # 6 positions in blocks of 4: block 1 is half full, shared
    refs = [2, 2, 0]
    plan = plan_step([a, b], [], free_blocks=1, block_size=4, b=Budget(8, 64, 64), refs=refs)
    assert plan.chunks == [(a, 1), (b, 1)] and plan.preempt == []
    plan = plan_step([a, b], [], free_blocks=0, block_size=4, b=Budget(8, 64, 64), refs=refs)
    assert plan.preempt == [b] and plan.chunks == [(a, 1)]  # b gone, a writes in place: no copy
    d = Seq([1] * 4, SamplingParams(4), lambda e: None)
    d.tokens.append(0)
    d.computed, d.blocks = 4, [2]  # older, its own block full: its decode needs a new one
    plan = plan_step([d, a, b], [], free_blocks=0, block_size=4, b=Budget(8, 64, 64), refs=[2, 2, 1])
    assert plan.preempt == [b, a] and plan.chunks == [(d, 1)]  # b alone frees nothing a still holds


def test_sharers_preempted_beside_another_request_in_a_tight_pool(run: LoadedRun) -> None:
    """A 12-block pool: a 24-token request and an n = 3 request whose 22-token prompt shares 6 blocks;
    decoding 20 tokens each forces preemptions, which must count blocks other sharers still hold as
    not freed (counting them freed plans decodes that do not fit). Every sequence equals ``generate``
    and the pool comes back whole."""
    engine, events = engine_of(run, blocks=12), []
    other = list(b"abcdefghijklmnopqrstuvwx")  # 24 tokens: 6 full blocks
    engine.submit([Seq(other, SamplingParams(20, 0.7, seed=99), events.append, choice=9)])
    engine.submit(choices([SamplingParams(20, 0.8, seed=5 + j) for j in range(3)], events))
    drain(engine)
    assert engine.preemptions > 0
    for j in range(3):
        want = generate(run.model, torch.tensor([PROMPT]), 20, 0.8, None, 1.0, 5 + j)[0, len(PROMPT) :].tolist()
        assert tokens_of(events, j) == want, j
    want = generate(run.model, torch.tensor([other]), 20, 0.7, None, 1.0, 99)[0, len(other) :].tolist()
    assert tokens_of(events, 9) == want
    assert used(engine) == 0
