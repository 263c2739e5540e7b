"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one low-rank latent per
token, which is all the inference cache keeps.

Legend: B batch, L new tokens, S cached tokens, H heads, R kv_lora_rank, P qk_rope_head_dim,
N qk_nope_head_dim, V v_head_dim.

Per token, ``kv_down`` makes the latent ``c`` (R wide, RMS-normalised) and one RoPE key part ``k_rope``
(P wide, shared by all heads); ``kv_up`` expands ``c`` into each head's key part ``k_nope`` (N) and
value (V). Queries come from a rank-``q_lora_rank`` bottleneck (or one projection when it is 0) and
split into N dims without RoPE and P with. Training and prefill expand the latent (the naive form);
decode keeps it compressed (the absorbed form): the key expansion ``W_UK`` is folded into the query,
``q_nope @ W_UK`` scores directly against ``c``, and the value expansion ``W_UV`` is applied after
the attention-weighted sum of latents, so a step reads R + P numbers per cached token instead of
H * (N + P + V).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.config import ModelConfig
from moekit.model.rope import apply_rope, yarn_gain

LATENT_NORM_EPS = 1e-6  # DeepSeek's latent norms keep their own eps whatever the model's norms use


class LatentAttention(Protocol):
    """MLA's attention of queries ``[B, L, H, N + P]`` over latents ``[B, S, R + P]`` under ``mask``
    (None: causal), before the output projection: ``[B, L, H * V]``. ``fresh``: nothing was cached
    before these queries' keys (expanding them then costs less than absorbing)."""

    def __call__(self, q_BLHx: Tensor, latent_BSX: Tensor, mask: Tensor | None, fresh: bool) -> Tensor: ...


class Cache(Protocol):
    """What MLA needs of a cache: its latent rows (``KVCache``, or the paged ``moekit.serve.kv.PagedStep``),
    or, ``mla_expanded``, the per-head keys and values of ``KVCache``."""

    mla_expanded: bool

    def attend_latent(self, layer: int, q_BLHx: Tensor, latent_BLX: Tensor, attention: LatentAttention) -> Tensor:
        """Cache the step's latents ``[B, L, R + P]``, then ``attention`` over every latent each query sees."""

    # The expanded form's (``KVCache`` alone):
    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def attention_mask(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor | None: ...


class MLA(nn.Module):
    """Causal multi-head latent attention; ``forward`` has ``Attention``'s signature."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.attention == "mla" and cfg.kv_lora_rank and cfg.qk_rope_head_dim
        self.heads, self.rank = cfg.n_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_width = cfg.n_heads * (self.nope + self.rope)
        self.q_lora = cfg.q_lora_rank > 0
        if self.q_lora:
            self.q_down = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_up = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.d_model, q_width, bias=False)
        self.kv_down = nn.Linear(cfg.d_model, self.rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.kv_up = nn.Linear(self.rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.out = nn.Linear(cfg.n_heads * self.v_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout
        # NOTE: YaRN's gain for all dims (mscale_all_dim) sits on the softmax scale, squared, as in
        # DeepSeek's code; the rest of it is the RoPE table's magnitude.
        yarn = cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim
        gain = yarn_gain(cfg.rope_factor, cfg.rope_mscale_all_dim) if yarn else 1.0
        self.scale = (self.nope + self.rope) ** -0.5 * gain**2

    def forward(self, x_BLD: Tensor, freqs: Tensor, cache: Cache | None, layer: int) -> Tensor:
        B, L, _ = x_BLD.shape
        q = self.q_up(self.q_norm(self.q_down(x_BLD))) if self.q_lora else self.q_proj(x_BLD)
        q_nope, q_rope = q.view(B, L, self.heads, -1).split([self.nope, self.rope], dim=-1)
        c_BLR, k_rope = self.kv_down(x_BLD).split([self.rank, self.rope], dim=-1)
        latent_BLX = torch.cat([self.kv_norm(c_BLR), apply_rope(k_rope, freqs)], dim=-1)  # [B, L, R + P]
        q_rope = apply_rope(q_rope, freqs)
        if cache is None:
            return self.out(self._naive(q_nope, q_rope, latent_BLX, None))
        if cache.mla_expanded:
            k, v = self._expand(latent_BLX)
            k_all, v_all = cache.append(layer, k.transpose(1, 2), v.transpose(1, 2))
            mask = cache.attention_mask(L, k_all.shape[2], x_BLD.device)
            return self.out(self._attend(q_nope, q_rope, k_all, v_all, mask))
        q_BLHx = torch.cat([q_nope, q_rope], dim=-1)
        return self.out(cache.attend_latent(layer, q_BLHx, latent_BLX, self._over_latents))

    def _over_latents(self, q_BLHx: Tensor, latent_BSX: Tensor, mask: Tensor | None, fresh: bool) -> Tensor:
        """``LatentAttention``: the naive form for a prefill from nothing, else the absorbed one."""
        q_nope, q_rope = q_BLHx.split([self.nope, self.rope], dim=-1)
        if fresh:  # expanding the new latents costs less than absorbing into as many queries
            return self._naive(q_nope, q_rope, latent_BSX, mask)
        return self._absorbed(q_nope, q_rope, latent_BSX, mask)

    def _expand(self, latent_BSX: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys ``[B, S, H, N + P]`` and values ``[B, S, H, V]`` from the latents."""
        B, S, _ = latent_BSX.shape
        c, k_rope = latent_BSX.split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_up(c).view(B, S, self.heads, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.heads, -1)], dim=-1)
        return k, v

    def _naive(self, q_nope: Tensor, q_rope: Tensor, latent_BSX: Tensor, mask: Tensor | None) -> Tensor:
        k, v = self._expand(latent_BSX)
        return self._attend(q_nope, q_rope, k.transpose(1, 2), v.transpose(1, 2), mask)

    def _attend(self, q_nope: Tensor, q_rope: Tensor, k_BHSd: Tensor, v_BHSV: Tensor, mask: Tensor | None) -> Tensor:
        B, L = q_nope.shape[:2]
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        causal = mask is None and L > 1  # one query (a decode step) sees every key: SDPA's is_causal would hide them
        y = F.scaled_dot_product_attention(
            q, k_BHSd, v_BHSV, attn_mask=mask, is_causal=causal, dropout_p=dropout, scale=self.scale
        )
        return y.transpose(1, 2).reshape(B, L, -1)

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, latent_BSX: Tensor, mask: Tensor | None) -> Tensor:
        """Attention over the cached latents without expanding them: ``W_UK`` folded into the query,
        ``W_UV`` applied to the weighted latent.

        NOTE: the latent is one key/value "head" shared by all H query heads, so the heads ride along
        the query axis of a single-head attention (``[B, 1, H * L, R + P]``), as in multi-query
        attention: one pass over the cache for every head (SDPA's grouped path copies it per head).
        """
        B, L, H = *q_nope.shape[:2], self.heads
        w_uk_HNR, w_uv_HVR = self.kv_up.weight.view(H, -1, self.rank).split([self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("blhn,hnr->bhlr", q_nope, w_uk_HNR)
        q = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1).reshape(B, 1, H * L, -1)
        kv = latent_BSX.unsqueeze(1)  # [B, 1, S, R + P]; values are its first R dims
        if mask is not None:  # [L, S] or [B, 1, L, S] -> the same rows for every head
            S = mask.shape[-1]
            mask = mask.reshape(-1, 1, L, S).expand(-1, H, L, S).reshape(-1, 1, H * L, S)
        y = F.scaled_dot_product_attention(q, kv, kv[..., : self.rank], attn_mask=mask, scale=self.scale)
        y = torch.einsum("bhlr,hvr->blhv", y.view(B, H, L, self.rank), w_uv_HVR)
        return y.reshape(B, L, -1)
