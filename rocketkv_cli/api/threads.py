"""How many threads torch computes with. Standard library only until `apply` (the CLI resolves the
number before torch is imported).

torch's own default is the machine's core count, whatever this process may use: on a 2-core
machine where another process is busy, or in a container limited to one CPU, that oversubscribes
the cores (a decode measured at 862 ms/token with torch's default against 103 ms/token with one
thread on a loaded 2-core machine). rocketkv's default is the cores this process may actually
run on: its CPU affinity (`taskset`, `sched_setaffinity`), capped by the cgroup CPU quota
(`cpu.max` of cgroup v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` of v1) rounded up.
`--threads N` or `$ROCKETKV_THREADS` override it; `$OMP_NUM_THREADS` is honoured too.

Cores busy with other processes count too (`CpuLoad`, from /proc/stat): with one of two cores
busy (`yes > /dev/null`), a decode with 2 threads took 1016 ms/token against 219 ms/token with 1,
because each of the step's many small parallel operations waits for the thread that is not
running. The default is the cores this process may use minus those other processes kept busy,
on average, since it started (rounded; at least 1): measured when the model loads, after the
seconds of importing torch, and by a server before each job.
"""

from __future__ import annotations

import math
import os
import re
import time

from ..errors import UsageError


def _cgroup_quota_cpus() -> float | None:
    """CPUs allowed by the cgroup quota (may be fractional), or None when unlimited or unknown."""
    own = ""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:  # v2: "0::/path/of/this/process"
            own = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), "")
    except (OSError, IndexError):
        pass
    for folder in dict.fromkeys((f"/sys/fs/cgroup{own}".rstrip("/"), "/sys/fs/cgroup")):
        try:
            with open(f"{folder}/cpu.max", encoding="ascii") as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            continue
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", encoding="ascii") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us", encoding="ascii") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """The cores this process may run on: its affinity set, capped by the cgroup quota (≥ 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_quota_cpus()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


MIN_WINDOW_S = 0.5  # a shorter window says too little about other processes' load


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def busy_seconds(stat_text: str, cpus: set[int], tick: int) -> dict[int, float]:
    """CPU seconds each core of `cpus` has been busy since boot, from /proc/stat's text: all but
    idle and iowait, steal included (a core the hypervisor gave away is not ours); guest time is
    already inside user and nice. Cores absent from the text (offline) are absent here."""
    busy: dict[int, float] = {}
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            v = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
            busy[int(name[3:])] = (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / tick
    return busy


def _sample(cpus: set[int]) -> tuple[float, dict[int, float], float] | None:
    """(monotonic s, `busy_seconds` of `cpus`, this process's CPU seconds), or None where
    /proc/stat cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            text = f.read()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    own = os.times()
    return time.monotonic(), busy_seconds(text, cpus, tick), own.user + own.system


class CpuLoad:
    """How busy other processes kept this process's cores between two samples (the first taken
    when made): the cores of the affinity set, their busy CPU time less this process's own, over
    the wall time between (Linux /proc/stat; elsewhere unknown). Inside a container /proc/stat
    shows the host's cores: what counts is how many of them stay idle (`threads_for`)."""

    def __init__(self) -> None:
        self.cpus = _affinity()
        self._last = _sample(self.cpus)

    def elsewhere(self, wait: bool = False) -> float | None:
        """Cores busy with other processes since the last sample (≥ 0; over the cores present in
        both samples, each core's time ≥ 0: one going offline or coming back does not count),
        and a new sample taken; None when unknown or when less than `MIN_WINDOW_S` passed (the
        last sample is kept), unless `wait`: then it sleeps out the rest of that window first."""
        if wait and self._last is not None:
            time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - self._last[0])))
        now, last = _sample(self.cpus), self._last
        if now is None or last is None or now[0] - last[0] < MIN_WINDOW_S:
            return None
        self._last = now
        busy = sum(max(0.0, now[1][c] - last[1][c]) for c in now[1].keys() & last[1].keys())
        return max(0.0, (busy - (now[2] - last[2])) / (now[0] - last[0]))

    @property
    def n_cores(self) -> int:
        """The cores of the affinity set (the idle ones are what `threads_for` counts)."""
        return len(self.cpus)


_SINCE_START = CpuLoad()  # imported when a command starts (`cli.common.setup`)


def requested_threads(threads: int | None = None) -> tuple[int, str] | None:
    """(threads, where the number came from) when one was asked for: `threads` if given, else
    `$ROCKETKV_THREADS`, else `$OMP_NUM_THREADS` (its first level where it lists one per nesting
    level, as OpenMP reads "4,2"); None: choose (`resolve_threads`). Raises
    UsageError for a value < 1, above the machine's logical CPUs (`os.cpu_count()`), or not a
    number."""
    if threads is not None:
        source = "--threads"
    else:
        source = next((name for name in ("ROCKETKV_THREADS", "OMP_NUM_THREADS") if os.environ.get(name)), "")
        if not source:
            return None
        raw = os.environ[source]
        # OpenMP's list form gives each nesting level its count ("4,2"): the first is the process's
        level = raw.split(",")[0] if source == "OMP_NUM_THREADS" else raw
        if not re.fullmatch(r"[ \t]*[0-9]+[ \t]*", level):  # int() takes "１", "1_0" and "+1": OpenMP does not
            raise UsageError(f"${source}={raw!r} is not a whole number of threads")
        threads = int(level)
        source = f"${source}"
    return _checked(threads, source), source


def default_threads(load: CpuLoad | None = None, wait: bool = False) -> tuple[int, str]:
    """(threads, why): `available_cores()` less the cores other processes kept busy since `load`
    last sampled (default: since this module was imported), rounded, at least 1; `wait`: sleep out
    the rest of a window shorter than `MIN_WINDOW_S` rather than not know (a Python script may
    load a small model a moment after its imports)."""
    cores, load = available_cores(), load or _SINCE_START
    busy = load.elsewhere(wait=wait and cores > 1)
    if busy is None or cores == 1:
        return cores, "the cores this process may use: affinity, cgroup quota"
    why = f"{cores} cores this process may use, {busy:.1f} of {load.n_cores} busy with other processes"
    return threads_for(cores, load.n_cores, busy), why


def threads_for(cores: int, n_cores: int, busy: float) -> int:
    """Threads for a process that may use `cores` (its affinity set of `n_cores` capped by a
    cgroup quota) while other processes keep `busy` of those `n_cores` busy: the idle cores,
    rounded to the nearest whole one, at least 1 and at most `cores`. (A container's 2-CPU
    quota on a 64-core host whose other tenants keep 30 busy still gets 2.)"""
    return max(1, min(cores, math.floor(n_cores - busy + 0.5)))


def resolve_threads(threads: int | None = None) -> tuple[int, str]:
    """(threads, where the number came from): `requested_threads(threads)`, else
    `default_threads()`. Raises UsageError as `requested_threads`."""
    return requested_threads(threads) or default_threads()


def _checked(threads: int, source: str) -> int:
    if threads < 1:
        raise UsageError(f"{source}: the number of threads must be ≥ 1, got {threads}")
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise UsageError(f"{source}: {threads} threads is more than this machine's {cpus} CPUs "
                         f"(threads beyond them only wait for each other); use at most {cpus}")  # fmt: skip
    return threads


def apply(threads: int) -> None:
    """Make torch compute with `threads` threads (intra-op). Imports torch."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
