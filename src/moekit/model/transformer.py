"""A GPT-style decoder: token embedding, RoPE, RMSNorm (or LayerNorm), causal SDPA attention (GQA,
optional q/k norms, sinks and sliding windows), and per block either a dense MLP or the MoE layer.
Written for one device; parallelism is applied from outside.

Legend: B batch, L sequence length, D model dim, H query heads, G key/value heads, S cached length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.config import ModelConfig, MoEConfig
from moekit.experts import DenseFFN
from moekit.experts.grouped import draw_normal_
from moekit.layer import MoE
from moekit.model.mla import MLA, LatentAttention
from moekit.model.rope import apply_rope, rope_table
from moekit.model.sdpa import attend, causal_mask
from moekit.stats import MoEStats


@dataclass(frozen=True)
class ModelOutput:
    logits: Tensor  # [B, L, vocab]
    loss: Tensor | None  # cross-entropy + every MoE layer's weighted aux losses (when targets given)
    lm_loss: Tensor | None  # cross-entropy alone
    moe_stats: list[MoEStats]  # one per MoE block, in order (through a cache without targets: counts only)


class Cache(Protocol):
    """What the model asks of a KV cache: the positions of this step's tokens (as RoPE frequencies),
    attention of its queries to the cached keys, and the step's end. ``KVCache`` holds one contiguous
    block per row; ``moekit.serve.kv.PagedStep`` packs sequences at different positions into one row.
    MLA asks for its latent rows instead (``moekit.model.mla.Cache``): both have them."""

    def rope(self, freqs_Sd2: Tensor, num_tokens: int) -> Tensor: ...

    def attend(
        self, layer: int, q_BHLd: Tensor, k_BGLd: Tensor, v_BGLd: Tensor, window: int, sinks_H: Tensor | None
    ) -> Tensor: ...

    def advance(self, num_tokens: int) -> None: ...


class KVCache:
    """Keys and values of the tokens seen so far, per layer: ``[B, G, max_len, head_dim]``.

    ``left_pad_B`` (batched prompts of different lengths, left-aligned with padding) says how many
    leading positions of each row are padding: no real token attends to them. RoPE sees only
    relative positions, so a row shifted right by its padding computes what it would alone.

    MLA (``cfg.attention == "mla"``) caches one latent per token instead, ``[B, 1, max_len,
    kv_lora_rank + qk_rope_head_dim]`` in ``keys`` (``values`` are empty); ``mla_expanded=True``
    caches its expanded per-head keys and values, the naive form benchmarks compare against.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        device: torch.device,
        dtype: torch.dtype,
        left_pad_B: Tensor | None = None,
        mla_expanded: bool = False,
    ) -> None:
        k_shape = v_shape = (batch_size, cfg.kv_heads, cfg.context_length, cfg.head_size)
        self.mla_expanded = mla_expanded and cfg.attention == "mla"
        if self.mla_expanded:
            k_shape = (batch_size, cfg.n_heads, cfg.context_length, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            v_shape = (batch_size, cfg.n_heads, cfg.context_length, cfg.v_head_dim)
        elif cfg.attention == "mla":
            k_shape = (batch_size, 1, cfg.context_length, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            v_shape = (batch_size, 1, cfg.context_length, 0)
        self.keys = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.length = 0  # tokens cached
        self.left_pad = left_pad_B if left_pad_B is not None and bool(left_pad_B.any()) else None

    def attention_mask(self, num_queries: int, num_keys: int, device: torch.device, window: int = 0) -> Tensor | None:
        """``[B or 1, 1, L, S]`` boolean mask for queries at positions length.. (None: plain causal)."""
        return causal_mask(self.length, num_queries, num_keys, window, self.left_pad, device)

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers."""
        pairs = zip(self.keys, self.values, strict=True)
        return sum((k[0, :, 0].numel() + v[0, :, 0].numel()) * k.element_size() for k, v in pairs)

    def append(self, layer: int, k_BGLd: Tensor, v_BGLd: Tensor) -> tuple[Tensor, Tensor]:
        """Store this step's keys/values at positions [length, length+L); return all cached so far."""
        end = self.length + k_BGLd.shape[2]
        self.keys[layer][:, :, self.length : end] = k_BGLd
        self.values[layer][:, :, self.length : end] = v_BGLd
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def attend_latent(self, layer: int, q_BLHx: Tensor, latent_BLX: Tensor, attention: LatentAttention) -> Tensor:
        """MLA: cache this step's latents, then ``attention`` over every cached one (``moekit.model.mla.Cache``)."""
        fresh = self.length == 0
        cached, _ = self.append(layer, latent_BLX.unsqueeze(1), latent_BLX[..., :0].unsqueeze(1))
        mask = self.attention_mask(latent_BLX.shape[1], cached.shape[2], latent_BLX.device)
        return attention(q_BLHx, cached.squeeze(1), mask, fresh)

    def rope(self, freqs_Sd2: Tensor, num_tokens: int) -> Tensor:
        """The rotary frequencies of the next ``num_tokens`` positions (the same for every row)."""
        end = self.length + num_tokens
        if end > freqs_Sd2.shape[0]:
            raise ValueError(f"sequence of {end} tokens exceeds model.context_length={freqs_Sd2.shape[0]}")
        return freqs_Sd2[self.length : end]

    def attend(
        self, layer: int, q_BHLd: Tensor, k_BGLd: Tensor, v_BGLd: Tensor, window: int, sinks_H: Tensor | None
    ) -> Tensor:
        """Cache this step's keys/values, then attend the queries to every cached (real) key up to their
        own position (within ``window`` when > 0): ``[B, H, L, d]``."""
        k, v = self.append(layer, k_BGLd, v_BGLd)
        mask = self.attention_mask(q_BHLd.shape[2], k.shape[2], q_BHLd.device, window)
        return attend(q_BHLd, k, v, mask, sinks_H, 0.0)

    def advance(self, num_tokens: int) -> None:
        """Every layer has cached this step's ``num_tokens`` positions."""
        self.length += num_tokens


class ExpertSink(Protocol):
    """Where a model built with its routed experts on the meta device puts their weights: each stacked
    weight of each MoE layer once, in init order, as its init draws it whole (``[E, ...]``, all experts)."""

    def __call__(self, moe: MoE, role: str, values: Tensor) -> None: ...


class QKNorm(nn.Module):
    """RMSNorm of the queries and of the keys before RoPE: over the whole projection (OLMoE) or,
    with ``model.qk_head_norm``, over each head with one weight of head_dim (Qwen3).

    Works on the grouped projection ``[B, L, G, Q + 2, d]`` (queries, key, value per group).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.head_size
        self.per_head = cfg.qk_head_norm
        self.q = nn.RMSNorm(d if self.per_head else cfg.n_heads * d, eps=cfg.norm_eps)
        self.k = nn.RMSNorm(d if self.per_head else cfg.kv_heads * d, eps=cfg.norm_eps)

    def forward(self, h: Tensor) -> Tensor:
        Q = h.shape[-2] - 2
        if self.per_head:
            return torch.cat([self.q(h[..., :Q, :]), self.k(h[..., Q : Q + 1, :]), h[..., Q + 1 :, :]], dim=-2)
        q = self.q(h[..., :Q, :].flatten(-3)).view_as(h[..., :Q, :])
        k = self.k(h[..., Q, :].flatten(-2)).view_as(h[..., Q, :])
        return torch.cat([q, k.unsqueeze(-2), h[..., Q + 1 :, :]], dim=-2)


class Attention(nn.Module):
    """Causal self-attention with one fused projection for queries, keys and values.

    NOTE: the fused ``qkv`` rows are laid out per key/value group, ``[q heads of group g, k_g, v_g]``
    for g = 0..G-1 (Megatron's layout), so that a tensor-parallel split of its rows into contiguous
    pieces hands each rank whole groups. The module reads the group count from the projection's
    width, so it runs unchanged on such a piece.
    """

    def __init__(self, cfg: ModelConfig, window: int = 0) -> None:
        super().__init__()
        self.q_per_group = cfg.n_heads // cfg.kv_heads
        self.head_dim = cfg.head_size
        self.window = window  # > 0: attend to this many most recent tokens
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * self.head_dim, bias=cfg.qkv_bias)
        self.qk_norm = QKNorm(cfg) if cfg.qk_norm or cfg.qk_head_norm else None
        self.out = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=cfg.attn_out_bias)
        for linear in (self.qkv, self.out):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None
        self.dropout = cfg.dropout

    @staticmethod
    def fuse_qkv(wq: Tensor, wk: Tensor, wv: Tensor, n_kv_heads: int) -> Tensor:
        """The ``qkv`` weight from separate q [H*d, D], k and v [G*d, D] projections."""
        groups = [w.unflatten(0, (n_kv_heads, -1)) for w in (wq, wk, wv)]
        return torch.cat(groups, dim=1).flatten(0, 1)

    @staticmethod
    def split_qkv(w: Tensor, n_heads: int, n_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
        """Inverse of ``fuse_qkv``."""
        q_per_group = n_heads // n_kv_heads
        head_dim = w.shape[0] // (n_heads + 2 * n_kv_heads)
        grouped = w.unflatten(0, (n_kv_heads, (q_per_group + 2) * head_dim))
        wq, wk, wv = grouped.split([q_per_group * head_dim, head_dim, head_dim], dim=1)
        return wq.flatten(0, 1), wk.flatten(0, 1), wv.flatten(0, 1)

    def forward(self, x_BLD: Tensor, freqs: Tensor, cache: Cache | None, layer: int) -> Tensor:
        B, L, _ = x_BLD.shape
        Q = self.q_per_group
        h = self.qkv(x_BLD).view(B, L, -1, Q + 2, self.head_dim)  # [B, L, G, Q + 2, d]
        if self.qk_norm is not None:
            h = self.qk_norm(h)
        # NOTE: split, not indexing: a slice's backward fills a zero tensor of the whole input per
        # slice, a split's backward is one cat.
        qk, v = h.split([Q + 1, 1], dim=-2)
        q, k = apply_rope(qk, freqs).split([Q, 1], dim=-2)  # queries and keys rotated at once
        q = q.reshape(B, L, -1, self.head_dim).transpose(1, 2)
        k, v = k.squeeze(-2).transpose(1, 2), v.squeeze(-2).transpose(1, 2)
        if cache is not None:
            y = cache.attend(layer, q, k, v, self.window, self.sinks)
        else:
            mask = causal_mask(0, L, L, self.window, None, q.device)
            y = attend(q, k, v, mask, self.sinks, self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, L, -1))


def dropout(p: float) -> nn.Module:
    """Dropout, or none at all when ``p`` is 0: each call of even an inactive dropout is an op."""
    return nn.Dropout(p) if p else nn.Identity()


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, bias=False, eps=1e-5 if cfg.norm_eps is None else cfg.norm_eps)
    return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        moe_cfg: MoEConfig | None,
        moe_index: int = 0,
        window: int = 0,
        experts_device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = MLA(cfg) if cfg.attention == "mla" else Attention(cfg, window)
        self.ffn_norm = make_norm(cfg)
        self.ffn = (
            MoE(moe_cfg, moe_index, experts_device)
            if moe_cfg is not None
            else DenseFFN(cfg.d_model, cfg.d_ff, cfg.mlp_activation)
        )
        self.drop = dropout(cfg.dropout)

    def forward(self, x, freqs, cache, layer, token_ids, losses: bool = True) -> tuple[Tensor, MoEStats | None]:
        """``losses``: whether the MoE statistics carry the balancing losses (``MoE.forward``). NOTE:
        ``moekit.infer.token_step`` computes this for one token of an eval model: keep the two in step
        (tests/unit/test_infer_token_step.py)."""
        x = x + self.drop(self.attn(self.attn_norm(x), freqs, cache, layer))
        h = self.ffn_norm(x)
        if isinstance(self.ffn, MoE):
            y, stats = self.ffn(h, token_ids=token_ids, return_stats=True, losses=losses)
            return x + self.drop(y), stats
        return x + self.drop(self.ffn(h)), None


class Transformer(nn.Module):
    """``expert_sink``: the routed experts are built on the meta device (no storage) and ``expert_sink``
    takes their weights as the init draws them; every other weight, and the generator's stream after
    the build, are those of a model built whole."""

    def __init__(
        self, cfg: ModelConfig, moe_cfg: MoEConfig | None = None, expert_sink: ExpertSink | None = None
    ) -> None:
        super().__init__()
        moe_layers = cfg.moe_layers()
        if moe_layers and moe_cfg is None:
            raise ValueError("model has MoE blocks (model.moe_every > 0) but no MoE config was given")
        self.cfg, self.moe_cfg = cfg, moe_cfg
        experts = dict(zip(moe_layers, cfg.experts_per_layer or [None] * len(moe_layers), strict=True))
        # NOTE: built on meta (a model about to be loaded), no value is computed: most ops on meta tensors
        # (normal_, arange) run torch's Python references, whose first call imports torch._dynamo, a
        # second of every load. nn.Embedding's own draw is redundant (reset_parameters draws it).
        on_meta = torch.get_default_device().type == "meta"
        empty = torch.empty(cfg.vocab_size, cfg.d_model) if on_meta else None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=empty)
        self.drop = dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(
                cfg,
                self._layer_moe(moe_cfg, experts[i]),
                moe_layers.index(i),
                cfg.window(i),
                "meta" if expert_sink is not None else None,
            )
            if i in experts
            else Block(cfg, None, window=cfg.window(i))
            for i in range(cfg.n_layers)
        )
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        rope = torch.empty(cfg.context_length, cfg.rope_dim // 2, dtype=torch.complex64) if on_meta else rope_table(cfg)
        self.register_buffer("rope_freqs", rope, persistent=False)  # materialised models compute it anew
        self.reset_parameters(expert_sink)

    @staticmethod
    def _layer_moe(moe_cfg: MoEConfig, num_experts: int | None) -> MoEConfig:
        return moe_cfg if num_experts is None else replace(moe_cfg, num_experts=num_experts)

    def reset_parameters(self, expert_sink: ExpertSink | None = None) -> None:
        """GPT-2 init: N(0, init_std), residual output projections scaled by 1/sqrt(2 * n_layers).
        Experts on the meta device draw their values all the same (``draw_normal_``), handed to
        ``expert_sink`` when given."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        owners = {id(p): (moe, role) for moe in self.moe_layers() for role, p in moe.experts.named_parameters()}
        for name, p in self.named_parameters():
            if p.dim() < 2 or "router" in name or name.endswith("_bias"):
                continue  # norms keep ones, biases zeros; routers keep their own init
            is_output = name.endswith(("attn.out.weight", "w_out.weight", "experts.w_out"))
            values = draw_normal_(p, std=out_std if is_output else std)
            if p.is_meta and expert_sink is not None:
                expert_sink(*owners[id(p)], values)

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoE)]

    def forward(
        self,
        idx_BL: Tensor,
        targets_BL: Tensor | None = None,
        cache: Cache | None = None,
        logits_at: Tensor | None = None,
    ) -> ModelOutput:
        """``logits_at``: the positions (along L) whose logits are computed, ``[B, n, V]`` in that order; the
        others are never projected. A prompt's prefill samples from its last position alone, a serving
        step from each sequence's last (over a 150k-word vocabulary the logits of 512 positions alone
        take 0.3 GB in fp32)."""
        if logits_at is not None and targets_BL is not None:
            raise ValueError("logits_at leaves positions out of the loss: give targets or logits_at, not both")
        B, L = idx_BL.shape
        freqs = self.rope_freqs[:L] if cache is None else cache.rope(self.rope_freqs, L)
        if freqs.shape[0] < L:
            raise ValueError(f"sequence of {L} tokens exceeds model.context_length={self.cfg.context_length}")
        x = self.drop(self.embed(idx_BL))
        stats: list[MoEStats] = []
        # decoding (through a cache, nothing to learn from) reads the routing counts only
        losses = cache is None or targets_BL is not None or torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            x, s = block(x, freqs, cache, i, idx_BL, losses)
            if s is not None:
                stats.append(s)
        if cache is not None:
            cache.advance(L)
        logits = self.lm_head(self.norm(x if logits_at is None else x.index_select(1, logits_at)))
        if targets_BL is None:
            return ModelOutput(logits, None, None, stats)
        lm_loss = F.cross_entropy(logits.float().flatten(0, 1), targets_BL.flatten())
        loss = lm_loss + sum(s.loss for s in stats) if stats else lm_loss
        return ModelOutput(logits, loss, lm_loss, stats)

    # --- sizes -----------------------------------------------------------------------------------

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def num_active_params(self) -> int:
        """Parameters one token uses: everything except the routed experts it does not pick."""
        inactive = 0
        for moe in self.moe_layers():
            per_expert = sum(p.shape[1:].numel() for p in moe.experts.parameters())
            inactive += per_expert * (moe.cfg.num_experts - moe.cfg.top_k)
        return self.num_params() - inactive

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 * active non-embedding params + attention (PaLM appendix B)."""
        cfg = self.cfg
        # The embedding lookup costs no FLOPs, the output projection does: with tied weights the
        # shared matrix counts once (as the output head), untied the embedding is left out.
        matmul_params = self.num_active_params() - (0 if cfg.tie_embeddings else self.embed.weight.numel())
        attention = 12 * cfg.n_layers * cfg.d_model * cfg.context_length
        return 6 * matmul_params + attention
