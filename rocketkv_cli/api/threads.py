"""How many threads torch computes with. Standard library only until `apply` (the CLI resolves the
number before torch is imported).

torch's own default is the machine's core count, whatever this process may use: on a 2-core
machine where another process is busy, or in a container limited to one CPU, that oversubscribes
the cores (a decode measured at 862 ms/token with torch's default against 103 ms/token with one
thread on a loaded 2-core machine). rocketkv's default is the cores this process may actually
run on: its CPU affinity (`taskset`, `sched_setaffinity`), capped by the cgroup CPU quota
(`cpu.max` of cgroup v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` of v1) rounded up.
`--threads N` or `$ROCKETKV_THREADS` override it; `$OMP_NUM_THREADS` is honoured too.
"""

from __future__ import annotations

import math
import os

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


def resolve_threads(threads: int | None = None) -> tuple[int, str]:
    """(threads, where the number came from): `threads` if given, else `$ROCKETKV_THREADS`, else
    `$OMP_NUM_THREADS`, else `available_cores()`. Raises UsageError for a value < 1, above the
    machine's logical CPUs (`os.cpu_count()`), or not a number."""
    if threads is not None:
        source = "--threads"
    else:
        source = next((name for name in ("ROCKETKV_THREADS", "OMP_NUM_THREADS") if os.environ.get(name)), "")
        if source:
            raw = os.environ[source]
            try:
                threads = int(raw)
            except ValueError:
                raise UsageError(f"${source}={raw!r} is not a whole number of threads") from None
            source = f"${source}"
        else:
            threads, source = available_cores(), "the cores this process may use (affinity, cgroup quota)"
    if threads < 1:
        raise UsageError(f"{source}: the number of threads must be ≥ 1, got {threads}")
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise UsageError(f"{source}: {threads} threads is more than this machine's {cpus} CPUs "
                         f"(threads beyond them only wait for each other); use at most {cpus}")  # fmt: skip
    return threads, source


def apply(threads: int) -> None:
    """Make torch compute with `threads` threads (intra-op). Imports torch."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
