"""Keep freed host memory in the process, so CPU steps stop paying page faults.

glibc hands the top of its heap back to the OS once more than the trim threshold is free and serves
big blocks from fresh mmaps; a training step frees and re-allocates the same few megabytes every step,
so every step then faults those pages in again (zero-filled, inside its kernels). Measured on
``shakespeare-moe``: 6,000 faults and 10% of a CPU step (1,800 and 2.5% for the dense twin). jemalloc
and tcmalloc, which PyTorch's CPU performance guide recommends, keep the memory; this does the same
with glibc's own knobs, and leaves alone a process whose allocator the user already chose.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import resource
import sys
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap
_MMAP_THRESHOLD = 32 << 20  # glibc's largest; only blocks above it come from mmap
_USER_CHOICES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_kept = False  # keep_freed_memory's thresholds are in effect in this process


def _tunable() -> bool:
    """glibc malloc, and no allocator or malloc setting chosen by the user."""
    if platform.libc_ver()[0] != "glibc" or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    return not any(name in os.environ for name in _USER_CHOICES)


def keep_freed_memory() -> bool:
    """Tune glibc malloc to reuse freed memory; True when it did (glibc, no allocator chosen by the user)."""
    global _kept
    if not _tunable():
        return False
    libc = ctypes.CDLL(None)
    _kept = bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) and libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    return _kept


@contextlib.contextmanager
def large_blocks_returned(threshold: int = 1 << 20) -> Iterator[None]:
    """Inside, blocks of ``threshold`` bytes or more come from their own mmaps, each handed back to the OS
    as it is freed; then ``keep_freed_memory``'s threshold again. Only where ``keep_freed_memory`` is in
    effect: glibc has no getter for its thresholds, so any other state could not be restored, and its
    default adaptive threshold already serves a block that size from an mmap until one is freed.

    NOTE: a build that draws and drops one large temporary after another (offloaded experts, a MoE layer
    at a time) between small allocations would otherwise grow the heap: a small block lands in the freed
    temporary's place, the next temporary goes above it, and the freed pages stay resident (measured:
    32 layers' 6 MB temporaries left 120 MB more at the peak in some runs, none in others)."""
    if not _kept:
        yield
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the OS now (glibc ``malloc_trim``): after a one-off release
    of many large blocks, such as the expert weights offloaded training moves to disk."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


def available_memory() -> int | None:
    """Bytes this process could take now without swapping: Linux's MemAvailable, or less where its
    cgroup (as containers run) caps memory below it; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    room = cgroup_room()
    return available if room is None else min(available, room)


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this process's cgroup memory cap (v2 ``memory.max``, v1 ``memory.limit_in_bytes``,
    less what the cgroup uses); None where it has none or none can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, limit_file, usage_file = f"{root}{path}", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = f"{root}/memory{path}", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        try:
            with open(f"{base.rstrip('/')}/{limit_file}") as f, open(f"{base.rstrip('/')}/{usage_file}") as g:
                limit, used = f.read().strip(), int(g.read())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no cap" as the largest page-aligned int64
            return max(0, int(limit) - used)
    return None


def peak_rss() -> int:
    """The most memory this process has held resident so far, in bytes, as the OS counts it (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts KiB, macOS bytes
