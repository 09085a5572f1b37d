"""What a server keeps warm: loaded models and opened `.kv` caches, least recently used first out,
bounded by a memory budget (bytes), and the decode lock that lets one answer run at a time.

A cache is keyed by its resolved path and remembered with the file's identity (device, inode,
size, modification time in ns, change time in ns): a file replaced on disk (an `ingest --force`,
a copy over it) differs in at least one of them and is read again, never answered from the bytes
of the old file. The check is one `stat` per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..api.rocketkv import RocketKV, read_cache
from ..api.threads import CpuLoad, apply, available_cores, threads_for
from ..core.cache import AnyCache

FileIdentity = tuple[int, int, int, int, int]


def file_identity(path: Path) -> FileIdentity:
    """(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) of `path`. Raises OSError."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class ModelKey:
    """What makes two loaded models the same: the name given to `RocketKV.load` and its options."""

    model: str
    device: str
    dtype: str
    weights: str | None
    trust_remote_code: bool


@dataclass
class _WarmCache:
    identity: FileIdentity
    cache: AnyCache
    checked_for: set[ModelKey]

    @property
    def n_bytes(self) -> int:
        """The larger of the file's size and the bytes the cache holds in memory now
        (`resident_bytes`: while its layers are read, float32 keys and values decoded from the
        file's codes, 4–8× its size; they leave memory once a decoder has its own copy)."""
        return max(self.identity[2], self.cache.resident_bytes)


def _model_bytes(rk: RocketKV) -> int:
    model = rk.engine.loaded.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


class Warm:
    """Models and caches kept loaded, bounded by `memory_budget` bytes: what each holds in memory,
    counted again after every job (`settle`): a model's parameters and buffers plus the decode
    buffers it keeps (`RocketKV.held_bytes`), a cache's file size until it is read, then its
    tensors (`resident_bytes`). The model and the cache a job uses are never evicted for it, nor,
    after it, the model and the cache it used, so one model and one cache larger than the budget
    still work, and stay warm, alone. `lock` serialises decodes: the
    server runs one answer at a time with all its threads, so concurrent clients never
    oversubscribe the cores."""

    def __init__(self, memory_budget: int, threads: int | None = None, compile_step: bool = False,
                 log: Callable[[str], None] = lambda message: None):  # fmt: skip
        if memory_budget < 1:
            raise ValueError(f"memory_budget must be ≥ 1 byte, got {memory_budget}")
        self.memory_budget = memory_budget
        self.threads = threads  # None: chosen before each job from the cores other processes leave idle
        self.compile_step = compile_step  # models decode through a compiled step (`RocketKV.load`)
        self.log = log  # the server's own log (its stderr): each model it loads
        self.load = CpuLoad()
        self.current_threads = threads or available_cores()
        self.models: OrderedDict[ModelKey, tuple[RocketKV, int]] = OrderedDict()
        self.caches: OrderedDict[Path, _WarmCache] = OrderedDict()
        self.lock = threading.Lock()
        self.reloads = 0  # caches read again because their file changed (for /health and tests)
        self._job_cache: Path | None = None  # the cache the running job opened (kept when it settles)

    def used_bytes(self) -> int:
        """Bytes the warm models and caches hold now (see the class)."""
        models, caches = list(self.models.values()), list(self.caches.values())  # snapshots (see `describe`)
        return sum(n + rk.held_bytes() for rk, n in models) + sum(c.n_bytes for c in caches)

    @contextlib.contextmanager
    def job(self, waiting: Callable[[float | None], None] = lambda waited: None) -> Iterator[None]:
        """The decode lock for one job, run with the threads chosen for it (`--threads`, else the
        cores other processes left idle since the last job started: `api.threads.CpuLoad`); when
        the job ends (or fails) what is held is `settle`d. When another job holds the lock,
        `waiting(None)` is called before the wait and `waiting(seconds waited)` after it."""
        if not self.lock.acquire(blocking=False):
            t0 = time.monotonic()
            waiting(None)
            self.lock.acquire()
            waiting(time.monotonic() - t0)
        self._job_cache = None
        try:
            if self.threads is None and (busy := self.load.elsewhere()) is not None:
                self.current_threads = threads_for(available_cores(), self.load.n_cores, busy)
            apply(self.current_threads)
            try:
                yield
            finally:
                self.settle()
        finally:
            self.lock.release()

    def settle(self) -> None:
        """After a job (under `lock`): evict least recently used entries until what is held fits
        the budget again, keeping the model used last and the cache the job opened, if any (a
        cache grows when it is first answered from: its layers are read and decoded, a model keeps
        decode buffers; an ingest opens none, and keeps none of the caches before it)."""
        self._evict(keep_model=next(reversed(self.models), None), keep_cache=self._job_cache)

    def _evict(self, keep_model: ModelKey | None = None, keep_cache: Path | None = None, models: bool = True) -> None:
        """Evict least recently used entries, caches first, until what is held fits the budget,
        never `keep_model` or `keep_cache`, and no model unless `models`."""
        while self.used_bytes() > self.memory_budget:
            cache = next((p for p in self.caches if p != keep_cache), None)
            if cache is not None:
                self._forget(cache)
                continue
            if not models:
                return
            model = next((k for k in self.models if k != keep_model), None)
            if model is None:
                return
            del self.models[model]

    def cache(self, path: Path) -> AnyCache:
        """The cache at `path` (resolved), read and validated on first use or when the file changed.
        Raises CacheFormatError (a damaged file), InputError/OSError (a missing one)."""
        identity = file_identity(path)
        warm = self.caches.get(path)
        self._job_cache = path
        if warm is not None and warm.identity == identity:
            self.caches.move_to_end(path)
            return warm.cache
        if warm is not None:
            self.reloads += 1
            self._forget(path)
        cache = read_cache(path)
        if file_identity(path) != identity:  # replaced while it was read: read the new one next time
            return cache
        self.caches[path] = _WarmCache(identity, cache, set())
        self._evict(keep_cache=path, models=False)  # which model the job needs is not known yet: `model` evicts
        return cache

    def _forget(self, path: Path) -> None:
        """Drop the cache of `path` and the decode buffers a model keeps over it (`RocketKV.release`)."""
        warm = self.caches.pop(path)
        for rk, _ in self.models.values():
            rk.release(warm.cache)

    def model(self, key: ModelKey, log=lambda message: None, loading=lambda message: None,
              keep_cache: Path | None = None) -> RocketKV:  # fmt: skip
        """The model for `key`, loaded on first use; `auto` device and dtype are resolved first,
        so that a request naming them and one naming what they resolve to share one model.
        Other entries are evicted to fit the budget (before a load too, where the budget is
        already spent), never `keep_cache` (the cache the job answers from).
        A load is announced with `loading(message)` before it starts (the client's spinner), and
        its "loaded ... in N s" line goes to `log` (the client) and to the server's own log.
        Raises ModelLoadError."""
        device, dtype = RocketKV.placement(key.device, key.dtype)
        key = dataclasses.replace(key, device=device, dtype=dtype)
        if key in self.models:
            self.models.move_to_end(key)
            self._evict(keep_model=key, keep_cache=keep_cache)
            return self.models[key][0]
        self._evict(keep_cache=keep_cache)  # room for the new model: never two at once in a spent budget
        loading(f"loading {key.model} in the server")
        t0 = time.perf_counter()
        rk = RocketKV.load(key.model, device=key.device, dtype=key.dtype, trust_remote_code=key.trust_remote_code,
                           log=log, weights=key.weights, threads=self.current_threads,  # as `job` set them
                           compile_step=self.compile_step)  # fmt: skip
        line = f"loaded {rk.description} in {time.perf_counter() - t0:.1f}s"
        self.log(line)
        log(line + " (in the server)")
        self.models[key] = (rk, _model_bytes(rk))
        self._evict(keep_model=key, keep_cache=keep_cache)
        return rk

    def check(self, rk: RocketKV, key: ModelKey, path: Path, cache: AnyCache, display: str) -> None:
        """`rk.check(cache)` once per (model, cache file). Raises CacheFormatError."""
        warm = self.caches.get(path)
        if warm is not None and warm.cache is cache and key in warm.checked_for:
            return
        rk.check(cache, display)
        if warm is not None and warm.cache is cache:
            warm.checked_for.add(key)

    def describe(self) -> dict:
        """What is warm, for `/health` (read from the event loop while a job may change it: snapshots
        taken by `list`, which does not let another thread run while it copies)."""
        models, caches = list(self.models.items()), list(self.caches.items())
        buffers = sum(rk.held_bytes() for _, (rk, _) in models)
        captured = sum(getattr(rk.engine.step, "captured_steps", 0) for _, (rk, _) in models)
        failures = [f for _, (rk, _) in models if (f := getattr(rk.engine.step, "failure", None))]
        used = sum(n for _, (_, n) in models) + buffers + sum(c.n_bytes for _, c in caches)
        return {"models": [k.model for k, _ in models],
                "model_descriptions": [rk.description for _, (rk, _) in models],  # a model loaded twice: which
                "caches": [str(p) for p, _ in caches], "used_bytes": used,
                "decode_buffers_bytes": buffers, "memory_budget_bytes": self.memory_budget,
                "reloads": self.reloads, "compile_step": self.compile_step,
                "captured_steps": captured, "compile_failure": failures[0] if failures else None}  # fmt: skip
