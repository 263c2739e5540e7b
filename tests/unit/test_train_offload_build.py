"""Offloaded experts built into their file a MoE layer at a time (``train/offload/build.py``).

Reference: a plain ``Transformer`` built whole from the same seed. Tolerance: none (bitwise) for every
parameter and buffer, the experts read back from the file (this rank's ep shard at ep = 1 and 2), and
for the generator's state after the build. The start-up's peak RSS is read from the OS in a child
process; the in-memory layouts through ``train()`` are tests/unit/test_train_offload.py's and
tests/dist/test_offload.py's (ep = 2, dp = 2, dp x ep), which compare whole runs bitwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_corpus

from moekit import runconfig
from moekit.model import Transformer
from moekit.train.loop import TrainingError, train
from moekit.train.offload import ExpertWriter

SEED = 7
# Blocks 0 and 2 dense, 1, 3 and 5 MoE (4 MoE-side draws each beside the experts': router, shared expert,
# its gate, the residual MLP and its gate), MLA attention, expert biases, untied embeddings.
EXTRAS = {
    "model.n_layers": "6",
    "model.first_dense_layers": "1",
    "model.moe_every": "2",
    "model.attention": "mla",
    "model.tie_embeddings": "false",
    "model.experts_per_layer": "[4, 4, 4]",
    "moe.router": "noisy_topk",
    "moe.router_bias": "true",
    "moe.expert_ffn_bias": "true",
    "moe.num_shared_experts": "1",
    "moe.shared_expert_gate": "true",
    "moe.residual": "true",
}


@pytest.mark.parametrize(("ep_rank", "ep"), [(0, 1), (0, 2), (1, 2)])
def test_experts_streamed_to_the_file_equal_a_model_built_whole(tmp_path: Path, ep_rank: int, ep: int) -> None:
    cfg = runconfig.resolve("tiny", {"data.path": str(tmp_path / "unused.txt"), **EXTRAS})
    torch.manual_seed(SEED)
    whole = Transformer(cfg.model, cfg.moe)
    stream_after_whole = torch.get_rng_state()
    torch.manual_seed(SEED)
    writer = ExpertWriter(tmp_path / "experts.bin", 3, "10MB", ep_rank, ep)
    model = Transformer(cfg.model, cfg.moe, expert_sink=writer)
    assert torch.equal(torch.get_rng_state(), stream_after_whole)
    file = writer.finish(model)

    experts = {id(p) for moe in whole.moe_layers() for p in moe.experts.parameters()}
    built = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        if id(p) not in experts:
            assert torch.equal(built[name], p), name
    for name, b in whole.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], b), name
    buf = file.buffer()
    for layer, moe in enumerate(whole.moe_layers()):
        n = moe.cfg.num_experts // ep
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            file.read(layer, kind, buf)
            for role, p in moe.experts.named_parameters():
                shard = p.detach()[ep_rank * n : (ep_rank + 1) * n]
                assert torch.equal(file.views(buf)[role], shard if kind == "weight" else torch.zeros_like(shard))
        for role, p in model.moe_layers()[layer].experts.named_parameters():
            assert p.shape == getattr(moe.experts, role).shape and p.untyped_storage().nbytes() == 0
    file.close()


def test_init_from_another_run_is_refused_with_a_memory_budget(tmp_path: Path) -> None:
    """``init`` would load every expert weight into RAM: refused, naming both options."""
    cfg = runconfig.resolve("tiny", {"data.path": str(tmp_path / "c.txt"), "train.memory_budget": "1MB"})
    with pytest.raises(TrainingError, match=re.escape("init=") + ".*" + re.escape("train.memory_budget='1MB'")):
        train(cfg, tmp_path / "run", init=tmp_path / "other", progress=False)


# 32 MoE layers of 16 experts, d_model 128, expert d_ff 256 (SwiGLU): 6.3 MB of expert weights per layer,
# 201 MB in all; the budget of 52 MB (the least offloading takes: 8 regions of 6.3 MB) is a quarter.
LAYERS, LAYER_BYTES, BUDGET = 32, 16 * (128 * 512 + 256 * 128) * 4, "52MB"
CHILD = """
import json, sys
from pathlib import Path
from moekit import runconfig
from moekit.train import loop

def peak():
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024

def after_setup(run, progress, on_step):
    measured["setup"] = peak()
    return loop.TrainResult(run.run_dir, 0, [], None, None)

tmp, budget, layers = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = runconfig.resolve("tiny", {
    "data.path": str(tmp / "corpus.txt"), "data.cache_dir": str(tmp / "cache"), "model.n_layers": layers,
    "model.d_model": "128", "model.d_ff": "256", "model.n_heads": "4", "moe.num_experts": "16",
    "train.memory_budget": budget, "train.sample_tokens": "0",
})
measured = {"base": peak()}
loop._steps = after_setup  # the real start-up, then the peak RSS instead of the steps
loop.train(cfg, tmp / "run", progress=False)
print(json.dumps(measured))
"""


def test_startup_never_holds_every_expert_weight(tmp_path: Path) -> None:
    """Peak RSS (the kernel's VmHWM) of a child process from before ``train()`` to the end of its start-up
    stays under a quarter of the expert weights (50 MB): a layer's drawn weight and region buffer
    (10 MB), the rest of the model (9 MB) and what the start-up imports and tokenises. A build of the
    whole model first holds all 201 MB (peak + 214 MB, measured)."""
    write_corpus(tmp_path / "corpus.txt")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), BUDGET, str(LAYERS)],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    experts = LAYERS * LAYER_BYTES
    assert experts > 200e6
    grown = measured["setup"] - measured["base"]
    assert grown < experts / 4, f"start-up peak grew by {grown / 1e6:.0f} MB, experts are {experts / 1e6:.0f} MB"
    assert not any((tmp_path / "run" / "offload").iterdir()), "the offloaded state is removed at the end"
