"""Loading a run refuses a checkpoint that does not fit the run's config, naming the keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny

from moekit.run.layout import CheckpointError
from moekit.run.load import load_run
from moekit.train.loop import train


def test_checkpoint_of_another_shape_names_keys(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2"}), run, progress=False)
    cfg = json.loads((run / "config.json").read_text())
    cfg["moe"]["num_experts"] = 8
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_run(run)


@pytest.mark.parametrize("for_inference", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_loads_the_weights_safetensors_reads(write_run, tmp_path: Path, dtype: str, for_inference: bool) -> None:
    """Every state tensor equals what the safetensors library reads from the file (its own reader, not
    ours), a tied head included, whether read into place or copied into inference's 16-bit expert layout."""
    import torch
    from safetensors.torch import load_file

    from moekit.run.layout import MODEL_FILE, latest_checkpoint

    run = write_run(tmp_path / "run", **{"model.tie_embeddings": "true"})
    model = load_run(run, dtype=getattr(torch, dtype), for_inference=for_inference).model
    stored = load_file(str(latest_checkpoint(run) / MODEL_FILE))
    state = model.state_dict()
    assert set(stored) <= set(state) and model.lm_head.weight is model.embed.weight
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name
    if for_inference and dtype == "bfloat16":
        w = model.moe_layers()[0].experts.w_in
        assert not w.is_contiguous(), "the 16-bit experts output-major: copied, not read into place"


def test_a_checkpoint_with_a_missing_or_an_unknown_tensor_names_it(write_run, tmp_path: Path) -> None:
    """The loader itself (``load_run`` would first refuse the edited file's checksum)."""
    import torch
    from safetensors.torch import load_file, save_file

    from moekit.model import Transformer
    from moekit.run.layout import MODEL_FILE, latest_checkpoint
    from moekit.run.load import load_model_weights
    from moekit.runconfig import from_json

    run = write_run(tmp_path / "run")
    cfg = from_json(run / "config.json")
    path = latest_checkpoint(run)
    stored = load_file(str(path / MODEL_FILE))
    save_file({**stored, "blocks.9.extra": stored["norm.weight"].clone()}, str(path / MODEL_FILE))
    with pytest.raises(CheckpointError, match=r"does not fit this model \(unexpected \['blocks.9.extra'\]\)"):
        load_model_weights(path, Transformer(cfg.model, cfg.moe))
    del stored["norm.weight"]
    save_file(stored, str(path / MODEL_FILE))
    with pytest.raises(CheckpointError, match=r"does not fit this model \(missing \['norm.weight'\]\)"):
        load_model_weights(path, Transformer(cfg.model, cfg.moe))
    stored["norm.weight"] = torch.ones(3)
    save_file(stored, str(path / MODEL_FILE))
    with pytest.raises(CheckpointError, match=r"norm.weight is \[3\], the model's \[32\]"):
        load_model_weights(path, Transformer(cfg.model, cfg.moe))


_PEAK = """
import sys
from pathlib import Path
from moekit.run.load import load_run
def rss_mb(field):
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith(field)) / 1024
before = rss_mb("VmRSS:")
model = load_run(Path(sys.argv[1])).model
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
print(weights, rss_mb("VmHWM:") - before)
"""


@pytest.mark.slow
def test_loading_a_run_holds_its_weights_once(write_run, tmp_path: Path) -> None:
    """Peak RSS over a load, from the OS (VmHWM), in a process of its own: the weights once plus less than
    half of them again (a whole checkpoint mapped, or read into a dict before the model, held twice)."""
    import subprocess
    import sys

    big = {"model.d_model": "512", "moe.d_ff": "1024", "model.n_heads": "8", "moe.num_experts": "8"}
    run = write_run(tmp_path / "run", **big)
    out = subprocess.run([sys.executable, "-c", _PEAK, str(run)], capture_output=True, text=True, check=True)
    weights, grew = map(float, out.stdout.split())
    print(f"{weights:.0f} MB of weights, peak grew {grew:.0f} MB")
    assert weights > 150, "large enough to stand out of the process's own noise"
    assert grew < 1.5 * weights, f"peak grew {grew:.0f} MB for {weights:.0f} MB of weights"
