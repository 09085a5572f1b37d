"""`rocketkv batch --workers N` on one machine: N processes, each loading the model once.

The parent hands out tasks through a queue and is the only writer of the results file; each
worker sends every result line as soon as it is made. Workers ignore Ctrl-C (the parent stops
them), leave when the parent is gone, and a worker that dies (killed, out of memory) costs one
error line for the row it was on and is replaced.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelLoadError, RocketKVError
from .manifest import error_row

if TYPE_CHECKING:
    from .tasks import BatchSettings, Log, Task, Tracker

POLL_S = 0.5


def _worker(worker_id: int, settings: BatchSettings, workers: int, cache_dir: Path, tasks, results, parent: int):
    """A worker process: load the model, then run tasks until the `None` sentinel or the parent is gone."""
    from ..api.rocketkv import configure
    from .tasks import Task, load_worker, run_task

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # so does a closed terminal's hangup
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    configure(quiet=True, progress_bars=False)
    try:
        rk = load_worker(settings, workers)
    except RocketKVError as exc:
        results.put(("fatal", worker_id, str(exc)))
        return
    results.put(("ready", worker_id, None))
    while True:
        try:
            item = tasks.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if item is None:
            return
        index, task_json = item
        results.put(("start", worker_id, index))
        for line in run_task(rk, Task.from_json(task_json), cache_dir, settings):
            results.put(("line", worker_id, (index, line)))
            if os.getppid() != parent:
                return
        results.put(("done", worker_id, index))


class _Pool:
    def __init__(self, settings: BatchSettings, workers: int, cache_dir: Path):
        self.ctx = mp.get_context("spawn")  # no fork of a process that may hold torch threads
        self.settings, self.workers, self.cache_dir = settings, workers, cache_dir
        self.tasks = self.ctx.Queue()
        self.results = self.ctx.Queue()
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.current: dict[int, int | None] = {}
        self.next_id = 0

    def start_worker(self) -> None:
        wid, self.next_id = self.next_id, self.next_id + 1
        args = (wid, self.settings, self.workers, self.cache_dir, self.tasks, self.results, os.getpid())
        proc = self.ctx.Process(target=_worker, args=args, daemon=True, name=f"rocketkv-batch-{wid}")
        proc.start()
        self.procs[wid], self.current[wid] = proc, None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.tasks.cancel_join_thread()
        self.results.cancel_join_thread()


def run_in_pool(tasks: list[Task], cache_dir: Path, settings: BatchSettings, workers: int, tracker: Tracker,
                log: Log) -> None:  # fmt: skip
    """Run `tasks` in `workers` processes; every line goes through `tracker` (the only writer).

    Raises ModelLoadError: the model does not load in a worker (then nothing can run)."""
    n = min(workers, len(tasks))
    pool = _Pool(settings, n, cache_dir)
    for i, task in enumerate(tasks):
        pool.tasks.put((i, task.to_json()))
    for _ in range(n):
        pool.tasks.put(None)
    ended: set[int] = set()
    try:
        for _ in range(n):
            pool.start_worker()
        while len(ended) < len(tasks):
            try:
                kind, wid, payload = pool.results.get(timeout=POLL_S)
            except queue.Empty:
                _reap(pool, tasks, tracker, ended, log)
                continue
            if kind == "fatal":
                raise ModelLoadError(str(payload))
            if kind == "start":
                pool.current[wid] = payload
            elif kind == "line":
                index, line = payload
                tracker.write(index, line)
            elif kind == "done":
                pool.current[wid] = None
                ended.add(payload)
    finally:
        pool.stop()


def _reap(pool: _Pool, tasks: list[Task], tracker: Tracker, ended: set[int], log: Log) -> None:
    """Replace dead workers; the row a dead one was on gets an error line (added to `ended`).
    When every worker has left and rows are still open (a task lost with a dying worker), those
    rows get error lines too, so the run always ends."""
    for wid, proc in list(pool.procs.items()):
        if proc.is_alive() or proc.exitcode == 0:
            continue
        index = pool.current.pop(wid, None)
        del pool.procs[wid]
        how = f"signal {-proc.exitcode}" if proc.exitcode is not None and proc.exitcode < 0 else f"exit {proc.exitcode}"
        log(f"worker {wid} died ({how}); starting another")
        if index is not None:
            _fail(tasks, index, tracker, ended, f"the worker process died ({how}) on this row")
        pool.start_worker()
    if not any(proc.is_alive() for proc in pool.procs.values()):
        for index in range(len(tasks)):
            if index not in ended:
                _fail(tasks, index, tracker, ended, "this row was not run (its worker left)")


def _fail(tasks: list[Task], index: int, tracker: Tracker, ended: set[int], what: str) -> None:
    row = tasks[index].row
    tracker.write(index, error_row(row.id, row.line, f"{what} — rerun the same command to retry it"))
    ended.add(index)
