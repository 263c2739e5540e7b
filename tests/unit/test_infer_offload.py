"""Offloaded experts: same greedy tokens as resident inference, a budget never exceeded, each expert
read at most once per step, prefetch on/off equal, clear errors. Real run directories on disk."""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter, deque
from pathlib import Path

import pytest
import torch
from helpers import budget_for

from moekit.infer import offloader, resident_experts
from moekit.infer.expert_store import (
    ExpertStoreError,
    expert_tensor_prefix,
    read_safetensors_header,
)
from moekit.infer.generate import generate, generate_texts, left_pad
from moekit.infer.offload import OffloadOptions, model_bytes, resolve_prefetch
from moekit.model import Transformer
from moekit.run.load import load_run
from moekit.storage.loaders import CudaLoader, FileLoader, pinned_tier
from moekit.storage.slots import LFU, LRU, SlotCache
from moekit.units import parse_bytes

PROMPTS = [[5, 17, 99, 3, 42, 8, 1], [200, 13], [7, 7, 7, 7]]


def greedy(model: Transformer, new_tokens: int = 12) -> torch.Tensor:
    ids, pad = left_pad(PROMPTS)
    device = model.embed.weight.device
    return generate(model, ids.to(device), new_tokens, temperature=0, left_pad_B=pad.to(device))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("experts", [1, 2, 5, 18])  # one expert .. all 3 x 6
def test_greedy_tokens_equal_resident_and_budget_holds(run_dir: Path, experts: int, policy: str) -> None:
    reference = greedy(load_run(run_dir).model)
    budget = budget_for(run_dir, experts)
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget, policy=policy))
    off = run.offloader
    try:
        assert torch.equal(greedy(run.model), reference)
        cache = off.cache
        assert cache.num_slots == experts
        assert model_bytes(run.model) + cache.counters.peak_slots * cache.slot_bytes <= budget
        assert off.stats.max_reads_per_step == 1  # each expert read at most once per step
        assert off.stats.bytes_read == off.stats.reads * off.store.bytes_per_expert
        if experts == 18:  # everything fits: each expert is read once in the whole run
            assert off.stats.reads <= 18 and cache.counters.evictions == 0
    finally:
        off.close()


@pytest.mark.parametrize("experts", [2, 5, 36])  # 1, 2 and all 18 experts kept reordered, within the budget
def test_fp32_experts_are_kept_reordered_for_the_packed_kernel_within_the_budget(
    run_dir: Path, experts: int, monkeypatch
) -> None:
    """Prepacked fp32 experts: each cached one is reordered for oneDNN's kernel once per load, not per
    product, beside its slot; the cache keeps half the slots the budget pays for, so slots and copies fit
    it; the logits equal the resident prepacked model's, bit for bit."""
    from moekit.experts.matmul import prepack, prepackable
    from moekit.infer.generate import decode_step, prefill
    from moekit.infer.resident_experts import prepack_

    if not prepackable(torch.empty(1)):
        pytest.skip("this CPU's torch has no oneDNN")
    # fp32 prepacked, as on a CPU with AVX-512 (without it, fp32 weights are kept plain for the row kernel)
    monkeypatch.setattr(resident_experts, "plain_fp32", lambda: False)
    resident = prepack_(load_run(run_dir).model)
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget_for(run_dir, experts), prefetch="off"))
    off = run.offloader
    try:
        prepack_(run.model)
        reorders: list[int] = []
        monkeypatch.setattr(offloader, "prepack", lambda w: reorders.append(1) or prepack(w))
        assert off.cache.num_slots == min(experts // 2, 18) and off.reordered_bytes > 0
        assert model_bytes(run.model) + off.cache.capacity_bytes + off.reordered_bytes <= budget_for(run_dir, experts)
        prompt = torch.tensor([PROMPTS[0]])
        (want, cache_a), (got, cache_b) = prefill(resident, prompt), prefill(run.model, prompt)
        for _ in range(6):
            assert torch.equal(got, want)
            token = want.argmax(-1, keepdim=True)
            want, got = decode_step(resident, token, cache_a), decode_step(run.model, token, cache_b)
        assert len(reorders) == 2 * off.stats.reads, "w_in and w_out reordered once per expert read"
        held = [torch.ops.mkldnn._nbytes(w) for _, copy in off._reordered.values() for w in copy.values()]
        assert len(held) == 2 * min(off.cache.num_slots, off.stats.reads) and sum(held) <= off.reordered_bytes
        assert (off.stats.hits > off.stats.reads) == (experts == 36), "with every expert cached, hits reorder nothing"
    finally:
        off.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prefetch", ["router", "all", "off"])
@pytest.mark.parametrize("experts", [2, 9, 18])
def test_cuda_offloaded_tokens_equal_resident(run_dir: Path, experts: int, prefetch: str) -> None:
    """On a GPU the experts are copied from pinned host memory on a side stream (``CudaLoader``): the
    greedy tokens are the resident model's on the same device, with slots reused (2, 9) or not (18)."""
    reference = greedy(load_run(run_dir, "cuda").model)
    options = OffloadOptions(budget_for(run_dir, experts), prefetch=prefetch, prefetch_min_precision=0.0)
    run = load_run(run_dir, "cuda", offload=options)
    off = run.offloader
    try:
        assert isinstance(off.loader, CudaLoader) and off.cache.device.type == "cuda"
        assert torch.equal(greedy(run.model), reference)
        assert off.stats.max_reads_per_step == 1 and off.stats.reads > 0
        assert experts == 18 or off.cache.counters.evictions > 0
    finally:
        off.close()


def test_cpu_offload_reads_the_file(run_dir: Path) -> None:
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget_for(run_dir, 2)))
    try:
        assert isinstance(run.offloader.loader, FileLoader) and run.offloader.cache.device.type == "cpu"
        assert run.offloader.prefetch == "router"  # auto: predict the next layer's reads from a disk
    finally:
        run.offloader.close()


def test_auto_prefetch_predicts_reads_from_a_disk_but_not_copies_to_a_gpu() -> None:
    assert resolve_prefetch("auto", torch.device("cpu")) == "router"
    assert resolve_prefetch("auto", torch.device("cuda")) == "off"
    assert [resolve_prefetch(m, torch.device("cuda")) for m in ("router", "all", "off")] == ["router", "all", "off"]


@pytest.mark.parametrize("prefetch", ["router", "all", "off"])
def test_prefetch_modes_give_the_same_tokens(run_dir: Path, prefetch: str) -> None:
    reference = greedy(load_run(run_dir).model)
    budget = budget_for(run_dir, 9)
    options = OffloadOptions(
        memory_budget=budget, prefetch=prefetch, policy="fifo", prefetch_min_precision=0.0, record_trace=1000
    )
    run = load_run(run_dir, offload=options)
    stats, trace = run.offloader.stats, run.offloader.trace
    try:
        assert torch.equal(greedy(run.model), reference)
        assert stats.max_reads_per_step == 1
        if prefetch == "off":  # on demand only: never an expert the step did not select
            needed = {(r.step, (r.block, e)) for r in trace.requests for e in r.needed}
            assert {(r.step, r.key) for r in trace.reads} <= needed and stats.prefetch_reads == 0
        else:
            assert stats.prefetch_reads > 0
        if prefetch == "router":
            assert stats.predicted > 0 and 0 < stats.prediction_recall <= 1
    finally:
        run.offloader.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_a_prefetch_never_evicts_what_it_predicted(run_dir: Path, policy: str) -> None:
    """Every layer uses all 6 of its experts and 13 slots hold a layer's 6, the next layer's 6 (the
    prefetch: all of them) and one more. The next layer's experts still resident when its prefetch
    starts are kept, not evicted to make room for their siblings: once warm, each layer reads only the
    5 of its experts that were gone, each once, all of them prefetched."""
    resident = load_run(run_dir).model
    options = OffloadOptions(budget_for(run_dir, 13), policy=policy, prefetch="all", record_trace=1000)
    run = load_run(run_dir, offload=options)
    off = run.offloader
    steps, blocks = 4, off.blocks
    x_RD = torch.randn(6, run.config.model.d_model, generator=torch.Generator().manual_seed(0))
    every_expert = torch.ones(6, dtype=torch.long)  # one row each
    try:
        with torch.no_grad():
            for _ in range(steps):
                for block in blocks:
                    y_RD = run.model.blocks[block].ffn.experts(x_RD, every_expert)
                    # reference: the resident model's own experts
                    assert torch.equal(y_RD, resident.blocks[block].ffn.experts(x_RD, every_expert))
        stats, trace = off.stats, off.trace
        assert stats.misses == 6  # the first layer's, read cold; every later expert was prefetched or kept
        # reads by the step they are for (the last layer's prefetch, for a step not run, may be in flight)
        reads = Counter(r.step for r in trace.reads if r.step <= steps)
        assert reads == {1: 18, **dict.fromkeys(range(2, steps + 1), 15)}
        assert stats.max_reads_per_step == 1 and stats.reads == stats.prefetch_reads + 6
    finally:
        off.close()


@pytest.mark.slow
def test_ring_prefetch_keeps_every_expert_it_will_use(run_dir: Path) -> None:
    """``prefetch="all"`` with room for two layers and one more expert: no prefetch evicts an expert of
    the layer it reads for (all of them are predicted), after the first layer every expert a step needs
    was prefetched or kept resident (no demand read), and the tokens are resident's."""
    reference = greedy(load_run(run_dir).model)
    options = OffloadOptions(budget_for(run_dir, 13), policy="fifo", prefetch="all", record_trace=1000)
    run = load_run(run_dir, offload=options)
    off = run.offloader
    evictions: list[tuple[tuple[int, int], tuple[int, int]]] = []  # (key reserved, key it evicted)
    cache_reserve = off.cache.reserve

    def reserve(key):
        before = set(off.cache.entries)
        entry = cache_reserve(key)
        evictions.extend((key, evicted) for evicted in before - set(off.cache.entries))
        return entry

    off.cache.reserve = reserve
    try:
        assert torch.equal(greedy(run.model), reference)
        assert evictions and not [(key, gone) for key, gone in evictions if gone[0] == key[0]]
        first = off.trace.requests[0]
        assert off.stats.misses == len(first.needed) and not first.hits
        assert off.stats.max_reads_per_step == 1
    finally:
        off.close()


@pytest.mark.slow
def test_router_prefetch_pauses_while_its_precision_is_low(run_dir: Path, monkeypatch) -> None:
    reference = greedy(load_run(run_dir).model)
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget_for(run_dir, 9)))
    stats = run.offloader.stats
    stats.recent_precision = 0.1  # below the 50% gate ...
    monkeypatch.setattr(offloader, "_PRECISION_DECAY", 1.0)  # ... and held there
    try:
        assert torch.equal(greedy(run.model), reference)
        assert stats.prefetch_reads == 0  # no read on a prediction this unreliable
        assert stats.predicted > 0 and stats.predicted_needed > 0  # but predictions are still scored
    finally:
        run.offloader.close()


@pytest.mark.slow
def test_moving_precision_follows_the_predictions(run_dir: Path) -> None:
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget_for(run_dir, 9), prefetch_min_precision=0.0))
    stats = run.offloader.stats
    stats.recent_precision = 0.0
    try:
        greedy(run.model)
        # every scored prediction pulls the average towards its own precision (here mostly right)
        assert 0.5 < stats.recent_precision <= 1.0 and stats.prediction_precision > 0.5
    finally:
        run.offloader.close()


_BOOKKEEPING = (offloader.OffloadStats, offloader.Offloader, offloader.OffloadTrace, SlotCache, LRU, LFU)


def _container_lengths(obj: object, name: str = "") -> dict[str, int]:
    """Length of every list, tuple, dict, set and deque reachable through ``obj``'s attributes and items."""
    out: dict[str, int] = {}
    if isinstance(obj, list | tuple | dict | set | frozenset | deque):
        out[name] = len(obj)
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            out.update(_container_lengths(value, f"{name}[{key!r}]"))
    elif isinstance(obj, _BOOKKEEPING):
        for attr, value in vars(obj).items():
            out.update(_container_lengths(value, f"{name}.{attr}"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_bookkeeping_stays_bounded_over_many_steps(run_dir: Path, policy: str) -> None:
    options = OffloadOptions(budget_for(run_dir, 5), policy=policy, prefetch_min_precision=0.0, record_trace=10)
    run = load_run(run_dir, offload=options)
    off = run.offloader
    try:
        for _ in range(2):  # a long run in miniature: 72 layer requests, over 150 reads
            greedy(run.model, new_tokens=12)
        assert off.stats.steps == 2 * 12 and off.stats.reads > 150
        lengths = _container_lengths(off)
        assert "._step_reads" in lengths and ".trace.requests" in lengths  # the walk sees the bookkeeping
        # no container outgrows the model's experts (18) however long the run, the trace its own size
        too_long = {name: n for name, n in lengths.items() if n > len(off.store.pieces)}
        assert not too_long
        assert len(off.trace.requests) == len(off.trace.reads) == 10
        assert not any(hasattr(value, "__len__") for value in vars(off.stats).values())
    finally:
        off.close()


def test_totals_equal_the_figures_of_an_explicit_trace(run_dir: Path) -> None:
    options = OffloadOptions(budget_for(run_dir, 9), prefetch_min_precision=0.0, record_trace=10_000)
    run = load_run(run_dir, offload=options)
    off = run.offloader
    read_bytes: list[int] = []  # every read of the store, as the store reports it
    store_read = off.store.read_into

    def read_into(key, slot):
        read_bytes.append(store_read(key, slot))
        return read_bytes[-1]

    off.store.read_into = read_into
    try:
        greedy(run.model, new_tokens=8)
        stats, trace = off.stats, off.trace
        assert len(trace.requests) == stats.steps * len(off.blocks)  # the whole run is in the trace
        hits = sum(len(r.hits) for r in trace.requests)
        needed = sum(len(r.needed) for r in trace.requests)
        steps = {r.step for r in trace.requests}
        assert stats.hits == hits and stats.misses == needed - hits > 0
        assert stats.hit_rate == hits / needed
        assert stats.bytes_read == sum(read_bytes) > 0 and stats.reads == len(trace.reads) == len(read_bytes)
        assert stats.prefetch_reads == sum(r.prefetch for r in trace.reads) > 0
        assert stats.mean_reads_per_step == len(trace.reads) / len(steps)
        assert stats.max_reads_per_step == max(Counter((r.step, r.key) for r in trace.reads).values()) == 1
        assert trace.routing()[0] == [(trace.requests[0].block, e) for e in trace.requests[0].needed]
    finally:
        off.close()


@pytest.mark.slow
def test_sampled_batched_text_equals_resident(run_dir: Path) -> None:
    prompts = ["ab", "hello there", "x"]
    resident = generate_texts(load_run(run_dir), prompts, 10, temperature=1.0, top_k=20, seed=3, batch_size=2)
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=budget_for(run_dir, 3)))
    try:
        assert generate_texts(run, prompts, 10, temperature=1.0, top_k=20, seed=3, batch_size=2) == resident
    finally:
        run.offloader.close()


def test_budget_errors_are_clear(run_dir: Path) -> None:
    one_expert = budget_for(run_dir, 1)
    with pytest.raises(ValueError, match=r"smaller than the non-expert weights"):
        load_run(run_dir, offload=OffloadOptions(memory_budget=1000))
    with pytest.raises(ValueError, match=r"less than one expert"):
        load_run(run_dir, offload=OffloadOptions(memory_budget=one_expert - 1))
    assert load_run(run_dir, offload=OffloadOptions(memory_budget=one_expert)).offloader.cache.num_slots == 1


def test_truncated_expert_file_names_the_expert(run_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "run"
    shutil.copytree(run_dir, broken)
    weights = next(broken.glob("checkpoints/step_*/model.safetensors"))
    header, data_start = read_safetensors_header(weights)
    w_out = header["blocks.2.ffn.experts.w_out"]
    per_expert = (w_out["data_offsets"][1] - w_out["data_offsets"][0]) // 6
    with open(weights, "r+b") as f:  # cut in the middle of expert 3's w_out
        f.truncate(data_start + w_out["data_offsets"][0] + 3 * per_expert + per_expert // 2)
    with pytest.raises(ExpertStoreError, match=r"truncated: expert 3 of block 2 "):
        load_run(broken, offload=OffloadOptions(memory_budget=1 << 30))


@pytest.mark.parametrize("prefetch", ["router", "all", "off"])
@pytest.mark.parametrize("cut", [2, 0])
def test_a_failed_read_leaves_no_slot_pinned(run_dir: Path, tmp_path: Path, cut: int, prefetch: str) -> None:
    """The file is cut at block ``cut``'s experts after the store opened. Block 2: with a prefetch, the
    reads prefetched for it fail (several at once); without, its demand reads do. Block 0: its demand
    reads fail while block 1's prefetch is in flight. Either way the error names the file and an expert
    of the cut block, and every slot is free for the next request."""
    broken = tmp_path / "run"
    shutil.copytree(run_dir, broken)
    options = OffloadOptions(1 << 30, prefetch=prefetch, prefetch_min_precision=0.0, record_trace=100)
    run = load_run(broken, offload=options)
    off = run.offloader
    attempted: list[tuple[int, int]] = []
    store_read = off.store.read_into

    def read_into(key, slot):
        attempted.append(key)
        return store_read(key, slot)

    off.store.read_into = read_into
    header, data_start = read_safetensors_header(off.store.path)
    os.truncate(off.store.path, data_start + header[expert_tensor_prefix(cut) + "w_in"]["data_offsets"][0])
    try:
        error = rf"{re.escape(str(off.store.path))}: truncated: expert \d of block {cut} "
        for _ in range(2):  # the same clear error again: the first left nothing behind
            with pytest.raises(ExpertStoreError, match=error):
                greedy(run.model)
            entries = off.cache.entries
            assert all(e.pins == 0 and e.loading is None for e in entries.values()), entries
            assert not any(block >= cut for block, _ in entries)  # no slot claims an expert it does not hold
        assert sum(block == cut for block, _ in attempted) >= 2  # several reads of the cut block were in flight
        # where block 2's reads were prefetched, they failed before it ran: it made no request of its own
        demand = prefetch == "off" or cut == 0
        assert {r.block for r in off.trace.requests} == set(range(cut)) | ({cut} if demand else set())
        free = [off.cache.reserve(("free", i)) for i in range(off.cache.num_slots)]
        assert all(entry is not None for entry in free)  # every slot can be claimed again
    finally:
        off.close()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["between layers", "in a layer"])
def test_a_failed_forward_leaves_nothing_pinned(run_dir: Path, where: str) -> None:
    """A forward fails once with slots held: block 1's attention raises after block 0 reserved block 1's
    predicted experts (router prefetch), or block 1 fails computing its second expert with its other
    experts pinned and block 2's prefetch in flight. The next forwards give the resident model's logits
    exactly, and no slot stays pinned between them: 8 slots for 3 x 6 experts stay usable."""
    resident = load_run(run_dir).model
    options = OffloadOptions(budget_for(run_dir, 8), prefetch="router", prefetch_min_precision=0.0)
    run = load_run(run_dir, offload=options)
    off = run.offloader
    failures = [RuntimeError("injected failure")]
    pinned_at_failure: list[int] = []

    def pinned() -> dict[tuple[int, int], int]:
        return {key: entry.pins for key, entry in off.cache.entries.items() if entry.pins}

    def fail_once(*_) -> None:
        if failures:
            pinned_at_failure.append(len(pinned()))
            raise failures.pop()

    if where == "between layers":
        run.model.blocks[1].attn.register_forward_pre_hook(fail_once)
    else:
        block_1: list[object] = []  # a marker once block 1's experts start, then each expert it computes
        loader_before_compute = off.loader.before_compute

        def before_compute(entry) -> None:
            if block_1:
                block_1.append(entry)
                if len(block_1) == 3:  # block 1's second expert
                    fail_once()
            loader_before_compute(entry)

        run.model.blocks[1].ffn.experts.register_forward_pre_hook(lambda *_: block_1.append("started"))
        off.loader.before_compute = before_compute
    try:
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="injected failure"):
                run.model(torch.tensor([PROMPTS[0]]))
            assert pinned_at_failure[0] > 0  # it failed with slots held
            if where == "in a layer":  # the failing layer releases them itself
                assert pinned() == {}
            for seed in range(4):
                ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(seed))
                assert torch.equal(run.model(ids).logits, resident(ids).logits)
                assert pinned() == {}
        assert off.stats.prefetch_reads > 0 and off.cache.counters.evictions > 0
    finally:
        off.close()


def test_parse_bytes() -> None:
    assert parse_bytes("512MB", "budget") == 512 * 10**6
    assert parse_bytes("1.5GiB", "budget") == int(1.5 * 2**30)
    assert parse_bytes("4096", "budget") == 4096
    with pytest.raises(ValueError, match="memory_budget='lots'"):
        parse_bytes("lots", "memory_budget")


def test_host_tier_holds_every_expert_as_the_store_reads_it(run_dir: Path) -> None:
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=1 << 30))
    store = run.offloader.store
    try:
        host = pinned_tier(store, pin=torch.cuda.is_available())  # the GPU's slow tier
        slot = torch.empty(store.slot_bytes, dtype=torch.uint8)
        assert len(host.index) == len(store.pieces) == 18
        for key in store.pieces:
            store.read_into(key, slot)
            for role, view in store.views(key, slot).items():
                assert torch.equal(store.views(key, host.get(key))[role], view), (key, role)
    finally:
        run.offloader.close()
