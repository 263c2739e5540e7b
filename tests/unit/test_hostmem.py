"""moekit.hostmem: keeping freed host memory removes the page faults a CPU step pays per step."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from moekit.hostmem import keep_freed_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc malloc")
# the children tune glibc malloc, which keep_freed_memory refuses under an allocator the user preloaded
# (their MALLOC_* settings, the other refusal, are left out of the children's environment)
glibc_allocator = pytest.mark.skipif("malloc" in os.environ.get("LD_PRELOAD", ""), reason="a preloaded allocator")


def without_malloc_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}


STEP_FAULTS = """
import resource, sys, torch
from moekit import runconfig
from moekit.hostmem import keep_freed_memory
from moekit.model import Transformer
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.manual_seed(0)
cfg = runconfig.resolve("shakespeare-moe", {"model.vocab_size": "65"})
model = Transformer(cfg.model, cfg.moe)
x = torch.randint(0, 65, (cfg.train.batch_size, cfg.model.context_length))
def step():
    model(x, x).loss.backward()
for _ in range(3):
    step()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[len(faults) // 2], sum(faults) / len(faults))
"""


def faults_per_step(mode: str) -> tuple[float, float]:
    """Page faults of the median step and per step on average, over 8 steps after 3."""
    out = subprocess.run(
        [sys.executable, "-c", STEP_FAULTS, mode],
        env=without_malloc_settings(),
        capture_output=True,
        text=True,
        check=True,
    )
    median, mean = out.stdout.split()[-2:]
    return float(median), float(mean)


@pytest.mark.slow
@glibc_allocator
def test_kept_memory_removes_per_step_page_faults():
    default, kept = faults_per_step("default"), faults_per_step("keep")
    # With kept memory the median step faults in no page (a few late first touches land in one step or
    # two). glibc's defaults fault in 500-6,000 pages a step on average here, but their adaptive
    # thresholds can settle so that most steps fault in none: only the averages are compared.
    assert kept[0] <= 8, (default, kept)
    assert default[1] > kept[1], (default, kept)


def test_leaves_a_users_allocator_choice_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert keep_freed_memory() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert keep_freed_memory() is False


RETURNED = """
import torch
from pathlib import Path
from moekit.hostmem import keep_freed_memory, large_blocks_returned

def rss():
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024

def dropped_on_free():
    held = torch.ones(8 << 20, dtype=torch.uint8)
    before = rss()
    del held
    return before - rss()

assert keep_freed_memory()
with large_blocks_returned():
    returned = dropped_on_free()
print(returned, dropped_on_free())
"""


@pytest.mark.slow
@glibc_allocator
def test_large_blocks_go_back_to_the_os_while_asked():
    """An 8 MiB block freed inside ``large_blocks_returned`` leaves RSS at once (its own mmap); the same
    block freed after it stays resident in the heap ``keep_freed_memory`` keeps."""
    env = without_malloc_settings()
    out = subprocess.run([sys.executable, "-c", RETURNED], capture_output=True, text=True, check=True, env=env)
    returned, kept = map(int, out.stdout.split())
    assert returned >= 7 << 20 and kept < 1 << 20, (returned, kept)


DEFAULTS_KEPT = """
import ctypes, torch
from pathlib import Path
from moekit.hostmem import large_blocks_returned

def rss():
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024

with large_blocks_returned():
    pass
held = torch.ones(8 << 20, dtype=torch.uint8)
pin = ctypes.CDLL(None).malloc(64)  # above it, were it in the heap: the heap's top could not be trimmed
before = rss()
del held
print(before - rss())
"""


@pytest.mark.slow
@glibc_allocator
def test_leaves_glibcs_defaults_where_memory_is_not_kept():
    """In a process that never called ``keep_freed_memory``, glibc's default (adaptive) threshold still
    serves the first 8 MiB block from its own mmap after ``large_blocks_returned``: freed, it leaves RSS.
    A fixed 32 MiB threshold left behind would put it in the heap, under a small block, resident."""
    env = without_malloc_settings()
    out = subprocess.run([sys.executable, "-c", DEFAULTS_KEPT], capture_output=True, text=True, check=True, env=env)
    assert int(out.stdout.split()[-1]) >= 7 << 20, out.stdout


@pytest.mark.parametrize(
    ("lines", "files", "room"),
    [
        (["0::/box"], {"box/memory.max": "1000000\n", "box/memory.current": "250000\n"}, 750000),
        (["0::/box"], {"box/memory.max": "max\n", "box/memory.current": "250000\n"}, None),
        (
            ["4:memory:/a/b", "1:cpu:/"],
            {"memory/a/b/memory.limit_in_bytes": "1000000\n", "memory/a/b/memory.usage_in_bytes": "1200000\n"},
            0,
        ),
        (
            ["4:memory:/a/b"],
            {"memory/a/b/memory.limit_in_bytes": "9223372036854771712\n", "memory/a/b/memory.usage_in_bytes": "5\n"},
            None,
        ),
        (["4:memory:/gone"], {}, None),
    ],
    ids=["v2", "v2-uncapped", "v1-over", "v1-uncapped", "unreadable"],
)
def test_cgroup_room_reads_the_cap_left(tmp_path, lines, files, room) -> None:
    """What ``cgroup_room`` reads from a cgroup's files as Linux lays them out (v2's one hierarchy, v1's
    memory controller), written here: the cap less the usage, never below 0; None when uncapped."""
    from moekit.hostmem import cgroup_room

    (tmp_path / "cgroup").write_text("\n".join(lines) + "\n")
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    assert cgroup_room(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == room
