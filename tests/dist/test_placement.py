"""Expert placement on 4 gloo ranks: live re-placement and shadow experts change where experts run,
never what they compute. Reference: the same run with plain expert parallelism (fp32, tolerance 1e-5)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moekit import runconfig
from moekit.model import Transformer
from moekit.parallel.runtime import ParallelModel, init_distributed
from moekit.train import loop
from moekit.train.optim import build_optimizer
from moekit.train.step import train_step

from .spawn import MOEKIT, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 8
BASE = {
    "model.n_layers": "2",
    "model.n_heads": "2",
    "model.d_model": "32",
    "model.d_ff": "32",
    "moe.d_ff": "8",  # small experts: replicating the popular ones costs less than sending their tokens
    "model.context_length": "16",
    "model.tie_embeddings": "false",
    "moe.num_experts": "8",
    "moe.top_k": "2",
    "moe.bias_update_rate": "1e-9",  # the router uses its selection bias: set below to a fixed skew
    "train.batch_size": "4",
    "train.lr": "3e-3",
    "train.warmup_steps": "1",
    "train.steps": str(STEPS),
    "data.tokenizer": "byte",
    "parallel.ep": "4",
}
SKEW = torch.tensor([0.3, 0.25, 0.05, 0.03, 0.0, 0.0, 0.0, 0.0])  # experts 0-1 (rank 0), then 2-3 (rank 1) popular


def _model(cfg) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    for moe in model.moe_layers():
        moe.router.expert_bias.copy_(SKEW)
    return model


def _run(cfg, corpus, model: Transformer) -> tuple[list[dict], dict[str, torch.Tensor] | None]:
    """``STEPS`` real training steps (the loop's own step function); records and the final weights."""
    layout, mesh = init_distributed(cfg, torch.device("cpu"))
    pm = ParallelModel(model, cfg, torch.device("cpu"), layout, mesh)
    opt = build_optimizer(pm.named_parameters(), cfg.train)
    records = [train_step(pm, opt, corpus, cfg, torch.device("cpu"), s, None) for s in range(STEPS)]
    weights = _full({n: p.detach() for n, p in pm.full_model.named_parameters()})
    for name, slots in pm.expert_slots().items():  # re-placed experts' rows back in expert order
        weights[name] = weights[name][torch.tensor(slots)]
    return records, weights


def _full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in tensors.items()}


def _same_runs(rank: int, world: int, text: Path, cache: Path) -> None:
    plain_cfg = runconfig.resolve("tiny", {**BASE, "data.path": str(text), "data.cache_dir": str(cache)})
    init_distributed(plain_cfg, torch.device("cpu"))
    corpus = loop._prepare_corpus_once(plain_cfg, rank == 0, True, None)
    model = _model(plain_cfg)
    plain, plain_weights = _run(plain_cfg, corpus, copy.deepcopy(model))
    assert all(r["placement_moves"] == 0 and r["shadow_experts"] == 0 for r in plain)
    assert plain[0]["rank_imbalance"] > 1.5, f"the router is not skewed: {plain[0]['rank_imbalance']}"
    for name, extra in {
        "live placement": {"parallel.placement_every": "2", "parallel.placement_min_gain": "0"},
        "shadow experts": {"parallel.placement_every": "2", "parallel.shadow_experts": "2"},
    }.items():
        cfg = runconfig.resolve(
            "tiny", {**BASE, "data.path": str(text), "data.cache_dir": str(cache), **{k: v for k, v in extra.items()}}
        )
        records, weights = _run(cfg, corpus, copy.deepcopy(model))
        if name == "live placement":
            assert sum(r["placement_moves"] for r in records) > 0, f"{name}: nothing was re-placed"
            assert records[-1]["rank_imbalance"] < plain[-1]["rank_imbalance"], f"{name}: no better balanced"
            assert sum(r["placement_bytes"] for r in records) > 0
        else:
            assert any(r["shadow_experts"] for r in records), f"{name}: no expert was shadowed"
        for step, (got, want) in enumerate(zip(records, plain, strict=True)):
            assert abs(got["loss"] - want["loss"]) < 1e-5, f"{name} step {step}: loss {got['loss']} != {want['loss']}"
            assert got["expert_load"] == want["expert_load"], f"{name} step {step}: routing differs"
        if rank == 0:
            assert weights is not None and plain_weights is not None
            for key, want in plain_weights.items():
                torch.testing.assert_close(weights[key], want, atol=1e-5, rtol=0, msg=lambda m: f"{name} {key}: {m}")


def _same_gradients(rank: int, world: int) -> None:
    """One step's gradients with two shadowed experts (one moved first) equal plain EP's."""
    cfg = runconfig.resolve("tiny", BASE)
    model = _model(cfg)
    layout, mesh = init_distributed(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=g)
    grads = []
    for shadowed in (False, True):
        pm = ParallelModel(copy.deepcopy(model), cfg, torch.device("cpu"), layout, mesh)
        assert pm.rebalancer is not None
        if shadowed:
            for moe in pm.moe_layers():
                slots = list(range(8))
                slots[0], slots[7] = slots[7], slots[0]  # expert 0 now runs on rank 3
                pm.rebalancer.move(moe, tuple(slots), None)
                pm.rebalancer.set_shadows(moe, (0, 2))
            assert pm.rebalancer.refresh_shadows() > 0
        pm.forward_backward(x[:, :-1], x[:, 1:], 1.0)
        pm.finish_gradients()
        full = _full({n: p.grad for n, p in pm.full_model.named_parameters()})
        for name, moe in pm.full_model.named_modules():
            if moe in pm.moe_layers():  # rows are slots: back to expert order
                slots = torch.tensor(pm.rebalancer._layer(moe).slots)
                for key in (f"{name}.experts.w_in", f"{name}.experts.w_out"):
                    full[key] = full[key][slots]
        grads.append(full)
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _both(rank: int, world: int, text: Path, cache: Path) -> None:
    _same_gradients(rank, world)
    _same_runs(rank, world, text, cache)


def test_placement_and_shadows_keep_gradients_and_losses(tmp_path: Path) -> None:
    """One set of 4 ranks (start-up is most of the cost): shadow gradients, then three 8-step runs."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    run_ranks(_both, 4, text, tmp_path / "cache", tmp_path=tmp_path, preload=MOEKIT)
