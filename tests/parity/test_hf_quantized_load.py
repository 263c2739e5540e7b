"""A model loaded with its experts quantized in memory (``--expert-format int8|int4``), from a Hugging Face
directory or a run directory: each MoE layer's experts are quantized as soon as they are read, so the
full-precision ones are held a layer at a time, and the model is the one quantizing after a whole load
gives, bit for bit."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import save_hf, save_tokenizer  # noqa: E402
from test_hf_parity import tokens  # noqa: E402

import moekit.model_dir as model_dir  # noqa: E402
import moekit.run.load as run_load  # noqa: E402
from moekit.cli import main  # noqa: E402
from moekit.convert.hf import load_hf  # noqa: E402
from moekit.convert.source import hf_source  # noqa: E402
from moekit.infer.generate import decode_step, prefill  # noqa: E402
from moekit.infer.resident_experts import QuantizedExperts, quantize_experts_, quantize_layer_experts_  # noqa: E402
from moekit.model_dir import load_for_inference  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same bf16 model as a Hugging Face directory and as a converted run."""
    root = tmp_path_factory.mktemp("quantized-load")
    model = save_hf("mixtral", root / "fp32", router_scale=3.0, intermediate_size=64)  # int4: widths of 32s
    model.to(torch.bfloat16).save_pretrained(root / "hf")
    save_tokenizer(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "run")]) == 0
    return {"hf": root / "hf", "run": root / "run"}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("source", ["hf", "run"])
def test_each_layer_is_quantized_before_the_next_one_is_read(dirs, monkeypatch, source: str, fmt: str) -> None:
    """The loader calls back once per MoE layer, after that layer's last expert tensor is read and before
    the next layer's first; by then the previous layer's full-precision expert storage is freed (weak
    references to it expired), and none is left once the load returns."""
    events: list[str] = []
    full: list[StorageWeakRef] = []

    def quantize(moe) -> None:
        gc.collect()
        assert all(ref.expired() for ref in full), "the layers before let go of their full-precision experts"
        full.extend(StorageWeakRef(t.untyped_storage()) for t in (moe.experts.w_in, moe.experts.w_out))
        events.append(f"quantized {moe.index}")
        quantize_layer_experts_(moe, fmt)

    if source == "hf":
        checkpoint, _, _ = hf_source(dirs["hf"], None)
        pieces = checkpoint.pieces

        def logged(experts: bool = True):
            for name, rows, piece in pieces(experts):
                events.append(name)
                yield name, rows, piece

        object.__setattr__(checkpoint, "pieces", logged)  # a frozen dataclass
        model = load_hf(checkpoint, for_inference=True, experts_loaded=quantize)
    else:
        copy = run_load.copy_tensor

        def logged_copy(path, entry, target):  # the real file, each tensor's read logged
            events.append(entry.name)
            copy(path, entry, target)

        monkeypatch.setattr(run_load, "copy_tensor", logged_copy)
        model = run_load.load_run(dirs["run"], for_inference=True, experts_loaded=quantize).model
    gc.collect()
    assert all(ref.expired() for ref in full) and len(full) == 6
    assert all(isinstance(moe.experts, QuantizedExperts) for moe in model.moe_layers())
    for i in range(3):
        done = events.index(f"quantized {i}")
        mine = [k for k, name in enumerate(events) if name.startswith(f"blocks.{i}.ffn.experts.")]
        later = [k for k, name in enumerate(events) if name.startswith(f"blocks.{i + 1}.ffn.experts.")]
        assert mine and max(mine) < done < min(later, default=len(events))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("source", ["hf", "run"])
def test_the_layer_by_layer_load_equals_quantizing_after_a_whole_load(dirs, source: str, fmt: str) -> None:
    """``load_for_inference(DIR, expert_format=F)`` against loading in full precision, then
    ``quantize_experts_``: the same quantized tensors, and the same prefill and decode logits, exactly.
    The loader itself (``model_dir._load``) returns every layer quantized: none is left to the fallback."""
    loaded, _ = model_dir._load(dirs[source], "cpu", None, None, fmt)
    assert all(isinstance(moe.experts, QuantizedExperts) for moe in loaded.model.moe_layers())
    streamed = load_for_inference(dirs[source], expert_format=fmt, prepack=False)[0].model
    whole = quantize_experts_(load_for_inference(dirs[source], prepack=False)[0].model, fmt)
    for a, b in zip(streamed.moe_layers(), whole.moe_layers(), strict=True):
        assert isinstance(a.experts, QuantizedExperts)
        for (name, x), (_, y) in zip(a.experts.named_buffers(), b.experts.named_buffers(), strict=True):
            assert torch.equal(x, y), name
    prompt = tokens(streamed.cfg.vocab_size, (1, 8))
    with torch.no_grad():
        (first_a, cache_a), (first_b, cache_b) = prefill(streamed, prompt), prefill(whole, prompt)
        assert torch.equal(first_a, first_b)
        token = first_a.argmax(-1, keepdim=True)
        assert torch.equal(decode_step(streamed, token, cache_a), decode_step(whole, token, cache_b))
