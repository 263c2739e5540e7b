"""The KV cache in blocks (paged): every sequence's keys and values live in fixed-size blocks of one
pool per layer, found through the sequence's block table, so sequences of any length share memory
without fragmentation and a finished one frees its blocks at once.

One step packs every scheduled sequence's new tokens into one row ``[1, T]`` (the model's other
layers work token by token); attention alone regroups them, the sequences decoding one token apart
from those prefilling a chunk: each group's queries into ``[B, H, Lq, d]`` and its sequences' cached
keys gathered into ``[B, G, S, d]``, masked per sequence. Multi-head latent attention
(MLA) caches one latent per position instead (``G = 1``, ``d = kv_lora_rank + qk_rope_head_dim``, no
values): the per-head keys and values it stands for are never stored.

Legend: T tokens this step, B sequences of a group, Lq most new tokens of one of them, S keys gathered
per sequence (whole blocks covering the group's longest), G key/value heads, H query heads, d head dim, N blocks,
P block size (positions).
"""

from __future__ import annotations

import itertools
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
        self._gathered = [self.keys[0].new_empty(0), self.keys[0].new_empty(0)]  # see fit_gathered()

    def fit_gathered(self, which: int, numel: int) -> None:
        """Make the buffer a step gathers one layer's keys (``which`` 0) or values (1) into hold ``numel``
        elements: made half again as large as that when it holds less (a batch grows a sequence or a
        block at a time), and again when it holds over four times as much, so it holds at most 1.5x the
        gather of the steps of late, beside the pool. ``PagedStep`` fits it once a step, for the most
        any of its groups gathers.

        NOTE: a fresh tensor each layer costs page faults once it passes glibc's largest mmap threshold
        (32 MB: 64 sequences of 512 positions in fp32, d1024's 4 key/value heads), every layer of every
        step (ad hoc: 2.1 ms to gather 8 MB into one, 0.15 into memory already touched). Each group's
        attention is done with its gathered keys and values before the next gather. A
        forward recording a graph through them is refused: the gather takes no autograd (``out=``)
        where the pool's keys need grad, and where only the queries do, the backward finds the keys
        it saved overwritten (autograd's version check)."""
        held = self._gathered[which].numel()
        if held < numel or held > 4 * numel:
            with torch.inference_mode(False):  # a normal tensor, as the pool: steps outside inference mode use it too
                self._gathered[which] = self.keys[0].new_empty(numel * 3 // 2)

    def gathered(self, which: int, shape: tuple[int, ...]) -> Tensor:
        """The start of buffer ``which`` as a contiguous tensor of ``shape`` (``fit_gathered`` first)."""
        numel = math.prod(shape)
        assert self._gathered[which].numel() >= numel, "fit_gathered for the step first"
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
    different positions: their new tokens packed into one row, each attending to its own blocks.

    Sequences with one new token attend apart from those with more (``_Group``): padded to a prompt
    chunk's 128 tokens, a decoding sequence's one query cost 128 over its whole context (ad hoc, d1024
    bf16, 64 clients of 1,500-2,500-character prompts: the engine's forward 536 ms a step, 317 apart)."""

    def __init__(self, pool: KVPool, chunks: list[Chunk], device: torch.device) -> None:
        P = pool.block_size
        self.pool = pool
        assert all(len(c.blocks) * P >= c.start + c.num_tokens for c in chunks), "blocks allocated first"
        # NOTE: the step's indices are built as Python lists, each made a tensor once: at a decode
        # step, tensor arithmetic over a handful of indices costs more than the lists do.
        positions = [p for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        # Slots in the flat pool of the step's new positions: slot = block * P + offset.
        slots = [c.blocks[p // P] * P + p % P for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        self.positions_T = torch.tensor(positions, device=device)
        self.slots_T = torch.tensor(slots, device=device)
        self.mla_expanded = False  # MLA caches its latents here
        firsts = [0, *itertools.accumulate(c.num_tokens for c in chunks)][:-1]  # each one's first packed token
        ones = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        more = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        parts = [ones, more] if ones and more else []
        self.groups = [
            _Group(pool, [chunks[i] for i in part], [firsts[i] for i in part], len(positions), device)
            for part in parts or [range(len(chunks))]
        ]
        most = max(group.blocks.numel() for group in self.groups)
        for which, flat in enumerate((pool.keys[0], pool.values[0])):
            pool.fit_gathered(which, most * P * flat.shape[0] * flat.shape[2])

    def rope(self, freqs_Sd2: Tensor, num_tokens: int) -> Tensor:
        assert num_tokens == self.positions_T.numel(), "the step's tokens are packed into one row"
        return freqs_Sd2[self.positions_T]

    def attend(
        self, layer: int, q_1HTd: Tensor, k_1GTd: Tensor, v_1GTd: Tensor, window: int = 0, sinks_H: Tensor | None = None
    ) -> Tensor:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys.index_copy_(1, self.slots_T, k_1GTd[0])
        values.index_copy_(1, self.slots_T, v_1GTd[0])
        outputs = []
        for group in self.groups:  # one at a time: each gathers into the pool's buffers
            k_BGSd, v_BGSd = group.gather(keys, 0), group.gather(values, 1)
            q_BHLd = group.pad(q_1HTd, 2)
            outputs.append(group.unpad(attend(q_BHLd, k_BGSd, v_BGSd, group.mask(window), sinks_H, 0.0), 2))
        return self._packed(outputs, 2)

    def attend_latent(self, layer: int, q_1THx: Tensor, latent_1TX: Tensor, attention: LatentAttention) -> Tensor:
        """MLA (``moekit.model.mla.Cache``): the step's latents into their slots, then ``attention`` of
        the padded queries ``[B, Lq, H, x]`` over each sequence's gathered latents ``[B, S, R + P]``."""
        latents = self.pool.keys[layer]
        latents.index_copy_(1, self.slots_T, latent_1TX)
        outputs = []
        for group in self.groups:
            latent_BSX = group.gather(latents, 0).squeeze(1)
            q_BLHx = group.pad(q_1THx, 1)
            y_BLY = attention(q_BLHx, latent_BSX, group.visible, group.fresh)
            outputs.append(group.unpad(y_BLY, 1))
        return self._packed(outputs, 1)  # [1, T, H * V]

    def advance(self, num_tokens: int) -> None:
        pass  # the scheduler keeps each sequence's position

    def _packed(self, outputs: list[Tensor], dim: int) -> Tensor:
        """The groups' outputs (each its tokens along ``dim``) in the step's packed order."""
        if len(outputs) == 1:
            return outputs[0]
        out = outputs[0].new_empty(*outputs[0].shape[:dim], self.positions_T.numel(), *outputs[0].shape[dim + 1 :])
        for group, y in zip(self.groups, outputs, strict=True):
            out.index_copy_(dim, group.tokens_T, y)
        return out


class _Group:
    """Sequences of one step that attend together: their block tables gathered to the widest of them,
    their queries padded to the most new tokens among them."""

    def __init__(
        self, pool: KVPool, chunks: list[Chunk], firsts: list[int], num_tokens: int, device: torch.device
    ) -> None:
        P = pool.block_size
        self.pool = pool
        lengths = [c.num_tokens for c in chunks]
        ends = [c.start + c.num_tokens for c in chunks]
        most_new = max(lengths)
        # Each sequence's first W blocks (block 0 past its own, masked), gathered whole: S = W * P keys.
        width = pool.blocks_for(max(ends))
        table = [b for c in chunks for b in c.blocks[:width] + [0] * (width - len(c.blocks[:width]))]
        self.blocks = torch.tensor(table, device=device)
        self.shape = (len(chunks), most_new, width * P)
        self.decode_only = most_new == 1
        self.fresh = all(c.start == 0 for c in chunks)  # nothing cached before: MLA expands its latents
        # The group's tokens in the step's packed row (None: all of them, in order).
        tokens = [f + i for f, n in zip(firsts, lengths, strict=True) for i in range(n)]
        self.tokens_T = None if tokens == list(range(num_tokens)) else torch.tensor(tokens, device=device)
        # Query slot of each of its tokens in the padded [B, Lq] view (decode-only groups need none).
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

    def mask(self, window: int) -> Tensor:
        """Which keys each query sees; ``window`` > 0: only the window most recent (built once a step)."""
        if not window:  # never None: to attend, None means causal from position 0, not these keys
            return self.visible
        if window not in self._windowed:
            self._windowed[window] = self.visible & (self.key_pos > self.query_pos - window)
        return self._windowed[window]

    def gather(self, flat: Tensor, which: int) -> Tensor:
        """The group's sequences' blocks of one layer's ``[G, N * P, d]`` keys or values, as ``[B, G, S, d]``:
        a view of the pool's ``gathered`` ``[G, B, S, d]``, copied whole blocks at a time (a per-position
        index costs several times more on the CPU), one key/value head after another (one
        ``index_select`` over the middle dim of all heads took 1.6x as long: 4 MB, 2 threads, ad hoc)."""
        B, _, S = self.shape
        P, (G, _, d) = self.pool.block_size, flat.shape
        out = self.pool.gathered(which, (G, self.blocks.numel(), P * d))
        for g in range(G):
            torch.index_select(flat[g].view(-1, P * d), 0, self.blocks, out=out[g])
        return out.view(G, B, S, d).transpose(0, 1)

    def pad(self, q: Tensor, dim: int) -> Tensor:
        """The group's queries of the step's ``q`` (tokens along ``dim``, 2 or 1) as ``[B, H, Lq, d]``
        (dim 2: ``[1, H, T, d]``) or ``[B, Lq, H, x]`` (dim 1: ``[1, T, H, x]``)."""
        if self.tokens_T is not None:
            q = q.index_select(dim, self.tokens_T)
        q_1HTd = q if dim == 2 else q.transpose(1, 2)
        if self.decode_only:
            q_BHLd = q_1HTd.transpose(0, 2)  # [B, H, 1, d]
        else:
            B, Lq, _ = self.shape
            _, H, T, d = q_1HTd.shape
            q_BLHd = q_1HTd.new_zeros(B * Lq, H, d).index_copy_(0, self.query_T, q_1HTd[0].transpose(0, 1))
            q_BHLd = q_BLHd.view(B, Lq, H, d).transpose(1, 2)
        return q_BHLd if dim == 2 else q_BHLd.transpose(1, 2)

    def unpad(self, y: Tensor, dim: int) -> Tensor:
        """``pad``'s inverse for the outputs: ``[1, H, Tg, d]`` (dim 2) or ``[1, Tg, Y]`` (dim 1, from
        ``[B, Lq, Y]``), the group's tokens in its order."""
        if dim == 1:
            return self.unpad(y.unsqueeze(1), 2).squeeze(1)
        if self.decode_only:
            return y.transpose(0, 2)  # [1, H, T, d]
        B, H, Lq, d = y.shape
        return y.transpose(1, 2).reshape(B * Lq, H, d)[self.query_T].transpose(0, 1).unsqueeze(0)
