"""Direct (page-cache-bypassing) I/O's ground rules, shared by every tier: 4 KiB
aligned buffers, an ``O_DIRECT`` descriptor where the filesystem has one, and the reader pool's size."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

READERS = 4  # concurrent reads: the disk's queue depth
DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and memory address, in units of the logical block


def aligned_empty(nbytes: int, pin: bool = False) -> Tensor:
    """A CPU uint8 buffer starting on a 4 KiB boundary (where direct reads may land)."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def open_direct(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor for direct reads (and, with ``os.O_RDWR``, writes) of ``path``, or -1 where the OS
    or filesystem has none. The file must hold at least one 4 KiB block (the probe reads it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        fd = os.open(path, flags | flag)
    except OSError:
        return -1
    try:  # some filesystems accept the flag at open and refuse the reads
        os.preadv(fd, [memoryview(aligned_empty(DIRECT_ALIGN).numpy())], 0)
    except OSError:
        os.close(fd)
        return -1
    return fd


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align
