"""moekit.serve.server: the engine thread, started as the server starts it, pays a few page faults a step
at most (a thread of its own allocates from its own glibc arena, which by default hands freed memory back),
and is the only thread left with OpenMP workers once the model has loaded (``on_a_passing_thread``)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc malloc")

ENGINE_FAULTS = """
import threading
from pathlib import Path
import torch
from moekit import runconfig
from moekit.model import Transformer
from moekit.run.load import LoadedRun
from moekit.serve.engine import Engine, EngineOptions, Finish
from moekit.serve.scheduler import SamplingParams, Seq
from moekit.serve.server import start_engine
from moekit.tokenizer import ByteTokenizer

torch.set_num_threads(1)
torch.manual_seed(0)
sizes = {"model.d_model": "256", "model.n_layers": "4", "model.n_heads": "4", "model.d_ff": "512",
         "model.context_length": "256", "model.tie_embeddings": "false", "moe.num_experts": "16"}
cfg = runconfig.resolve("tiny", sizes)
run = LoadedRun(Transformer(cfg.model, cfg.moe), ByteTokenizer(), cfg, Path("."))
engine = Engine(run, EngineOptions(kv_budget=32 << 20))
start_engine(engine, freeze=True)  # as serve() starts it
from moekit import hostmem
assert hostmem._kept, "start_engine keeps freed memory"
import gc
assert gc.get_freeze_count() > 10000, "what existed before the engine started is out of the collector's reach"

def faults() -> int:
    with open(f"/proc/self/task/{engine.thread_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt

def batch() -> None:
    done, finished = threading.Event(), []
    def emit(event) -> None:
        if isinstance(event, Finish):
            assert event.reason == "length", event
            finished.append(event)
            if len(finished) == 16:
                done.set()
    # 16 prompts of 120 tokens: the prefill's buffers are big enough for glibc to hand them back
    engine.submit([Seq([i + 1] * 120, SamplingParams(12, 0.0), emit, i) for i in range(16)])
    done.wait()

steps, before = engine.steps, faults()
batch()  # first touches
first = (faults() - before) / (engine.steps - steps)
rates = []
for _ in range(3):  # the median batch's faults per step: a few late first touches land in one batch
    steps, before = engine.steps, faults()
    batch()
    rates.append((faults() - before) / (engine.steps - steps))
print(first, sorted(rates)[1])
engine.stop()
"""


@pytest.mark.slow
def test_the_served_engine_thread_keeps_its_freed_memory() -> None:
    """Page faults per step of the engine thread started as ``serve`` starts it (glibc told to keep
    freed memory, what exists frozen out of the cyclic collector), its steps as they run: the first
    batch's first touches, hundreds a step, show the probe counts that thread's faults; later batches'
    median step faults in a few pages: about 5, or about 23 in a third to a half of the runs here, which
    no setting of this test's explains (with the collector disabled for the batches, 3-5 in every
    run; not understood further). Without the malloc settings glibc's adaptive thresholds fault in
    anywhere from none to 1,700 pages a step here, run to run (their effect: test_hostmem.py).
    """
    # glibc's own allocator: no other allocator preloaded, no malloc settings but the server's
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")
    }
    out = subprocess.run([sys.executable, "-c", ENGINE_FAULTS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    first, median = map(float, out.stdout.split()[-2:])
    assert first > 50 and median <= 32, (first, median, out.stderr[-500:])


PASSING_THREAD = """
import os, time, torch
from moekit.serve.server import on_a_passing_thread

def threads() -> int:
    return len(os.listdir("/proc/self/task"))

def settled(count: int) -> int:
    # the thread count once ending threads have ended (a joined thread releases its team after join)
    deadline = time.monotonic() + 10
    while threads() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

def parallel() -> float:
    return float(torch.ones(1 << 22).mul_(2).sum())  # large enough for a parallel region

torch.set_num_threads(2)
before = threads()
assert on_a_passing_thread(parallel) == 2.0 * (1 << 22)
after = settled(before)
parallel()  # on this (main) thread: its OpenMP workers stay
time.sleep(0.5)
print(before, after, threads())
"""


@pytest.mark.slow
def test_a_passing_thread_takes_its_openmp_workers_with_it() -> None:
    """What ``moekit serve`` loads on a passing thread leaves no OpenMP worker behind (counted in
    /proc), where the same work on the main thread leaves one; its errors reach the caller."""
    from moekit.serve.server import on_a_passing_thread

    out = subprocess.run([sys.executable, "-c", PASSING_THREAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, main_ran = map(int, out.stdout.split())
    assert after == before
    assert main_ran > before
    with pytest.raises(ZeroDivisionError):
        on_a_passing_thread(lambda: 1 / 0)
