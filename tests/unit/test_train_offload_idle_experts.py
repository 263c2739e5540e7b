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
from moekit.directio import DIRECT_ALIGN
from moekit.train.offload.store import LayerFile

STEPS, LAYERS, EXPERTS = 3, 5, 4
IDLE = (2, 3)  # kept from every token after the first step
EXPERT_BYTES = (32 * 128 + 64 * 32) * 4  # one expert's w_in [32, 128] and w_out [64, 32] in fp32: 6 pages
UNIT = EXPERTS * EXPERT_BYTES  # one (layer, kind) region


def _cfg(corpus: Path, grad_accum: int, offload: bool, host: str = "") -> runconfig.RunConfig:
    values = {
        "data.path": str(corpus),
        "data.cache_dir": str(corpus.parent / "cache"),
        "model.n_layers": str(LAYERS),
        "moe.bias_update_rate": "0",  # the biases stay as set
        "train.steps": str(STEPS),
        "train.batch_size": "8",
        "train.grad_accum": str(grad_accum),
        "train.sample_tokens": "0",
    }
    if offload:  # two layers' weights in RAM: every layer is read in forward and again in backward
        values["train.memory_budget"] = "800KB"
    if offload and host:
        values["train.host_budget"] = host
    return runconfig.resolve("tiny", values)


def _idle_after_first_step(step: int) -> torch.Tensor:
    bias = torch.zeros(EXPERTS)
    if step > 0:
        bias[list(IDLE)] = -1e4
    return bias


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
    busy = train_routed(_cfg(corpus, grad_accum, True, host), tmp_path / "busy", lambda step: torch.zeros(EXPERTS))

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


def test_a_transfer_of_some_experts_moves_their_pages_and_zeroes_the_rest(tmp_path: Path) -> None:
    """Experts of 4 KiB (``w``) and of 64 bytes (``b``, all four in one page): experts 1 and 3 move the
    page of each one's ``w`` and the page of ``b`` (expert 0's ``b`` riding along in it); a read of
    some experts holds theirs and zeros elsewhere."""
    file = LayerFile(tmp_path / "experts.bin", 1, {"w": (4, DIRECT_ALIGN // 4), "b": (4, 16)})
    try:
        assert file.spans((False, True, False, True)) == [
            (DIRECT_ALIGN, 2 * DIRECT_ALIGN),
            (3 * DIRECT_ALIGN, 5 * DIRECT_ALIGN),  # w of expert 3, then the page of every b
        ]
        assert file.spans((True,) * 4) == [(0, file.unit)]
        full, part = file.buffer(), file.buffer()
        for t in file.views(full).values():
            t.copy_(torch.randn(t.shape))
        file.write(0, "grad", full)
        for t in file.views(part).values():
            t.fill_(7.0)
        file.write(0, "grad", part, (False, True, False, False))
        assert file.bytes_written == file.unit + 2 * DIRECT_ALIGN and file.experts_skipped["grad"] == 3
        got = file.buffer()
        got.fill_(255)
        file.read(0, "grad", got, (True, True, False, False))
        assert file.bytes_read == 3 * DIRECT_ALIGN  # the w pages of experts 0 and 1, the page of b
        w, b, w_full = file.views(got)["w"], file.views(got)["b"], file.views(full)["w"]
        assert torch.equal(w[0], w_full[0]) and (w[1] == 7.0).all() and not w[2:].any()
        assert (b[:2] == 7.0).all() and not b[2:].any(), "expert 0's b was written with expert 1's page"
    finally:
        file.close()
