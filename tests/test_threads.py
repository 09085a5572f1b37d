"""Torch's threads by default (`rocketkv_cli/api/threads.py`): the cores this process may use, less
those other processes keep busy, measured from /proc/stat with a real busy process beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rocketkv_cli.api import threads as threads_mod
from rocketkv_cli.api.threads import CpuLoad, default_threads, threads_for

linux = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")


@pytest.mark.parametrize(
    "cores, busy, want", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 3.5, 1), (4, 1.2, 3), (1, 0.0, 1)]
)
def test__threads_for__the_idle_cores_rounded_at_least_one(cores, busy, want):
    assert threads_for(cores, busy) == want


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@linux
def test__cpu_load__counts_another_busy_process_not_this_ones_own_work():
    load = CpuLoad()
    spinner = _spinner()
    try:
        time.sleep(1.0)
        elsewhere = load.elsewhere()
    finally:
        spinner.kill()
        spinner.wait()
    assert elsewhere is not None and elsewhere >= 0.5, elsewhere  # one process spinning on one core
    mine = CpuLoad()
    own_start = time.process_time()
    while time.process_time() - own_start < 1.0:  # this process busy on one core
        pass
    with_own = mine.elsewhere()
    assert with_own is not None
    assert with_own <= len(mine.cpus) - 0.5, f"this process's own work counted: {with_own:.2f} busy elsewhere"


@linux
def test__cpu_load__too_short_a_window_says_nothing_and_keeps_its_sample():
    load = CpuLoad()
    assert load.elsewhere() is None  # at once: less than MIN_WINDOW_S
    time.sleep(threads_mod.MIN_WINDOW_S + 0.1)
    assert load.elsewhere() is not None  # measured from the first sample, kept


@linux
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test__default_threads__leave_the_core_another_process_keeps_busy():
    """One of two cores busy (`yes > /dev/null` in the issue) made a 2-thread decode 5x slower than
    one thread: the default leaves that core alone."""
    cores = threads_mod.available_cores()
    spinners = [_spinner() for _ in range(cores - 1)]
    try:
        load = CpuLoad()
        time.sleep(1.0)
        n, why = default_threads(load)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    assert n < cores and "busy with other processes" in why, (n, why)
