"""The parts under the API: the paged KV cache against the contiguous one, the scheduler's plan as a
pure function, stop strings over split text, and an offloaded model batched through each layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moekit import runconfig
from moekit.infer.generate import generate
from moekit.infer.offload import OffloadOptions
from moekit.infer.token_step import takes, token_step
from moekit.model import Transformer
from moekit.run.load import load_run
from moekit.serve.kv import Chunk, KVPool, PagedStep
from moekit.serve.scheduler import Budget, SamplingParams, Seq, plan_step
from moekit.serve.text import TextStream
from moekit.tokenizer import ByteTokenizer

GQA = {"model.n_heads": "4", "model.n_kv_heads": "2"}
MLA = {"model.attention": "mla", "model.n_heads": "2", "model.d_model": "32", "model.q_lora_rank": "8"}
WINDOW = {**GQA, "model.sliding_window": "3", "model.full_attention_every": "2", "model.attn_sinks": "true"}


@pytest.mark.parametrize("attention", [GQA, MLA, WINDOW], ids=["gqa", "mla", "window"])
def test_paged_steps_of_mixed_chunks_equal_whole_sequences(attention: dict[str, str]) -> None:
    """Three sequences fed in chunks of different sizes, decode beside prefill: every position's logits
    equal the model run on the whole sequence at once (reference: no cache), to fp32 rounding. One-token
    sequences attend in a group of their own (queries not padded to a chunk's length), wherever they
    are packed. MLA's blocks hold its latents alone (kv_lora_rank + qk_rope_head_dim per position), its
    later chunks attend in the absorbed form."""
    cfg = runconfig.resolve("tiny", {**attention, "model.context_length": "48"})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    pool = KVPool(cfg.model, 12, 4, torch.device("cpu"), torch.float32)
    if cfg.model.attention == "mla":
        assert pool.keys[0].shape == (1, 12 * 4, cfg.model.kv_lora_rank + cfg.model.qk_rope_head_dim)
        assert pool.values[0].numel() == 0
    seqs = [torch.randint(0, 256, (n,)) for n in (14, 9, 6)]
    tables = [pool.allocate(4), pool.allocate(3), pool.allocate(2)]
    # (seq, start, tokens): prompt chunks, a chunk before a one-token sequence (its group's tokens after
    # the other's), one-token sequences around a first chunk (MLA: a fresh group beside one that is not)
    steps = [[(0, 0, 5), (1, 0, 7)], [(0, 5, 8), (1, 7, 1)], [(1, 8, 1), (2, 0, 6), (0, 13, 1)]]
    queries_padded_to = [[7], [1, 8], [1, 6]]  # per group of each step
    with torch.no_grad():
        for step, padded in zip(steps, queries_padded_to, strict=True):
            chunks = [Chunk(tables[s], start, n) for s, start, n in step]
            ids = torch.cat([seqs[s][start : start + n] for s, start, n in step])
            paged = PagedStep(pool, chunks, torch.device("cpu"))
            assert [group.shape[1] for group in paged.groups] == padded
            logits = model(ids[None], cache=paged).logits[0]
            at = 0
            for s, start, n in step:
                whole = model(seqs[s][None, : start + n]).logits[0, start:]
                torch.testing.assert_close(logits[at : at + n], whole, rtol=0, atol=1e-5)
                at += n


def test_steps_gather_into_the_pools_two_buffers_and_refuse_autograd() -> None:
    """The pool's two buffers for a step's gathered keys and values (a fresh tensor each layer pays page
    faults past 32 MB): the same memory while steps fit in it, made 1.5x a step's need when one needs
    more or under a quarter; normal tensors even when first made in inference mode. A buffer autograd
    would save for its backward is overwritten by the next layer: a step recording a graph is refused."""
    cfg = runconfig.resolve("tiny", {**GQA, "model.context_length": "48"})
    pool = KVPool(cfg.model, 12, 4, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        pool.fit_gathered(0, 40)
    first = pool.gathered(0, (4, 10))
    pool.fit_gathered(0, 40)
    assert not first.is_inference() and pool.gathered(0, (10, 4)).data_ptr() == first.data_ptr()
    pool.fit_gathered(0, 100)
    grown = pool.gathered(0, (10, 10))
    pool.fit_gathered(0, 42)
    assert pool.gathered(0, (6, 7)).data_ptr() == grown.data_ptr() and pool.gathered(0, (150,)).numel() == 150
    pool.fit_gathered(0, 12)  # under a quarter of 150
    assert pool.gathered(0, (3, 4)).data_ptr() != grown.data_ptr()
    pool.fit_gathered(1, 12)
    pool.gathered(1, (3, 4)).fill_(1.0)
    assert not bool((pool.gathered(0, (3, 4)) == 1).all())  # keys and values apart
    model = Transformer(cfg.model, cfg.moe).eval()
    step = PagedStep(pool, [Chunk(pool.allocate(2), 0, 5)], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        model(torch.randint(0, 256, (1, 5)), cache=step)
    # only the queries need grad: the second layer's gather overwrites the keys the first one saved
    pool = KVPool(cfg.model, 12, 4, torch.device("cpu"), torch.float32)
    step = PagedStep(pool, [Chunk(pool.allocate(2), 0, 5)], torch.device("cpu"))
    q = torch.randn(1, cfg.model.n_heads, 5, cfg.model.head_size, requires_grad=True)
    k, v = (torch.randn(1, cfg.model.kv_heads, 5, cfg.model.head_size) for _ in range(2))
    first = step.attend(0, q, k, v)
    step.attend(1, q, k, v)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        first.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_attention_over_the_pool_equals_the_written_out_softmax(dtype, monkeypatch) -> None:
    """Three sequences at different positions, blocks scattered over the pool, decoding at once: each
    query head's output equals the float64 softmax over its own sequence's cached keys (written out from
    the pool's rows, block by block), with the step's keys converted two sequences at a time (bf16) and
    in the gathered layout as it is (fp32); the gathered keys land in the pool's buffer. Tolerance: fp32
    1e-5; bf16 one ulp of the largest output."""
    from moekit.model import sdpa

    cfg = runconfig.resolve("tiny", {**GQA, "model.context_length": "48"}).model
    G, d, H, P = cfg.kv_heads, cfg.head_size, cfg.n_heads, 4
    monkeypatch.setattr(sdpa, "CONVERTED_BYTES", 2 * G * 4 * P * d * 4)  # two sequences of 4 blocks, in fp32
    pool = KVPool(cfg, 16, P, torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(0)
    for t in (*pool.keys, *pool.values):
        t.copy_(torch.randn(t.shape, generator=gen))
    tables, starts = [[9, 2, 14, 5], [0, 11], [7, 3, 12]], [13, 5, 10]
    step = PagedStep(pool, [Chunk(b, s, 1) for b, s in zip(tables, starts, strict=True)], torch.device("cpu"))
    q = (3 * torch.randn(1, H, 3, d, generator=gen)).to(dtype)
    k_new, v_new = (torch.randn(1, G, 3, d, generator=gen).to(dtype) for _ in range(2))
    with torch.inference_mode():
        got = step.attend(0, q, k_new, v_new)  # [1, H, 3, d]
    gathered = pool.gathered(0, (G, 3, 4 * P, d))  # the step's 4 blocks a sequence, as it gathered them
    for b, (blocks, start) in enumerate(zip(tables, starts, strict=True)):
        rows = [blocks[p // P] * P + p % P for p in range(start + 1)]  # positions 0..start, the new one last
        assert torch.equal(gathered[:, b, : start + 1], pool.keys[0][:, rows])
        for h in range(H):
            g = h // (H // G)
            keys, values = pool.keys[0][g, rows].double(), pool.values[0][g, rows].double()
            assert torch.equal(keys[-1], k_new[0, g, b].double())
            weights = torch.softmax(keys @ q[0, h, b].double() / d**0.5, dim=0)
            want = weights @ values
            tol = 1e-5 if dtype == torch.float32 else 2.0**-8 * float(want.abs().amax())
            assert float((got[0, h, b].double() - want).abs().amax()) <= tol


def seq(prompt_len: int, max_tokens: int = 4, computed: int = 0, generated: int = 0) -> Seq:
    s = Seq(list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), lambda event: None)
    s.computed = computed
    s.tokens += [0] * generated
    return s


def test_plan_decodes_first_then_chunks_prompts_then_admits_in_order() -> None:
    decoding = seq(5, computed=5, generated=1)
    prefilling = seq(20, computed=8)
    waiting = [seq(30), seq(2), seq(2)]
    plan = plan_step([decoding, prefilling], waiting, free_blocks=100, block_size=4, b=Budget(4, 20, 8))
    assert [(s, n) for s, n in plan.chunks] == [(decoding, 1), (prefilling, 8), (waiting[0], 8), (waiting[1], 2)]
    assert plan.admit == waiting[:2] and plan.preempt == []  # the step's 20 tokens are spent
    # Admission takes the blocks of the tokens a sequence holds (not of max_tokens), and never lets a
    # later request overtake the head.
    plan = plan_step([], [seq(30, max_tokens=10), seq(1)], free_blocks=7, block_size=4, b=Budget(4, 64, 64))
    assert plan.admit == [] and plan.chunks == []
    plan = plan_step([], [seq(30, max_tokens=10), seq(1)], free_blocks=9, block_size=4, b=Budget(4, 64, 64))
    assert [len(s.prompt) for s in plan.admit] == [30, 1]
    plan = plan_step([decoding] * 2, [seq(1)], free_blocks=9, block_size=4, b=Budget(2, 64, 64))
    assert plan.admit == []  # the batch is full


def test_default_budget_admits_a_burst_at_once_and_still_chunks_a_long_prompt() -> None:
    """``moekit serve``'s defaults: sixteen prompts of 32-92 tokens arriving together all join in one
    step, while a 1000-token prompt arriving as sixteen decode feeds one ``prefill_chunk`` beside them."""
    from moekit.serve.engine import EngineOptions

    options = EngineOptions()
    burst = [seq(32 + 4 * i) for i in range(16)]
    plan = plan_step([], burst, free_blocks=1000, block_size=16, b=options.budget)
    assert plan.admit == burst and [n for _, n in plan.chunks] == [len(s.prompt) for s in burst]
    decoding = [seq(5, computed=5, generated=1) for _ in range(16)]
    long = seq(1000)
    plan = plan_step(decoding, [long], free_blocks=1000, block_size=16, b=options.budget)
    assert plan.chunks == [*((s, 1) for s in decoding), (long, options.prefill_chunk)]


def held(prompt_len: int, generated: int) -> Seq:
    """A decoding sequence holding the blocks (of 4) of its computed positions."""
    s = seq(prompt_len, computed=prompt_len + generated - 1, generated=generated)
    s.blocks = list(range(-(-s.computed // 4)))
    return s


def test_a_decode_without_a_free_block_preempts_the_newest() -> None:
    """``old`` crosses into a new block with none free: ``new`` (admitted last) gives its blocks back and
    nobody is admitted; the newest preempts itself when nothing newer holds blocks."""
    old, mid, new = held(8, 1), held(3, 1), held(5, 1)  # old needs a third block; mid and new have room
    plan = plan_step([old, mid, new], [seq(1)], free_blocks=0, block_size=4, b=Budget(8, 64, 64))
    assert plan.preempt == [new] and plan.admit == [] and plan.chunks == [(old, 1), (mid, 1)]
    alone = held(8, 1)
    plan = plan_step([mid, alone], [], free_blocks=0, block_size=4, b=Budget(8, 64, 64))
    assert plan.preempt == [alone] and plan.chunks == [(mid, 1)]
    back = seq(8, generated=3)  # preempted: its prompt and generated tokens are prefilled again
    plan = plan_step([], [back], free_blocks=3, block_size=4, b=Budget(8, 64, 4))
    assert plan.admit == [back] and plan.chunks == [(back, 4)]


def test_text_stream_holds_back_split_characters_and_stop_prefixes() -> None:
    stream = TextStream(ByteTokenizer(), ("END",))
    released = [stream.add(t) for t in "é wEN".encode()]
    assert "".join(text for text, _ in released) == "é w" and not any(stop for _, stop in released)
    assert released[0] == ("", None)  # half of é
    assert stream.add(ord("D")) == ("", "END")  # "END" stops: neither it nor anything after is released
    stream = TextStream(ByteTokenizer(), ("END",))
    assert [stream.add(t)[0] for t in b"ENx"] == ["", "", "ENx"]  # a prefix that did not become a stop


def test_offloaded_experts_serve_the_whole_batch_in_each_layer(write_run, tmp_path: Path) -> None:
    """Four prompts through the engine with experts on disk: tokens equal the resident model's, and each
    step reads an expert at most once however many sequences route to it."""
    from moekit.serve.engine import Finish, Token

    run_dir = write_run(tmp_path / "run", **{"model.tie_embeddings": "false"})
    resident = load_run(run_dir)
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=1 << 30, prefetch="off"))
    engine, events = _served(run)
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([list(p.encode())])
        want = generate(resident.model, ids, 6, 0.0)[0, ids.shape[1] :].tolist()
        assert [e.token for e in events if isinstance(e, Token) and e.choice == i] == want
    assert sum(isinstance(e, Finish) for e in events) == 4
    assert run.offloader.stats.max_reads_per_step == 1 and engine.steps < 4 * 6
    run.offloader.close()


def test_steps_run_in_inference_mode(write_run, tmp_path: Path) -> None:
    """Every block of every step runs without autograd's dispatch (what each block's pre-hook sees),
    the one-token path's steps and the batch's alike; the tokens are the model's own (greedy)."""
    from moekit.serve.engine import Token

    run = load_run(write_run(tmp_path / "run"))
    seen: list[bool] = []
    hooks = [
        b.register_forward_pre_hook(lambda m, a: seen.append(torch.is_inference_mode_enabled()))
        for b in run.model.blocks
    ]
    _, events = _served(run)
    for hook in hooks:
        hook.remove()
    assert len(seen) > len(run.model.blocks) and all(seen)
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([list(p.encode())])
        want = generate(run.model, ids, 6, 0.0)[0, ids.shape[1] :].tolist()
        assert [e.token for e in events if isinstance(e, Token) and e.choice == i] == want


PROMPTS = ["the king", "ab", "hello there", "x"]


def _served(run):
    """An engine's step loop over ``PROMPTS``, 6 greedy tokens each, run to the end: it and its events."""
    from moekit.serve.engine import Engine, EngineOptions

    engine = Engine(run, EngineOptions(kv_budget=1 << 20, block_size=4, prefill_chunk=4))
    events: list = []
    engine.submit([Seq(list(p.encode()), SamplingParams(6, 0.0), events.append, i) for i, p in enumerate(PROMPTS)])
    engine.waiting.extend(engine._inbox)
    engine._inbox.clear()
    while engine.running or engine.waiting:
        engine.step()
    return engine, events


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_serve_the_tokens_generate_gives(write_run, tmp_path: Path, fmt: str) -> None:
    """``moekit serve --expert-format F --dense-format F``: four prompts batched through the engine (a
    quantized head, attention and experts over packed rows) give the tokens ``generate`` gives each
    alone on the same quantized model."""
    from moekit.model_dir import load_for_inference
    from moekit.serve.engine import Token

    run_dir = write_run(tmp_path / "run", **{"model.tie_embeddings": "false"})
    run = load_for_inference(run_dir, expert_format=fmt, dense_format=fmt)[0]
    assert type(run.model.lm_head).__name__ == "QuantizedLinear"
    _, events = _served(run)
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([list(p.encode())])
        want = generate(run.model, ids, 6, 0.0)[0, ids.shape[1] :].tolist()
        assert [e.token for e in events if isinstance(e, Token) and e.choice == i] == want


@pytest.mark.slow
@pytest.mark.parametrize("attention", [{}, MLA], ids=["gqa", "mla"])
def test_preempted_sequences_recompute_to_generates_tokens(write_run, tmp_path: Path, attention) -> None:
    """A KV pool of one context (12 blocks of 4) for five requests that need more: the newest running
    ones are preempted and recomputed, and every greedy output still equals ``generate``'s; the
    preemptions are counted (and exported in /metrics), and every block comes back."""
    from moekit.serve.engine import Engine, EngineOptions, Finish, Token
    from moekit.serve.metrics import Metrics

    run = load_run(write_run(tmp_path / "run", **{"model.tie_embeddings": "false", **attention}))
    per_block = KVPool.bytes_per_block(run.model.cfg, 4, torch.float32)
    engine = Engine(run, EngineOptions(kv_budget=12 * per_block, block_size=4, prefill_chunk=8))
    metrics = Metrics()
    metrics.watch(engine)
    events: list = []
    prompts = ["the king and queen", "ab", "hello there", "x", "walked along the"]
    engine.waiting.extend(
        Seq(list(p.encode()), SamplingParams(14, 0.0), events.append, i) for i, p in enumerate(prompts)
    )
    while engine.running or engine.waiting:
        engine.step()
    for i, p in enumerate(prompts):
        ids = torch.tensor([list(p.encode())])
        want = generate(run.model, ids, 14, 0.0)[0, ids.shape[1] :].tolist()
        assert [e.token for e in events if isinstance(e, Token) and e.choice == i] == want
    assert sorted(e.choice for e in events if isinstance(e, Finish)) == list(range(5))
    assert engine.preemptions > 0 and engine.pool.free_blocks == engine.pool.num_blocks
    assert f"moekit_preemptions_total {float(engine.preemptions)}" in metrics.render().decode()


def test_the_logits_of_chosen_positions_equal_the_whole_forwards_rows() -> None:
    """``logits_at`` (repeats and any order) gives the rows the whole forward gives; with targets, refused."""
    cfg = runconfig.resolve("tiny", GQA)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    ids = torch.randint(0, 256, (2, 9))
    at = torch.tensor([8, 2, 2, 0])
    with torch.no_grad():
        whole, chosen = model(ids).logits, model(ids, logits_at=at).logits
    assert chosen.shape == (2, 4, cfg.model.vocab_size)
    torch.testing.assert_close(chosen, whole[:, at], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="targets or logits_at"):
        model(ids, targets_BL=ids, logits_at=at)


@pytest.mark.parametrize("scored", [False, True], ids=["none scored", "one scored"])
def test_a_step_projects_only_the_positions_it_scores_or_samples_from(write_run, tmp_path: Path, scored) -> None:
    """Prompts fed in chunks beside decodes: the output head sees one row per sequence sampling that step
    (none while prompts are still being fed), and with one prompt scored (``prompt_logprobs``) its
    prompt positions besides, not the other prompt's; tokens equal ``generate``'s either way, and the
    scored prompt's logprobs equal its positions' log-softmax from the whole forward."""
    from moekit.serve.engine import Engine, EngineOptions, Token

    run = load_run(write_run(tmp_path / "run", **{"model.tie_embeddings": "false"}))
    engine = Engine(run, EngineOptions(kv_budget=1 << 20, block_size=4, prefill_chunk=4))
    projected: list[int] = []
    hook = run.model.lm_head.register_forward_pre_hook(lambda module, args: projected.append(args[0].shape[1]))
    events: list = []
    prompts = ["the king and queen", "the queen"]  # 5 and 3 chunks of 4
    params = [SamplingParams(5, 0.0, prompt_logprobs=scored), SamplingParams(5, 0.0)]
    seqs = [Seq(list(p.encode()), sp, events.append, i) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    engine.waiting.extend(seqs)
    sampled: list[int] = []
    while engine.running or engine.waiting:
        tokens = sum(isinstance(e, Token) for e in events)
        engine.step()
        sampled.append(sum(isinstance(e, Token) for e in events) - tokens)
    hook.remove()
    if scored:
        assert sum(projected) == sum(sampled) + len(prompts[0]) - 1
    else:
        assert projected == sampled and 0 in sampled
    for i, p in enumerate(prompts):
        ids = torch.tensor([list(p.encode())])
        want = generate(run.model, ids, 5, 0.0)[0, ids.shape[1] :].tolist()
        assert [e.token for e in events if isinstance(e, Token) and e.choice == i] == want
    if scored:
        ids = torch.tensor([list(prompts[0].encode())])
        with torch.no_grad():
            want = run.model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        got = torch.tensor([score.logprob for score in seqs[0].prompt_scores])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_one_sequence_steps_equal_the_forwards_tokens_logprobs_and_expert_load(
    write_run, tmp_path: Path, monkeypatch
) -> None:
    """A prepacked model served one request at a time takes ``token_step`` at each decode step (counted);
    the same requests on a second load of it whose routers carry a (no-op) hook, which leaves every step
    to the forward, give the same tokens, the same logprobs bit for bit, and the same expert load counts."""
    import moekit.serve.engine
    from moekit.model_dir import load_for_inference
    from moekit.serve.engine import Engine, EngineOptions, Token

    taken: list[int] = []

    def counted(*args, **kwargs):
        taken.append(1)
        return token_step(*args, **kwargs)

    monkeypatch.setattr(moekit.serve.engine, "token_step", counted)

    run_dir = write_run(tmp_path / "run")
    run, hooked = load_for_inference(run_dir)[0], load_for_inference(run_dir)[0]
    for moe in hooked.model.moe_layers():
        moe.router.register_forward_hook(lambda module, args, out: None)

    def serve(r) -> tuple[list, list[torch.Tensor]]:
        engine = Engine(r, EngineOptions(kv_budget=1 << 20, block_size=4))
        events: list = []
        for i, p in enumerate(PROMPTS):  # one at a time: every decode step is one sequence's
            engine.waiting.append(Seq(list(p.encode()), SamplingParams(6, 0.0, logprobs=2), events.append, i))
            while engine.running or engine.waiting:
                engine.step()
        tokens = [(e.choice, e.token, e.logprobs) for e in events if isinstance(e, Token)]
        return tokens, [load.clone() for load in engine.expert_load]

    with torch.no_grad():
        assert takes(run.model, torch.tensor([[1]])) and not takes(hooked.model, torch.tensor([[1]]))
    tokens, load = serve(run)
    one_token_steps = sum(5 + (len(p.encode()) == 1) for p in PROMPTS)  # each decode, and a 1-token prompt
    assert len(taken) == one_token_steps
    want_tokens, want_load = serve(hooked)
    assert len(taken) == one_token_steps
    assert tokens == want_tokens and len(tokens) == 6 * len(PROMPTS)
    assert all(torch.equal(a, b) for a, b in zip(load, want_load, strict=True))
    assert sum(int(x.sum()) for x in load) > 0
