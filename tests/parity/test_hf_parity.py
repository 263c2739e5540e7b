"""Parity against transformers itself (fp32): logits within 1e-4 and identical greedy decoding, for
models converted from Hugging Face and for moekit models exported back and reloaded."""

from __future__ import annotations

import json
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


def assert_same_model(hf_model: torch.nn.Module, ours: torch.nn.Module) -> float:
    """Same logits on a batch of random tokens, and the same 32 greedy tokens; returns the largest logit gap."""
    ids = tokens(ours.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        expected, got = hf_model(ids).logits, ours(ids).logits
    gap = (expected - got).abs().max().item()
    assert gap < TOL
    prompt = ids[:1, :8]
    assert torch.equal(hf_greedy(hf_model, prompt, NEW_TOKENS), generate(ours, prompt, NEW_TOKENS, temperature=0))
    return gap


def assert_routing_decides(ours: torch.nn.Module) -> None:
    """Every expert of every MoE block gets tokens, and a token's first pick clearly outweighs its last."""
    ids = tokens(ours.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        stats = ours(ids).moe_stats
    for s in stats:
        assert (s.tokens_per_expert > 0).all(), s.tokens_per_expert
    probs = []
    hook = [m.router.register_forward_hook(lambda _m, _i, out: probs.append(out.probs)) for m in ours.moe_layers()]
    with torch.no_grad():
        ours(ids)
    for h in hook:
        h.remove()
    k = ours.moe_cfg.top_k
    top = torch.cat(probs).topk(k, dim=-1).values
    assert (top[:, 0] / top[:, -1]).median() > 2, "routers too flat to test routing"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_families_convert_exactly(family: str, tmp_path: Path) -> None:
    hf_model = save_hf(family, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert ours.moe_layers(), "converted into MoE blocks"
    assert_same_model(hf_model, ours)


def test_mixtral_renormalises_whatever_norm_topk_prob_says(tmp_path: Path) -> None:
    """transformers' Mixtral router always renormalises its top-k weights; a stray norm_topk_prob changes nothing."""
    hf_model = save_hf("mixtral", tmp_path / "hf", router_scale=4.0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"norm_topk_prob": False}))
    ours = from_hf(tmp_path / "hf")
    assert ours.moe_cfg.normalize_topk
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
    with pytest.raises(ConversionError, match="llama: attention_bias=True"):
        from_hf(tmp_path / "bias")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConversionError, match="model_type 'gpt2' is not supported"):
        from_hf(tmp_path / "gpt2")
    with pytest.raises(ConversionError, match="no config.json|no model.safetensors"):
        from_hf(tmp_path / "missing")


@pytest.mark.parametrize(
    "overrides",
    [
        dict(shared_expert_intermediate_size=40),  # not a multiple of moe_intermediate_size=24
        dict(shared_expert_intermediate_size=0),  # no shared expert: transformers keeps one of width 0
        dict(qkv_bias=False),
    ],
    ids=["shared40", "shared0", "no_qkv_bias"],
)
def test_qwen2_moe_variants_convert_and_export(overrides: dict, tmp_path: Path) -> None:
    """Tiny Qwen2-MoE models with sharp routers: converted, then exported and reloaded by transformers."""
    hf_model = save_hf("qwen2_moe", tmp_path / "hf", router_scale=4.0, moe_intermediate_size=24, **overrides)
    ours = from_hf(tmp_path / "hf")
    shared = overrides.get("shared_expert_intermediate_size", 48)
    assert ours.moe_cfg.shared_hidden == shared and ours.cfg.qkv_bias == overrides.get("qkv_bias", True)
    assert_routing_decides(ours)
    assert_same_model(hf_model, ours)
    assert to_hf(ours, tmp_path / "out").model_type == "qwen2_moe"
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["moe_intermediate_size"] == 24 and exported["shared_expert_intermediate_size"] == shared
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same_model(reloaded, ours)
    assert_same_model(hf_model, from_hf(tmp_path / "out"))


def test_qkv_bias_exports_as_qwen2_moe(tmp_path: Path) -> None:
    """q/k/v biases need Qwen2-MoE (Mixtral has none): routed experts only, its shared expert of width 0."""
    from moekit.config import ModelConfig, MoEConfig
    from moekit.model import Transformer

    torch.manual_seed(0)
    model_cfg = ModelConfig(
        vocab_size=80, context_length=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48, qkv_bias=True
    )
    ours = Transformer(model_cfg, MoEConfig(d_model=32, d_ff=24, num_experts=4, top_k=2)).eval()
    with torch.no_grad():
        for block in ours.blocks:
            block.attn.qkv.bias.normal_(std=0.5)
            block.ffn.router.gate.weight.mul_(8)
    assert_routing_decides(ours)
    assert to_hf(ours, tmp_path / "out").model_type == "qwen2_moe"
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["qkv_bias"] and exported["shared_expert_intermediate_size"] == 0
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)
    again = from_hf(tmp_path / "out")
    assert again.moe_cfg.num_shared_experts == 0
    ids = tokens(80, (2, 24))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours(ids).logits)


def test_checkpoint_and_config_must_agree_on_biases(tmp_path: Path) -> None:
    """A bias transformers would ignore (config says none) or initialise at random (missing) is an error."""
    save_hf("qwen2_moe", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"qkv_bias": False}))
    with pytest.raises(ConversionError, match="no place for: .*_proj.bias"):
        from_hf(tmp_path / "hf")
    save_hf("qwen2_moe", tmp_path / "plain", qkv_bias=False)
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config | {"qkv_bias": True}))
    with pytest.raises(ConversionError, match="q_proj.bias is missing"):
        from_hf(tmp_path / "plain")


def test_shared_experts_of_their_own_width_export(tmp_path: Path) -> None:
    """Two shared experts of width 20 (routed experts: 24) become Qwen2-MoE's one shared expert of width 40."""
    from moekit.config import ModelConfig, MoEConfig
    from moekit.model import Transformer

    torch.manual_seed(0)
    model_cfg = ModelConfig(vocab_size=80, context_length=64, n_layers=2, n_heads=4, d_model=32, d_ff=48)
    moe = MoEConfig(d_model=32, d_ff=24, num_experts=4, top_k=2, num_shared_experts=2, shared_d_ff=20)
    ours = Transformer(model_cfg, moe).eval()
    assert ours.blocks[0].ffn.shared.w_in.weight.shape == (40, 32)
    to_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["shared_expert_intermediate_size"] == 40
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)
    with pytest.raises(ValueError, match="shared_d_ff=0: must be a positive integer"):
        MoEConfig(d_model=32, d_ff=24, num_shared_experts=1, shared_d_ff=0)
    with pytest.raises(ValueError, match="shared_d_ff=8: needs num_shared_experts > 0"):
        MoEConfig(d_model=32, d_ff=24, shared_d_ff=8)
