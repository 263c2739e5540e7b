"""moekit.stats: per-call stats reduce to a step's logged metrics (hand-computed reference)."""

from __future__ import annotations

import warnings

import pytest
import torch

from moekit.config import ModelConfig, MoEConfig
from moekit.model import Transformer
from moekit.stats import MoEStats, StepStats, merge_micro_batches


def _stats(aux: float, z: float, routed: list[int], dropped: list[int]) -> MoEStats:
    return MoEStats(
        torch.tensor(aux), torch.tensor(z), torch.tensor(0.01 * aux), torch.tensor(routed), torch.tensor(dropped), 4
    )


def test_step_stats_sum_calls_and_average_losses() -> None:
    step = StepStats()
    step.add([_stats(1.0, 0.5, [3, 1], [1, 0]), _stats(2.0, 0.0, [2, 2], [0, 0])])  # micro-batch 1, two layers
    step.add([_stats(3.0, 1.5, [4, 0], [2, 0]), _stats(2.0, 1.0, [1, 3], [0, 1])])  # micro-batch 2
    assert [load.tolist() for load in step.loads] == [[7.0, 1.0], [3.0, 5.0]]
    got = step.record()
    assert got["aux_loss"] == pytest.approx((1 + 2 + 3 + 2) / 4)
    assert got["z_loss"] == pytest.approx((0.5 + 0 + 1.5 + 1) / 4)
    assert got["dropped_frac"] == pytest.approx(4 / 16)
    assert got["load_max_over_mean"] == pytest.approx([7 / 4, 5 / 4])
    assert got["expert_load"] == [pytest.approx([7 / 8, 1 / 8]), pytest.approx([3 / 8, 5 / 8])]


def test_stats_of_a_training_forward_are_read_without_a_warning() -> None:
    aux = torch.tensor(1.0, requires_grad=True) * 2  # as a training forward returns it: part of the graph
    stats = MoEStats(aux, aux * 0, aux * 0.01, torch.tensor([3, 1]), torch.tensor([0, 0]), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = StepStats()
        step.add([stats])
        merge_micro_batches([[stats], [stats]])
    assert step.record()["aux_loss"] == 2.0


def test_merge_micro_batches_sums_counts_and_averages_losses() -> None:
    (merged,) = merge_micro_batches([[_stats(1.0, 0.5, [3, 1], [1, 0])], [_stats(3.0, 1.5, [4, 0], [2, 0])]])
    assert merged.aux_loss.item() == 2.0 and merged.z_loss.item() == 1.0
    assert merged.tokens_per_expert.tolist() == [7, 1] and merged.num_dropped == 3 and merged.num_tokens == 8


def test_moe_layers_know_their_index() -> None:
    model = Transformer(
        ModelConfig(n_layers=4, n_heads=2, d_model=16, d_ff=32, vocab_size=32, context_length=8, moe_every=2),
        MoEConfig(d_model=16, d_ff=32, num_experts=2, top_k=1),
    )
    assert [m.index for m in model.moe_layers()] == list(range(len(model.moe_layers()))) == [0, 1]
