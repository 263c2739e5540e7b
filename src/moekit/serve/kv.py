"""The KV cache in blocks (paged): every sequence's keys and values live in fixed-size blocks of one
pool per layer, found through the sequence's block table, so sequences of any length share memory
without fragmentation and a finished one frees its blocks at once.

One step packs every scheduled sequence's new tokens into one row ``[1, T]`` (the model's other
layers work token by token); attention alone regroups them: queries into ``[B, H, Lq, d]`` and each
sequence's cached keys gathered into ``[B, G, S, d]``, masked per sequence. Multi-head latent attention
(MLA) caches one latent per position instead (``G = 1``, ``d = kv_lora_rank + qk_rope_head_dim``, no
values): the per-head keys and values it stands for are never stored.

Legend: T tokens this step, B sequences this step, Lq most new tokens of one sequence, S keys gathered
per sequence (whole blocks covering the longest), G key/value heads, H query heads, d head dim, N blocks,
P block size (positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.config import ModelConfig
from moekit.model.mla import LatentAttention
from moekit.model.sdpa import attend


def row_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """What one position caches per layer, as (key, value) ``(heads, width)``: every key/value head's
    key and value, or for MLA one latent ``kv_lora_rank + qk_rope_head_dim`` wide and no value (its
    values are the latent's first dims)."""
    if cfg.attention == "mla":
        return (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim), (1, 0)
    return (cfg.kv_heads, cfg.head_size), (cfg.kv_heads, cfg.head_size)


class KVPool:
    """Keys and values (MLA: latents) of ``num_blocks`` blocks of ``block_size`` positions, per layer
    ``[G, N * P, d]``, the free list of blocks and each block's holders: the choices of one prompt hold
    its blocks together (``share``), and a block goes back to the free list with its last holder.

    Key/value head first: a step's gather of whole blocks is then the ``[G, B, S, d]`` batch of matrices
    decoding's attention multiplies, fp32 used as it is (no reorder: 64 sequences of 96 positions, 8
    layers, 2 threads, ad hoc in one process taking turns: 10.8 against 14.8 ms a step for position
    first)."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool of {num_blocks} blocks of {block_size} positions: both must be >= 1")
        positions = num_blocks * block_size
        (kh, kw), (vh, vw) = row_shapes(cfg)
        self.keys = [torch.zeros(kh, positions, kw, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(vh, positions, vw, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low blocks first
        self.refs = [0] * num_blocks  # sequences holding each block
        self._gathered = [self.keys[0].new_empty(0), self.keys[0].new_empty(0)]  # see gathered()

    def gathered(self, which: int, shape: tuple[int, ...]) -> Tensor:
        """Where a step gathers one layer's keys (``which`` 0) or values (1) of its sequences: a tensor of
        ``shape`` kept from layer to layer and step to step. Made half again as large as a step needs
        when one needs more (a batch grows a sequence or a block at a time), and again when one needs
        under a quarter of it, so it holds at most 1.5x the gather of the steps of late, beside the pool.

        NOTE: a fresh tensor each layer costs page faults once it passes glibc's largest mmap threshold
        (32 MB: 64 sequences of 512 positions in fp32, d1024's 4 key/value heads), every layer of every
        step (ad hoc: 2.1 ms to gather 8 MB into one, 0.15 into memory already touched). Each layer's
        attention is done with its gathered keys and values before the next layer's are gathered. A
        forward recording a graph through them is refused: the gather takes no autograd (``out=``)
        where the pool's keys need grad, and where only the queries do, the backward finds the keys
        it saved overwritten (autograd's version check)."""
        numel = math.prod(shape)
        held = self._gathered[which].numel()
        if held < numel or held > 4 * numel:
            with torch.inference_mode(False):  # a normal tensor, as the pool: steps outside inference mode use it too
                self._gathered[which] = self.keys[0].new_empty(numel * 3 // 2)
        return self._gathered[which][:numel].view(shape)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers (keys and values, or latents)."""
        (kh, kw), (vh, vw) = row_shapes(cfg)
        return cfg.n_layers * block_size * (kh * kw + vh * vw) * torch.empty((), dtype=dtype).element_size()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` free blocks, or None (nothing taken) when fewer are free."""
        if num_blocks > len(self._free):
            return None
        taken = self._free[len(self._free) - num_blocks :]
        del self._free[len(self._free) - num_blocks :]
        for block in taken:
            self.refs[block] = 1
        return taken

    def share(self, blocks: list[int]) -> list[int]:
        """Another holder of ``blocks``: a new block table over the same blocks."""
        for block in blocks:
            self.refs[block] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop one hold on each of ``blocks``; those nobody holds any more are free again."""
        for block in reversed(blocks):
            assert self.refs[block] > 0, f"block {block} released more often than held"
            self.refs[block] -= 1
            if not self.refs[block]:
                self._free.append(block)

    def copy(self, src: int, dst: int) -> None:
        """Block ``src``'s keys and values (latents) into block ``dst``, in every layer."""
        P = self.block_size
        for flat in (*self.keys, *self.values):
            flat[:, dst * P : (dst + 1) * P] = flat[:, src * P : (src + 1) * P]


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: ``num_tokens`` new positions from ``start``, cached in ``blocks``."""

    blocks: list[int]
    start: int
    num_tokens: int


class PagedStep:
    """The model's cache (``moekit.model.transformer.Cache``) for one step over several sequences at
    different positions: their new tokens packed into one row, each attending to its own blocks."""

    def __init__(self, pool: KVPool, chunks: list[Chunk], device: torch.device) -> None:
        P = pool.block_size
        self.pool = pool
        lengths = [c.num_tokens for c in chunks]
        ends = [c.start + c.num_tokens for c in chunks]
        most_new = max(lengths)
        assert all(len(c.blocks) * P >= end for c, end in zip(chunks, ends, strict=True)), "blocks allocated first"
        # NOTE: the step's indices are built as Python lists, each made a tensor once: at a decode
        # step, tensor arithmetic over a handful of indices costs more than the lists do.
        positions = [p for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        # Slots in the flat pool of the step's new positions: slot = block * P + offset.
        slots = [c.blocks[p // P] * P + p % P for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        # Each sequence's first W blocks (block 0 past its own, masked), gathered whole: S = W * P keys.
        width = pool.blocks_for(max(ends))
        table = [b for c in chunks for b in c.blocks[:width] + [0] * (width - len(c.blocks[:width]))]
        self.blocks = torch.tensor(table, device=device)
        self.shape = (len(chunks), most_new, width * P)
        self.positions_T = torch.tensor(positions, device=device)
        self.slots_T = torch.tensor(slots, device=device)
        self.decode_only = most_new == 1
        self.fresh = all(c.start == 0 for c in chunks)  # nothing cached before: MLA expands its latents
        self.mla_expanded = False  # MLA caches its latents here
        # Query slot of each packed token in the padded [B, Lq] view (decode-only steps need none).
        query = [b * most_new + i for b, n in enumerate(lengths) for i in range(n)]
        self.query_T = None if self.decode_only else torch.tensor(query, device=device)
        query_pos_BL = torch.tensor([c.start for c in chunks], device=device).view(-1, 1, 1)
        if most_new > 1:
            query_pos_BL = query_pos_BL + torch.arange(most_new, device=device).view(1, -1, 1)
        key_pos = torch.arange(width * P, device=device)
        mask = (key_pos <= query_pos_BL) & (key_pos < torch.tensor(ends, device=device).view(-1, 1, 1))
        # NOTE: a padding query (beyond its sequence's new tokens) still sees its sequence's keys, so
        # its softmax stays finite; its output is dropped.
        self.visible = mask.unsqueeze(1)  # [B, 1, Lq, S]
        self.query_pos = query_pos_BL.unsqueeze(1)  # [B, 1, Lq, 1]
        self.key_pos = key_pos
        self._windowed: dict[int, Tensor] = {}

    def rope(self, freqs_Sd2: Tensor, num_tokens: int) -> Tensor:
        assert num_tokens == self.positions_T.numel(), "the step's tokens are packed into one row"
        return freqs_Sd2[self.positions_T]

    def attend(
        self, layer: int, q_1HTd: Tensor, k_1GTd: Tensor, v_1GTd: Tensor, window: int = 0, sinks_H: Tensor | None = None
    ) -> Tensor:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys.index_copy_(1, self.slots_T, k_1GTd[0])
        values.index_copy_(1, self.slots_T, v_1GTd[0])
        k_BGSd, v_BGSd = self._gather(keys, 0), self._gather(values, 1)
        q_BHLd = self._pad(q_1HTd)
        if window:  # the same keys, each query seeing only the window most recent (built once per step)
            if window not in self._windowed:
                self._windowed[window] = self.visible & (self.key_pos > self.query_pos - window)
            mask = self._windowed[window]
        else:  # never None: to attend, None means causal from position 0, not these keys
            mask = self.visible
        return self._unpad(attend(q_BHLd, k_BGSd, v_BGSd, mask, sinks_H, 0.0))

    def attend_latent(self, layer: int, q_1THx: Tensor, latent_1TX: Tensor, attention: LatentAttention) -> Tensor:
        """MLA (``moekit.model.mla.Cache``): the step's latents into their slots, then ``attention`` of
        the padded queries ``[B, Lq, H, x]`` over each sequence's gathered latents ``[B, S, R + P]``."""
        latents = self.pool.keys[layer]
        latents.index_copy_(1, self.slots_T, latent_1TX)
        latent_BSX = self._gather(latents, 0).squeeze(1)
        q_BLHx = self._pad(q_1THx.transpose(1, 2)).transpose(1, 2)
        y_BLY = attention(q_BLHx, latent_BSX, self.visible, self.fresh)
        return self._unpad(y_BLY.unsqueeze(1)).squeeze(1)  # [1, T, H * V]

    def advance(self, num_tokens: int) -> None:
        pass  # the scheduler keeps each sequence's position

    def _gather(self, flat: Tensor, which: int) -> Tensor:
        """The step's sequences' blocks of one layer's ``[G, N * P, d]`` keys or values, as ``[B, G, S, d]``:
        a view of the pool's ``gathered`` ``[G, B, S, d]``, copied whole blocks at a time (a per-position index costs
        several times more on the CPU), one key/value head after another (one ``index_select`` over the
        middle dim of all heads took 1.6x as long: 4 MB, 2 threads, ad hoc)."""
        B, _, S = self.shape
        P, (G, _, d) = self.pool.block_size, flat.shape
        out = self.pool.gathered(which, (G, self.blocks.numel(), P * d))
        for g in range(G):
            torch.index_select(flat[g].view(-1, P * d), 0, self.blocks, out=out[g])
        return out.view(G, B, S, d).transpose(0, 1)

    def _pad(self, q_1HTd: Tensor) -> Tensor:
        if self.decode_only:
            return q_1HTd.transpose(0, 2)  # [B, H, 1, d]
        B, Lq, _ = self.shape
        _, H, T, d = q_1HTd.shape
        q = q_1HTd.new_zeros(B * Lq, H, d).index_copy_(0, self.query_T, q_1HTd[0].transpose(0, 1))
        return q.view(B, Lq, H, d).transpose(1, 2)

    def _unpad(self, y_BHLd: Tensor) -> Tensor:
        if self.decode_only:
            return y_BHLd.transpose(0, 2)  # [1, H, T, d]
        B, H, Lq, d = y_BHLd.shape
        return y_BHLd.transpose(1, 2).reshape(B * Lq, H, d)[self.query_T].transpose(0, 1).unsqueeze(0)
