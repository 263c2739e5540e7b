"""Every parallel layout against the single-process model with the same seed and weights (fp32).

Each rank builds the unsharded reference model too and runs it over the whole global batch (all data
ranks' micro-batches, each pipeline micro-batch separately), so the comparison needs no files.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from moekit import runconfig
from moekit.model import Transformer
from moekit.parallel.grads import clip_grad_norm
from moekit.parallel.mesh import microbatches
from moekit.parallel.runtime import ParallelModel, init_distributed
from moekit.train.optim import build_optimizer

from .spawn import run_ranks

BASE = {
    "model.n_layers": "4",
    "model.n_heads": "2",
    "model.d_model": "32",
    "model.d_ff": "64",
    "model.context_length": "16",
    "model.vocab_size": "64",
    "model.tie_embeddings": "false",
    "moe.num_experts": "4",
    "moe.top_k": "2",
    "train.batch_size": "4",
    "train.lr": "3e-3",
    "train.warmup_steps": "1",
}
STEPS = 10


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batches(cfg, n_ranks: int, steps: int):
    g = torch.Generator().manual_seed(7)
    shape = (steps, n_ranks, cfg.train.batch_size, cfg.model.context_length + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return tokens[..., :-1], tokens[..., 1:]


def _reference_step(ref, xs, ys, micro: int) -> float:
    """The single process: every data rank's batch, split into the pipeline's micro-batches."""
    lm = 0.0
    n = xs.shape[0] * micro
    for x, y in zip(xs, ys, strict=True):
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            out = ref(xm, ym)
            (out.loss / n).backward()
            lm += out.lm_loss.item() / n
    return lm


def _check(rank: int, world: int, overrides: dict[str, str]) -> None:
    cfg = runconfig.resolve("tiny", {**BASE, **overrides})
    torch.manual_seed(0)
    ref = Transformer(cfg.model, cfg.moe)
    model = copy.deepcopy(ref)
    layout, mesh = init_distributed(cfg, torch.device("cpu"))
    pm = ParallelModel(model, cfg, torch.device("cpu"), layout, mesh)
    micro = microbatches(cfg) if layout.pp > 1 else 1
    xs, ys = _batches(cfg, layout.batch_ranks, STEPS)
    b = pm.ranks.batch_rank
    where = f"[{overrides}] rank {rank}"
    # NOTE: before any forward: FSDP swaps unsharded parameters in while a forward's are gathered.
    opt, ref_opt = build_optimizer(pm.parameters(), cfg.train), build_optimizer(ref.parameters(), cfg.train)

    if pm.pipeline is None:  # the forward output itself
        with torch.no_grad():
            got, want = pm.modules[0](xs[0, b]).logits, ref(xs[0, b]).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{where} logits: {m}")

    for step in range(STEPS):
        _, lm, _ = pm.forward_backward(xs[step, b], ys[step, b], 1.0)
        got_loss = pm.mean_over_batch(pm.broadcast_from_last_stage(lm)).item()
        want_loss = _reference_step(ref, xs[step], ys[step], micro)
        pm.finish_gradients()
        if step == 0:
            assert abs(got_loss - want_loss) < 1e-5, f"{where} step-0 loss {got_loss} != {want_loss}"
            ref_params = dict(ref.named_parameters())
            for module in pm.modules:
                for name, p in module.named_parameters():
                    assert p.grad is not None, f"{where} {name} got no gradient"
                    torch.testing.assert_close(
                        _full(p.grad), ref_params[name].grad, atol=1e-5, rtol=0, msg=lambda m: f"{where} {name}: {m}"
                    )
        else:
            assert abs(got_loss - want_loss) < 1e-4, f"{where} step {step} loss {got_loss} != {want_loss}"
        pm.clip_gradients(cfg.train.grad_clip)
        clip_grad_norm(list(ref.parameters()), cfg.train.grad_clip)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)


LAYOUTS = {
    "ep2": (2, {"parallel.ep": "2"}),
    "fsdp2": (2, {"parallel.dp": "2"}),
    "tp2": (2, {"parallel.tp": "2"}),
    "ep2-overlap": (2, {"parallel.ep": "2", "parallel.overlap_chunks": "2"}),
    "ep2-capacity": (2, {"parallel.ep": "2", "moe.capacity_factor": "1.0"}),
    "ep4": (4, {"parallel.ep": "4"}),
    "ep2xdp2": (4, {"parallel.ep": "2", "parallel.dp": "2"}),
    "ep2xdp2-replicate": (4, {"parallel.ep": "2", "parallel.dp": "2", "parallel.expert_sharding": "replicate"}),
    "ep4-two-level": (4, {"parallel.ep": "4", "parallel.all_to_all": "two_level", "parallel.node_size": "2"}),
    "pp2-gpipe": (2, {"parallel.pp": "2", "parallel.pp_schedule": "gpipe"}),
    "pp2-1f1b": (2, {"parallel.pp": "2", "parallel.pp_schedule": "1f1b"}),
    "pp2-interleaved": (2, {"parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b"}),
    "pp2-looped-bfs": (2, {"parallel.pp": "2", "parallel.pp_schedule": "looped_bfs"}),
    "ep2xpp2": (4, {"parallel.ep": "2", "parallel.pp": "2"}),
}


def _check_all(rank: int, world: int, names: list[str]) -> None:
    failures = []
    for name in names:
        try:
            _check(rank, world, LAYOUTS[name][1])
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world: int, tmp_path) -> None:
    """One set of spawned ranks per world size runs every layout of that size (process start-up is
    most of the cost); a failure names each layout that differs."""
    names = [name for name, (w, _) in LAYOUTS.items() if w == world]
    run_ranks(_check_all, world, names, tmp_path=tmp_path)
