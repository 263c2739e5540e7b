"""Parity against transformers itself (fp32): logits within 1e-4 and identical greedy decoding, for
models converted from Hugging Face and for moekit models exported back and reloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import hf_greedy, save_hf  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moekit.convert import ConversionError, from_hf, to_hf  # noqa: E402
from moekit.infer.generate import generate  # noqa: E402

TOL = 1e-4  # fp32: both sides compute the same function, in a different order
NEW_TOKENS = 32


def tokens(vocab: int, shape: tuple[int, int], seed: int = 1) -> torch.Tensor:
    return torch.randint(vocab, shape, generator=torch.Generator().manual_seed(seed))


def assert_same_model(hf_model: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Same logits on a batch of random tokens, and the same 32 greedy tokens."""
    ids = tokens(ours.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        expected, got = hf_model(ids).logits, ours(ids).logits
    assert (expected - got).abs().max().item() < TOL
    prompt = ids[:1, :8]
    assert torch.equal(hf_greedy(hf_model, prompt, NEW_TOKENS), generate(ours, prompt, NEW_TOKENS, temperature=0))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_families_convert_exactly(family: str, tmp_path: Path) -> None:
    hf_model = save_hf(family, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert ours.moe_layers(), "converted into MoE blocks"
    assert_same_model(hf_model, ours)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = save_hf("mixtral", tmp_path / "hf", shard_size="40KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    ours = from_hf(tmp_path / "hf")
    ids = tokens(ours.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        assert (hf_model(ids).logits - ours(ids).logits).abs().max().item() < TOL


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_dense_families_convert_exactly(family: str, tmp_path: Path) -> None:
    hf_model = save_hf(family, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    ids = tokens(ours.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        assert (hf_model(ids).logits - ours(ids).logits).abs().max().item() < TOL


def test_qwen2_moe_dense_blocks_and_sparse_step(tmp_path: Path) -> None:
    hf_model = save_hf("qwen2_moe", tmp_path / "hf", decoder_sparse_step=2, num_hidden_layers=4)
    ours = from_hf(tmp_path / "hf")
    assert ours.cfg.moe_layers() == [1, 3]
    ids = tokens(ours.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        assert (hf_model(ids).logits - ours(ids).logits).abs().max().item() < TOL


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_export_reloads_in_transformers(family: str, tmp_path: Path) -> None:
    save_hf(family, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert to_hf(ours, tmp_path / "out").model_type == family
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)


def test_native_models_export(tmp_path: Path) -> None:
    """moekit's own defaults (tied embeddings, torch's norm eps) as Mixtral; shared experts as Qwen2-MoE."""
    from moekit.config import ModelConfig, MoEConfig
    from moekit.model import Transformer

    torch.manual_seed(0)
    model_cfg = ModelConfig(vocab_size=80, context_length=64, n_layers=2, n_heads=4, d_model=32, d_ff=48)
    for shared, family in ((0, "mixtral"), (1, "qwen2_moe")):
        moe = MoEConfig(d_model=32, d_ff=24, num_experts=4, top_k=2, num_shared_experts=shared)
        ours = Transformer(model_cfg, moe).eval()
        assert to_hf(ours, tmp_path / family).model_type == family
        assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / family).eval(), ours)


def test_unsupported_inputs_name_the_problem(tmp_path: Path) -> None:
    save_hf("olmoe", tmp_path / "olmoe")
    with pytest.raises(ConversionError, match="model.qk_norm=True does not fit"):
        to_hf(from_hf(tmp_path / "olmoe"), tmp_path / "out")
    save_hf("llama", tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(ConversionError, match="llama: hidden_act 'gelu'"):
        from_hf(tmp_path / "gelu")
    save_hf("llama", tmp_path / "bias", attention_bias=True)
    with pytest.raises(ConversionError, match="no place for: .*o_proj.bias"):
        from_hf(tmp_path / "bias")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConversionError, match="model_type 'gpt2' is not supported"):
        from_hf(tmp_path / "gpt2")
    with pytest.raises(ConversionError, match="no config.json|no model.safetensors"):
        from_hf(tmp_path / "missing")
