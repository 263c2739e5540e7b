"""Rotary position embeddings: the per-position rotations, plain or YaRN-scaled, and their application.

Legend: L positions, N heads (any number of head dims), d head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moekit.config import ModelConfig


def inverse_frequencies(head_dim: int, theta: float) -> Tensor:
    """``theta^(-2j/head_dim)`` for j < head_dim / 2, fp32."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def yarn_inverse_frequencies(cfg: ModelConfig) -> Tensor:
    """YaRN's NTK-by-parts frequencies (Peng et al. 2023): dimensions that turn fewer than
    ``rope_beta_slow`` times over the original context are divided by ``rope_factor``
    (interpolated), those turning more than ``rope_beta_fast`` times are kept, a linear ramp between.
    """
    dim, base = cfg.rope_dim, cfg.rope_theta

    def dimension(rotations: float) -> float:  # the dimension that turns this many times over the context
        return dim * math.log(cfg.rope_original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(cfg.rope_beta_fast), dimension(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = inverse_frequencies(dim, base)
    return kept / cfg.rope_factor * ramp + kept * (1 - ramp)


def yarn_gain(factor: float, mscale: float) -> float:
    """YaRN's attention gain ``0.1 * mscale * ln(factor) + 1`` (1 when nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """The scale YaRN puts on cos and sin (so on queries and keys alike): given, or
    ``yarn_gain(rope_mscale) / yarn_gain(rope_mscale_all_dim)``, which is ``0.1 ln(factor) + 1`` unless
    DeepSeek's mscales are set (MLA puts the ``rope_mscale_all_dim`` gain on its softmax scale instead).
    """
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    return yarn_gain(cfg.rope_factor, cfg.rope_mscale) / yarn_gain(cfg.rope_factor, cfg.rope_mscale_all_dim)


def rope_frequencies(head_dim: int, max_len: int, theta: float) -> Tensor:
    """``e^(i * position * theta^(-2j/head_dim))`` as complex64 ``[max_len, head_dim / 2]``."""
    return _rotations(inverse_frequencies(head_dim, theta), max_len, 1.0)


def rope_table(cfg: ModelConfig) -> Tensor:
    """The model's rotations ``[context_length, rope_dim / 2]`` (complex64): rope_dim is the head size,
    or MLA's ``qk_rope_head_dim``. YaRN's attention factor is their magnitude, so the one complex
    multiply applies it."""
    if cfg.rope_scaling == "yarn":
        return _rotations(yarn_inverse_frequencies(cfg), cfg.context_length, yarn_attention_factor(cfg))
    return rope_frequencies(cfg.rope_dim, cfg.context_length, cfg.rope_theta)


def _rotations(inv_freq: Tensor, max_len: int, magnitude: float) -> Tensor:
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.polar(torch.full_like(angles, magnitude), angles)


def apply_rope(x_BLNd: Tensor, freqs_Ld2: Tensor) -> Tensor:
    """Rotate pairs (x[2j], x[2j+1]) by position-dependent angles (Su et al. 2021); any number of
    head dimensions may sit between L and d.

    NOTE: one complex multiply instead of the cos/sin form: on small CPU batches the four real
    multiplies and a stack, with their backward, cost three times as much.
    """
    pairs = torch.view_as_complex(x_BLNd.float().unflatten(-1, (-1, 2)))
    freqs = freqs_Ld2.view(freqs_Ld2.shape[0], *[1] * (x_BLNd.dim() - 3), -1)
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x_BLNd)
