"""Block-quantised FP8 checkpoints (as DeepSeek-V3, Kimi-K2 and Qwen3-FP8 are released) convert to the
model that the dequantised weights define.

The test quantises a tiny random transformers model itself (e4m3 weights, one fp32 ``weight_scale_inv``
per 16 x 16 block, ragged edges included) and dequantises each block with a plain loop into a second,
unquantised directory; transformers' model loaded from that one is the reference that moekit's
conversion of the FP8 directory must match in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers: pip install -e '.[test]'")
from hf_models import save_hf  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_hf_deepseek import V3, save_deepseek  # noqa: E402
from test_hf_parity import assert_same_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moekit.convert import ConversionError, from_hf  # noqa: E402
from moekit.convert.stream import open_hf  # noqa: E402

ROWS, COLS = 16, 8  # a block of the weight's rows x columns; unequal, so the order of the two counts


def quantize_dir(directory: Path, reference: Path) -> torch.nn.Module:
    """Rewrite ``directory`` as a block-FP8 checkpoint; return transformers' model of the dequantised
    weights (saved unquantised to ``reference`` and loaded from there)."""
    shutil.copytree(directory, reference)
    tensors = load_file(directory / "model.safetensors")
    out, plain = {}, dict(tensors)
    for key, w in tensors.items():
        if not (key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight")) or w.dim() != 2:
            out[key] = w
            continue
        rows, cols = w.shape
        grid = torch.empty((rows + ROWS - 1) // ROWS, (cols + COLS - 1) // COLS)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        dequantized = torch.empty(rows, cols)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                rows_ij, cols_ij = slice(i * ROWS, (i + 1) * ROWS), slice(j * COLS, (j + 1) * COLS)
                block = w[rows_ij, cols_ij]
                scale = block.abs().max() / 448.0  # e4m3's largest finite value
                grid[i, j] = scale
                q_block = (block / scale).to(torch.float8_e4m3fn)
                q[rows_ij, cols_ij] = q_block
                dequantized[rows_ij, cols_ij] = q_block.float() * scale
        out[key], out[key + "_scale_inv"], plain[key] = q, grid, dequantized
    save_file(out, directory / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [ROWS, COLS]}
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    return AutoModelForCausalLM.from_pretrained(reference).eval()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_fp8_checkpoint_converts_to_its_dequantised_model(family: str, tmp_path: Path) -> None:
    if family == "deepseek_v3":
        original = save_deepseek(family, tmp_path / "hf", **V3)
    else:
        original = save_hf(family, tmp_path / "hf", router_scale=4.0, vocab_size=97)
    reference = quantize_dir(tmp_path / "hf", tmp_path / "dequantized")
    assert open_hf(tmp_path / "hf").dtype == torch.bfloat16  # the default: the precision it was trained in
    ours = from_hf(tmp_path / "hf", torch.float32)
    assert_same_model(reference, ours)
    ids = torch.arange(24).unsqueeze(0) % 97
    with torch.no_grad():  # quantisation did change the weights: the match above is not the original's
        assert not torch.allclose(original(ids).logits, ours(ids).logits, atol=1e-4)


def test_fp8_errors_name_what_is_wrong(tmp_path: Path) -> None:
    save_hf("qwen3_moe", tmp_path / "hf", vocab_size=97)
    quantize_dir(tmp_path / "hf", tmp_path / "dequantized")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ConversionError, match="quantization_config .*awq"):
        from_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="q_proj.weight has no model.layers.0.self_attn.q_proj.weight_scale_inv"):
        from_hf(tmp_path / "hf")
