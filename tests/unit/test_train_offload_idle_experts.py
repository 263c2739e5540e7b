"""Experts that receive no token skip their gradient's transfers (``train.memory_budget``), against
in-memory training, and the store's transfers of some experts of a region.

Every MoE router's selection bias keeps experts 2 and 3 of 4 from every token after the first step
(top-2: each token picks experts 0 and 1), so their gradients are exactly zero: they are neither
written out nor read back, and their AdamW update still runs on a zero gradient (the first step gave
them moments, and weight decay moves them). A backward that reads a layer's weights again reads
only the routed experts' (the budget holds two of the five layers). Reference: in-memory training with the same biases.
Tolerance: none (bitwise): losses, gradient norms, final weights and AdamW moments. Disk traffic:
the same offloaded run without the bias (every expert busy in every micro-batch) moves exactly the
idle experts' gradient bytes more, and the weight bytes of the backward reads that a forward does
not complete, as written out in the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import write_corpus
from helpers import train_routed

from moekit import runconfig
from moekit.experts.grouped import expert_ffn
from moekit.storage.aligned import DIRECT_ALIGN
from moekit.storage.files import StorageFile
from moekit.train import loop
from moekit.train.offload.store import LayerFile, Rest

STEPS, LAYERS, EXPERTS = 3, 5, 4
IDLE = (2, 3)  # kept from every token after the first step
EXPERT_BYTES = (32 * 128 + 64 * 32) * 4  # one expert's w_in [32, 128] and w_out [64, 32] in fp32: 6 pages
UNIT = EXPERTS * EXPERT_BYTES  # one (layer, kind) region
_PLAIN_SETUP = (False, torch.device("cpu"), False, None, False)  # loop._setup: fresh, on cpu, no progress


def _cfg(corpus: Path, grad_accum: int, offload: bool, host: str = "", steps: int = STEPS) -> runconfig.RunConfig:
    values = {
        "data.path": str(corpus),
        "data.cache_dir": str(corpus.parent / "cache"),
        "model.n_layers": str(LAYERS),
        "moe.bias_update_rate": "0",  # the biases stay as set
        "train.steps": str(steps),
        "train.batch_size": "8",
        "train.grad_accum": str(grad_accum),
        "train.sample_tokens": "0",
    }
    if offload:  # two layers' weights in RAM: every layer is read in forward and again in backward
        values["train.memory_budget"] = "800KB"
    if offload and host:
        values["train.host_budget"] = host
    return runconfig.resolve("tiny", values)


def _idle_after_first_step(step: int, micro: int) -> torch.Tensor:
    bias = torch.zeros(EXPERTS)
    if step > 0:
        bias[list(IDLE)] = -1e4
    return bias


@pytest.mark.slow
@pytest.mark.parametrize(
    ("grad_accum", "host"),
    [(1, ""), (2, ""), (2, str(LAYERS * UNIT))],  # the host tier: every layer's gradient region
    ids=["accum1", "accum2", "accum2-host_tier"],
)
def test_idle_experts_skip_their_gradient_transfers_bitwise(tmp_path: Path, grad_accum: int, host: str) -> None:
    """Bytes: on disk and in the host tier together."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    memory = train_routed(_cfg(corpus, grad_accum, False), tmp_path / "memory", _idle_after_first_step)
    idle = train_routed(_cfg(corpus, grad_accum, True, host), tmp_path / "idle", _idle_after_first_step)
    busy = train_routed(
        _cfg(corpus, grad_accum, True, host), tmp_path / "busy", lambda step, micro: torch.zeros(EXPERTS)
    )

    assert idle.host_regions == ([(layer, "grad") for layer in range(LAYERS)] if host else [])
    for key in ("loss", "grad_norm"):  # the norm: an idle expert's zero gradient adds zero
        assert [r[key] for r in idle.records] == [r[key] for r in memory.records], key
    assert memory.state.keys() == idle.state.keys()
    assert any(".experts." in k and k.endswith(":exp_avg_sq") for k in memory.state)
    for key in memory.state:
        assert torch.equal(memory.state[key], idle.state[key]), key

    # Per step after the first, each idle (layer, expert) leaves out grad_accum (A) writes of its gradient
    # (one per micro-batch) and A reads (A - 1 read-backs by the next micro-batches, one by the AdamW step).
    transfers = (STEPS - 1) * LAYERS * len(IDLE) * grad_accum
    assert not any(busy.experts_skipped.values()), "the run without a bias has every expert busy"
    assert idle.experts_skipped["grad"] == 2 * transfers
    assert busy.bytes_written - idle.bytes_written == transfers * EXPERT_BYTES
    # Each micro-batch's backward reads layers L-3 .. 0 again (two slots: the top two are still there),
    # each for its routed experts only. Layers L-3 .. 2 are evicted before the next forward; layers 1
    # and 0 stay, and read their idle experts' weights then, as a forward needs the whole layer.
    backward_reads = (STEPS - 1) * grad_accum * (LAYERS - 2) * len(IDLE)
    assert idle.experts_skipped["weight"] == backward_reads
    weights_saved = (STEPS - 1) * grad_accum * (LAYERS - 4) * len(IDLE)
    assert busy.bytes_read - idle.bytes_read == (transfers + weights_saved) * EXPERT_BYTES


IDLE_BY_MICRO = ((2, 3), (0, 1), (1, 3))  # micro-batch m of step s: IDLE_BY_MICRO[(s + m) % 3] kept from tokens


def _idle_by_micro_batch(step: int, micro: int) -> torch.Tensor:
    bias = torch.zeros(EXPERTS)
    bias[list(IDLE_BY_MICRO[(step + micro) % 3])] = -1e4
    return bias


def test_routing_that_changes_between_micro_batches_sums_every_micro_batch_s_rows(tmp_path: Path) -> None:
    """Two steps of two micro-batches, each micro-batch with its own two idle experts: an expert's
    gradient is skipped only while no micro-batch so far routed it a token. Bitwise against in-memory
    training; keeping only the last micro-batch's rows would leave the others' gradients off the disk."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    memory = train_routed(_cfg(corpus, 2, False, steps=2), tmp_path / "memory", _idle_by_micro_batch)
    offloaded = train_routed(_cfg(corpus, 2, True, steps=2), tmp_path / "offloaded", _idle_by_micro_batch)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in offloaded.records] == [r[key] for r in memory.records], key
    assert memory.state.keys() == offloaded.state.keys()
    for key in memory.state:
        assert torch.equal(memory.state[key], offloaded.state[key]), key
    # Per layer and step: micro-batch 0's two idle experts skip the write of the running sum and its read
    # back (4); those idle in both micro-batches (none in step 0, expert 1 in step 1) skip the reduced
    # gradient's write and the AdamW step's read.
    assert offloaded.experts_skipped["grad"] == LAYERS * (4 + (4 + 2))


def test_a_forward_that_runs_the_ffn_in_chunks_sums_their_rows(tmp_path: Path) -> None:
    """A schedule may run the FFN several times in one forward (chunked overlap): layer 0's experts run
    over rows of experts 0 and 1, then of experts 2 and 3. The backward's reads and the gradient written
    count both chunks' rows: the outputs and every expert's gradient on disk equal one FFN call's over
    all the rows (reference: ``expert_ffn`` on the same weights, in memory)."""
    run = loop._setup(_cfg(write_corpus(tmp_path / "corpus.txt"), 1, True), tmp_path / "run", *_PLAIN_SETUP)
    offload = run.experts
    assert offload is not None
    try:
        experts = offload.experts[0]
        counts = torch.tensor([3, 2, 4, 1])
        x = torch.randn(int(counts.sum()), experts.w_in.shape[1], generator=torch.Generator().manual_seed(0))
        first = int(counts[:2].sum())
        idle = torch.zeros(2, dtype=counts.dtype)

        def two_chunks(rows: torch.Tensor, ffn) -> torch.Tensor:
            low, high = torch.cat([counts[:2], idle]), torch.cat([idle, counts[2:]])
            return torch.cat([ffn(rows[:first], low), ffn(rows[first:], high)])

        out = experts(x, schedule=two_chunks)
        out.square().sum().backward()
        offload.reduce.wait()
        offload.ws.flush()
        assert torch.equal(offload.grads.rows[0], counts) and offload.grads.routed[0] == (True,) * EXPERTS

        buf = offload.file.buffer()
        offload.file.read(0, "weight", buf)
        w = {role: t.clone().requires_grad_() for role, t in offload.file.views(buf).items()}
        reference = expert_ffn(x, w["w_in"], w["w_out"], counts, experts.activation, experts.gemm)
        reference.square().sum().backward()
        assert torch.equal(out, reference)
        offload.file.read(0, "grad", buf)
        for role, grad in offload.file.views(buf).items():
            assert torch.equal(grad, w[role].grad), role
    finally:
        offload.close()


def test_a_transfer_of_some_experts_moves_their_pages_and_zeroes_the_rest(tmp_path: Path) -> None:
    """Experts of 4 KiB (``w``) and of 64 bytes (``b``, all four in one page): expert 1's gradient (the
    others idle, zero) moves the page of its ``w`` and the page of ``b``, whose other experts' bytes move
    with it (no expert skipped); a read of experts 0 and 1 holds theirs, zeros outside the pages read,
    and in the ``b`` page what the write left there. Without ``b``, the idle experts move no byte (skipped)."""
    file = LayerFile(StorageFile.claim(tmp_path / "experts.bin"), 1, {"w": (4, DIRECT_ALIGN // 4), "b": (4, 16)})
    try:
        assert file.spans((False, True, False, True)) == [
            (DIRECT_ALIGN, 2 * DIRECT_ALIGN),
            (3 * DIRECT_ALIGN, 5 * DIRECT_ALIGN),  # w of expert 3, then the page of every b
        ]
        assert file.spans((True,) * 4) == [(0, file.unit)]
        full, grad = file.buffer(), file.buffer()
        for t in file.views(full).values():
            t.copy_(torch.randn(t.shape))
        file.write(0, "grad", full)
        grad.zero_()
        for t in file.views(grad).values():
            t[1] = 7.0
        file.write(0, "grad", grad, (False, True, False, False))
        assert file.bytes_written == file.unit + 2 * DIRECT_ALIGN
        assert file.experts_skipped["grad"] == 0, "every expert's b moved in the page of b"
        got = file.buffer()
        got.fill_(255)
        file.read(0, "grad", got, (True, True, False, False))
        assert file.bytes_read == 3 * DIRECT_ALIGN  # the w pages of experts 0 and 1, the page of b
        assert file.experts_skipped["grad"] == 0
        w, b, w_full = file.views(got)["w"], file.views(got)["b"], file.views(full)["w"]
        assert torch.equal(w[0], w_full[0]) and (w[1] == 7.0).all() and not w[2:].any()
        assert (b[1] == 7.0).all() and not b[[0, 2, 3]].any(), "expert 0's b was written with expert 1's page"

        got.fill_(255)  # weights a backward leaves unused: the bytes outside the pages read stay
        file.read(0, "grad", got, (False, True, False, False), Rest.UNUSED)
        assert (got[:DIRECT_ALIGN] == 255).all() and (got[2 * DIRECT_ALIGN : 3 * DIRECT_ALIGN] == 255).all()
    finally:
        file.remove()


def test_idle_experts_that_share_no_page_are_skipped(tmp_path: Path) -> None:
    """Experts of whole pages: a write or read of some experts skips the others (counted), and a read
    completing a partly read buffer (``Rest.HELD``) keeps what it held and skips none."""
    file = LayerFile(StorageFile.claim(tmp_path / "experts.bin"), 1, {"w": (4, DIRECT_ALIGN // 4)})
    try:
        buf = file.buffer()
        for e, t in enumerate(file.views(buf)["w"]):
            t.fill_(float(e))
        file.write(0, "weight", buf)
        file.write(0, "grad", buf, (False, True, False, False))
        assert file.experts_skipped == {"weight": 0, "grad": 3, "exp_avg": 0, "exp_avg_sq": 0}
        got = file.buffer()
        file.read(0, "weight", got, (True, False, False, True), Rest.UNUSED)
        file.read(0, "weight", got, (False, True, True, False), Rest.HELD)
        assert file.experts_skipped["weight"] == 2 and torch.equal(got, buf)
    finally:
        file.remove()
