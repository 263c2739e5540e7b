"""The engine thread's CPU time in /metrics: the kernel's count for a thread, against the thread's own
clock (``time.thread_time``), and the time it waits for a CPU when a rival process holds it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from moekit.serve.metrics import thread_cpu_seconds

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the kernel's schedstat is Linux's")


def spun(seconds: float, cpu: int | None = None) -> tuple[float, tuple[float, float] | None]:
    """A thread (on ``cpu`` if given) burns ``seconds`` of its own CPU time, then holds still while its
    schedstat is read: (its CPU time by its own clock, (running, waiting) as the kernel counts them)."""
    own: list[float] = []
    done, read = threading.Event(), threading.Event()

    def work() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        while time.thread_time() < seconds:
            pass
        own.append(time.thread_time())
        done.set()
        read.wait()

    thread = threading.Thread(target=work)
    thread.start()
    done.wait()
    scheduled = thread_cpu_seconds(thread.native_id)
    read.set()
    thread.join()
    return own[0], scheduled


def test_running_seconds_are_the_threads_own_cpu_time() -> None:
    own, scheduled = spun(0.2)
    assert scheduled is not None
    running, waiting = scheduled
    assert abs(running - own) < 0.02 and waiting >= 0


def test_a_thread_sharing_its_cpu_with_a_busy_process_waits() -> None:
    """A spinning process pinned to the thread's CPU: the thread waits for it about as long as it runs."""
    cpu = min(os.sched_getaffinity(0))
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nprint('spinning', flush=True)\nwhile True: pass"
    rival = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert rival.stdout.readline() == "spinning\n"
        own, scheduled = spun(0.2, cpu)
    finally:
        rival.kill()
        rival.wait()
    assert scheduled is not None
    running, waiting = scheduled
    assert waiting > 0.5 * running, f"ran {running:.3f} s, waited {waiting:.3f} s beside a rival on its CPU"


def test_no_such_thread_has_no_count() -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        assert thread_cpu_seconds(int(f.read()) + 1) is None  # above every thread id the kernel gives
