"""Rotary position embedding: the frequency table (plain or YaRN-extended) and the rotation.

Legend: L sequence length, d rotated dims per head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moekit.config import ModelConfig


def rope_frequencies(head_dim: int, max_len: int, theta: float) -> Tensor:
    """``e^(i * position * theta^(-2j/head_dim))`` as complex64 ``[max_len, head_dim / 2]``."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def yarn_gain(factor: float, mscale: float) -> float:
    """YaRN's attention gain ``0.1 * mscale * ln(factor) + 1`` (1 when nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(cfg: ModelConfig) -> Tensor:
    """YaRN (Peng et al. 2023), as DeepSeek-V2/V3 extend their context: ``[context_length, d / 2]``.

    Dims that turn fewer than ``beta_slow`` times over the original context are interpolated
    (wavelength times ``factor``), those turning more than ``beta_fast`` times keep their frequency,
    with a linear ramp between. The table's magnitude is the gain left on the rotated query and key
    dims: ``yarn_gain(mscale) / yarn_gain(mscale_all_dim)``; MLA puts the rest on its softmax scale.
    """
    dim, base, factor = cfg.rope_dim, cfg.rope_theta, cfg.rope_yarn_factor
    original = cfg.rope_yarn_original_context or cfg.context_length / factor

    def dim_turning(turns: float) -> float:  # the dim whose wavelength fits `turns` times in the context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_turning(cfg.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(dim_turning(cfg.rope_yarn_beta_slow)), dim - 1)
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    inv_freq = (1 / (factor * wavelengths)) * ramp + (1 / wavelengths) * (1 - ramp)
    angles = torch.outer(torch.arange(cfg.context_length, dtype=torch.float32), inv_freq)
    gain = yarn_gain(factor, cfg.rope_yarn_mscale) / yarn_gain(factor, cfg.rope_yarn_mscale_all_dim)
    return torch.polar(torch.full_like(angles, gain), angles)


def model_rope(cfg: ModelConfig) -> Tensor:
    """The frequency table a model of ``cfg`` rotates its queries and keys by."""
    if cfg.rope_yarn_factor > 1:
        return yarn_frequencies(cfg)
    return rope_frequencies(cfg.rope_dim, cfg.context_length, cfg.rope_theta)


def apply_rope(x_BLNd: Tensor, freqs_Ld2: Tensor) -> Tensor:
    """Rotate pairs (x[2j], x[2j+1]) by position-dependent angles (Su et al. 2021); any number of
    head dimensions may sit between L and d.

    NOTE: one complex multiply instead of the cos/sin form: on small CPU batches the four real
    multiplies and a stack, with their backward, cost three times as much.
    """
    pairs = torch.view_as_complex(x_BLNd.float().unflatten(-1, (-1, 2)))
    freqs = freqs_Ld2.view(freqs_Ld2.shape[0], *[1] * (x_BLNd.dim() - 3), -1)
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x_BLNd)
