"""Torch's threads by default (`rocketkv_cli/api/threads.py`): the cores this process may use, less
those other processes keep busy, from /proc/stat: its parsing and arithmetic on given samples, and
the whole measurement with a real busy process beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rocketkv_cli.api import threads as threads_mod
from rocketkv_cli.api.threads import CpuLoad, busy_seconds, default_threads, threads_for

linux = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")

# user nice system idle iowait irq softirq steal guest guest_nice (jiffies)
STAT = """cpu  900 0 300 5000 100 0 0 0 0 0
cpu0 400 0 100 2000 50 0 0 25 300 0
cpu1 500 0 200 3000 50 0 0 0 0 0
cpu5 1 1 1 1 1 1 1 1 0 0
intr 12345 0 0
ctxt 999
"""


def test__busy_seconds__per_core_without_idle_iowait_or_guest_and_only_the_given_cores():
    got = busy_seconds(STAT, {0, 1, 7}, tick=100)
    # cpu0: 400 + 100 + 25 (steal counts as busy; guest 300 is already inside user) = 525 jiffies
    assert got == {0: 5.25, 1: 7.0}  # the aggregate line, cpu5 (not ours) and cpu7 (absent) left out


@pytest.mark.parametrize(
    "cores, n_cores, busy, want",
    [(2, 2, 0.0, 2), (2, 2, 0.4, 2), (2, 2, 0.6, 1), (2, 2, 1.0, 1), (2, 2, 3.5, 1), (4, 4, 1.2, 3), (1, 1, 0.0, 1),
     (2, 64, 30.0, 2), (2, 64, 63.0, 1)],
)  # fmt: skip
def test__threads_for__the_idle_cores_rounded_within_the_quota(cores, n_cores, busy, want):
    """A 2-CPU quota on a 64-core host whose other tenants keep 30 busy still gets its 2."""
    assert threads_for(cores, n_cores, busy) == want


def test__cpu_load__subtracts_its_own_time_and_ignores_a_core_going_offline(monkeypatch):
    samples = iter([
        (0.0, {0: 10.0, 1: 20.0}, 5.0),
        (2.0, {0: 12.0, 1: 21.0}, 6.0),  # 3 core-s busy in 2 s, 1 of them this process's: 1.0 core elsewhere
        (2.1, {0: 12.2, 1: 21.1}, 6.1),  # under MIN_WINDOW_S: no answer, the last sample kept
        (4.0, {0: 14.0}, 7.0),  # core 1 went offline: only core 0 counts (2 busy, 1 own, over 2 s)
        (6.0, {0: 14.0, 1: 5.0}, 7.0),  # core 1 back with a smaller counter: never negative
    ])  # fmt: skip
    monkeypatch.setattr(threads_mod, "_sample", lambda cpus: next(samples))
    load = CpuLoad()
    assert load.elsewhere() == pytest.approx(1.0)
    assert load.elsewhere() is None
    assert load.elsewhere() == pytest.approx(0.5)
    assert load.elsewhere() == pytest.approx(0.0)


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@linux
def test__cpu_load__counts_another_busy_process():
    load = CpuLoad()
    spinner = _spinner()
    try:
        time.sleep(1.0)
        elsewhere = load.elsewhere()
    finally:
        spinner.kill()
        spinner.wait()
    assert elsewhere is not None and elsewhere >= 0.5, elsewhere  # one process spinning on one core


@linux
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test__default_threads__leave_the_core_another_process_keeps_busy():
    """One of two cores busy (`yes > /dev/null` in the issue) made a 2-thread decode 5x slower than
    one thread: the default leaves that core alone."""
    cores = threads_mod.available_cores()
    spinners = [_spinner() for _ in range(len(os.sched_getaffinity(0)) - 1)]
    try:
        load = CpuLoad()
        time.sleep(1.0)
        n, why = default_threads(load)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    assert n < max(cores, 2) and "busy with other processes" in why, (n, why)


def _api_threads(model_dir, env: dict, code: str = "RocketKV.load(model, device='cpu')") -> tuple[int, int]:
    """(torch's threads, `rk.threads`) after `RocketKV.load` in a fresh Python, as a user's script."""
    script = ("import sys, torch\nfrom rocketkv_cli.api.rocketkv import RocketKV\nmodel = sys.argv[1]\n"
              f"rk = {code}\nprint(torch.get_num_threads(), rk.threads)")  # fmt: skip
    env = {k: v for k, v in {**os.environ, **env}.items() if k not in ("ROCKETKV_THREADS", "OMP_NUM_THREADS")
           or k in env}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, str(model_dir)], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    torch_threads, chosen = done.stdout.split()
    return int(torch_threads), int(chosen)


def test__the_python_api_sets_threads_as_the_command_line_does(tiny_model_dir, tmp_path):
    """`RocketKV.load` applies rocketkv's threads, not torch's default (every core: a new user's
    script decoded 4x slower than the CLI beside a busy core): `threads=`, else
    $ROCKETKV_THREADS, else the measured default, which leaves a core another process keeps busy."""
    home = {"ROCKETKV_HOME": str(tmp_path)}
    assert _api_threads(tiny_model_dir, {**home, "ROCKETKV_THREADS": "1"}) == (1, 1)
    assert _api_threads(tiny_model_dir, home, "RocketKV.load(model, device='cpu', threads=1)") == (1, 1)
    cores = threads_mod.available_cores()
    if cores < 2 or not os.path.exists("/proc/stat"):
        pytest.skip("the measured default needs two cores and /proc/stat")
    spinners = [_spinner() for _ in range(len(os.sched_getaffinity(0)) - 1)]
    try:
        busy = _api_threads(tiny_model_dir, home)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    assert busy[0] == busy[1] and busy[0] < cores, (busy, cores)


@pytest.mark.parametrize(
    "env, want",
    [({"OMP_NUM_THREADS": "1,1"}, (1, "$OMP_NUM_THREADS")), ({"OMP_NUM_THREADS": " 1 "}, (1, "$OMP_NUM_THREADS")),
     ({"ROCKETKV_THREADS": "1", "OMP_NUM_THREADS": "x"}, (1, "$ROCKETKV_THREADS"))],
)  # fmt: skip
def test__requested_threads__omp_num_threads_in_openmps_list_form_counts_its_first_level(monkeypatch, env, want):
    for name in ("ROCKETKV_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert threads_mod.requested_threads() == want


@pytest.mark.parametrize(
    "name, value",
    [
        ("OMP_NUM_THREADS", "two"),
        ("OMP_NUM_THREADS", ",1"),
        ("ROCKETKV_THREADS", "1,1"),
        ("ROCKETKV_THREADS", "１"),
        ("OMP_NUM_THREADS", "1_0"),
        ("ROCKETKV_THREADS", "+1"),
        ("ROCKETKV_THREADS", "\u00a01"),
    ],
)
def test__requested_threads__anything_else_is_a_usage_error_naming_the_variable(monkeypatch, name, value):
    from rocketkv_cli.errors import UsageError

    monkeypatch.delenv("ROCKETKV_THREADS", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=f"\\${name}="):
        threads_mod.requested_threads()
