"""DeepSeek-V2 / V2-Lite / V3 against transformers itself (fp32): converted models give logits within
1e-4 and the same 32 greedy tokens, and exported ones load back in transformers with the same logits.

Tiny random models with awkward shapes: an odd vocabulary, 3 heads, expert counts that are not
powers of two, a dense first block, value heads wider than the query/key heads, and routers scaled up
(with a random selection bias on V3) so routing decides the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import randomize  # noqa: E402
from test_hf_parity import assert_routing_decides, assert_same_model, tokens  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moekit.convert import ConversionError, from_hf, to_hf  # noqa: E402
from moekit.convert.stream import open_hf  # noqa: E402

SHAPES = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=40,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=12,
    qk_nope_head_dim=10,
    qk_rope_head_dim=8,
    v_head_dim=14,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
V3 = dict(
    SHAPES, n_routed_experts=6, num_experts_per_tok=3, n_group=3, topk_group=2, n_shared_experts=2, q_lora_rank=20
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
V2_LITE = dict(SHAPES, n_routed_experts=5, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None)


def save_deepseek(family: str, directory: Path, **config) -> torch.nn.Module:
    """A randomised tiny DeepSeek model saved with ``save_pretrained``; returned in eval mode (fp32)."""
    import transformers as tf

    make = tf.DeepseekV3Config if family == "deepseek_v3" else tf.DeepseekV2Config
    model = AutoModelForCausalLM.from_config(make(**config))
    randomize(model, router_scale=6.0 if family == "deepseek_v2" else 2.0)  # sigmoids saturate sooner
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(directory)
    return model.eval()


CASES = {
    "v3": ("deepseek_v3", V3),
    "v3-halves-yarn-no-q-lora": (
        "deepseek_v3",
        dict(
            V3,
            rope_interleave=False,
            q_lora_rank=None,
            n_routed_experts=9,  # 3 per group: a group scores by its best two, not by its sum
            n_group=3,
            topk_group=2,
            routed_scaling_factor=1.7,
            rope_parameters=dict(YARN, mscale=0.9, mscale_all_dim=0.7),
        ),
    ),
    "v3-one-group-unnormalised": (
        "deepseek_v3",
        dict(V3, n_group=1, topk_group=1, norm_topk_prob=False, n_shared_experts=1, first_k_dense_replace=0),
    ),
    "v2-lite-greedy": ("deepseek_v2", dict(V2_LITE, routed_scaling_factor=1.5)),
    "v2-group-limited-yarn": (
        "deepseek_v2",
        dict(
            V2_LITE,
            q_lora_rank=16,
            n_routed_experts=9,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=3,
            topk_group=2,
            rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0),
        ),
    ),
}


def assert_sigmoid_routing_decides(ours: torch.nn.Module) -> None:
    """Every expert gets tokens, and a token's k-th pick clearly beats its next best: sigmoid scores
    saturate, so the margin is read on the logits (softmax routers: ``assert_routing_decides``)."""
    logits, stats = [], []
    hooks = [m.router.register_forward_hook(lambda _m, _i, out: logits.append(out.logits)) for m in ours.moe_layers()]
    with torch.no_grad():
        stats = ours(tokens(ours.cfg.vocab_size, (2, 24))).moe_stats
    for h in hooks:
        h.remove()
    assert all((s.tokens_per_expert > 0).all() for s in stats)
    k = ours.moe_cfg.top_k
    top = torch.cat(logits).topk(k + 1, dim=-1).values
    assert (top[:, k - 1] - top[:, k]).median() > 0.25, "routers too flat to test routing"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_converts_and_exports_exactly(case: str, tmp_path: Path) -> None:
    family, config = CASES[case]
    hf_model = save_deepseek(family, tmp_path / "hf", **config)
    ours = from_hf(tmp_path / "hf")
    assert ours.cfg.attention == "mla" and ours.cfg.moe_layers() == list(range(config["first_k_dense_replace"], 3))
    if family == "deepseek_v3":
        assert_sigmoid_routing_decides(ours)
    else:
        assert_routing_decides(ours)
    assert_same_model(hf_model, ours)
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    if n_group > 1 and (family == "deepseek_v3" or config.get("topk_method")):
        picked = []
        hooks = [m.router.register_forward_hook(lambda _m, _i, out: picked.append(out)) for m in ours.moe_layers()]
        with torch.no_grad():
            ours(tokens(ours.cfg.vocab_size, (2, 24)))
        for h in hooks:
            h.remove()
        per_group = ours.moe_cfg.num_experts // n_group
        for out in picked:
            groups_TK = out.expert_idx.view(ours.moe_cfg.top_k, -1).t() // per_group
            assert max(len(set(row)) for row in groups_TK.tolist()) <= topk_group
    assert to_hf(ours, tmp_path / "out").model_type == family
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same_model(reloaded, ours)
    again = from_hf(tmp_path / "out")
    ids = tokens(ours.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours(ids).logits)


def test_v3_selection_bias_matters(tmp_path: Path) -> None:
    """Zeroing the converted bias changes some tokens' experts: the test above would see a dropped bias."""
    save_deepseek("deepseek_v3", tmp_path / "hf", **V3)
    ours = from_hf(tmp_path / "hf")
    router = ours.moe_layers()[0].router
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_bias = router(x).expert_idx
        router.expert_bias.zero_()
        without = router(x).expert_idx
    assert not torch.equal(with_bias, without)


def test_v3_multi_token_prediction_layers_are_left_out(tmp_path: Path) -> None:
    """A V3 checkpoint with ``num_nextn_predict_layers`` stores its MTP module as one more block (plus
    its own norms and projection) in a second shard, as the released checkpoints do; conversion leaves
    exactly those tensors out, and the model is unchanged. An unknown tensor elsewhere is still an error."""
    from safetensors.torch import load_file, save_file

    hf_model = save_deepseek("deepseek_v3", tmp_path / "hf", **V3)
    main = load_file(tmp_path / "hf" / "model.safetensors")
    last = f"model.layers.{V3['num_hidden_layers'] - 1}."
    mtp = {k.replace(last, "model.layers.3."): v for k, v in main.items() if k.startswith(last)}
    mtp |= {"model.layers.3.eh_proj.weight": torch.zeros(48, 96), "model.layers.3.enorm.weight": torch.ones(48)}
    save_file(mtp, tmp_path / "hf" / "mtp.safetensors", metadata={"format": "pt"})
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "main.safetensors")
    weight_map = {k: "main.safetensors" for k in main} | {k: "mtp.safetensors" for k in mtp}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ConversionError, match="no place for: model.layers.3."):
        from_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    assert open_hf(tmp_path / "hf").skipped == sorted(mtp)
    assert_same_model(hf_model, from_hf(tmp_path / "hf"))


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("deepseek_v3", dict(num_key_value_heads=1), "num_key_value_heads=1 < num_attention_heads=3"),
        ("deepseek_v3", dict(attention_bias=True), "attention_bias=True"),
        ("deepseek_v3", dict(n_shared_experts=0), "n_shared_experts=0"),
        ("deepseek_v3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type 'linear'"),
        ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=True"),
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
    ],
)
def test_unexpressible_fields_are_named(family: str, overrides: dict, message: str, tmp_path: Path) -> None:
    """A field moekit cannot follow exactly is an error naming it, written straight into config.json
    (transformers itself may refuse to build some of these)."""
    base = V3 if family == "deepseek_v3" else V2_LITE
    save_deepseek(family, tmp_path / "hf", **base)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | overrides))
    with pytest.raises(ConversionError, match=message):
        from_hf(tmp_path / "hf")
