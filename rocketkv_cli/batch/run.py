"""`rocketkv batch`: run a manifest (docs/batch.md). Reads the manifest, skips what the results
file already answers, and runs the rest in this process (`workers=1`), in `workers` local
processes (`pool.py`), or on a Ray cluster (`ray_pool.py`, imported only then); the work of one
row is `tasks.run_task`. Nothing here parses arguments or prints; progress and logs go through
callbacks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import InputError, OutputError, RocketKVError, UsageError
from .manifest import BadRow, Results, Row, error_row, read_manifest
from .tasks import (
    BatchProgress,
    BatchReport,
    BatchSettings,
    Log,
    Task,
    Tracker,
    document_sha256,
    load_worker,
    plan,
    run_task,
)

# a running `rocketkv serve`, as `rocketkv batch` reaches it: one task sent, its events back
# ({"event": "line", "line"}, {"event": "log", "message"}); errors raised as their rocketkv types
Remote = Callable[[Task], Iterable[dict] | None]  # None: run that task here


def _digest_or_none(row: Row) -> str | None:
    """The row's `document_sha256` now, or None when it cannot be read (its row then fails as
    it would have: its answers are not dropped for that)."""
    try:
        return document_sha256(row)
    except RocketKVError:
        return None


def run_batch(
    manifest: Path,
    output: Path | None,
    cache_dir: Path,
    settings: BatchSettings,
    workers: int | None = None,
    ray_address: str | None = None,
    on_progress: Callable[[BatchProgress], None] = lambda state: None,
    log: Log = lambda message: None,
    remote: Remote | None = None,
) -> BatchReport:
    """Run every row of `manifest` not yet answered in `output` (None: stdout, no resume).

    workers: model copies: local processes (None: 1), or Ray actors with `ray_address` (an
    address, `auto` for a running cluster, or `local` to start one for this run; None: the
    cluster's CPUs divided by `settings.threads`). remote: run each task on a running server
    instead (`rocketkv serve`, which keeps the model loaded and runs `run_task` itself; a task the
    server refuses, such as a document outside its `--allow-dir`, becomes the row's error line;
    `remote` returns None for a task to run in this process: a request over the server's body limit).
    Raises:
        InputError: an unreadable manifest, Ray missing or unreachable. OutputError: the results
        file or cache folder cannot be written. ModelLoadError: the model does not load.
    """
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    rows = read_manifest(manifest)
    if output is not None and output.exists() and os.path.samefile(output, manifest):
        raise OutputError(f"-o {output} is the manifest itself", "choose another results file")
    cache_dir = cache_dir.resolve()
    results = Results(output)
    failed = True
    try:
        done = results.open(rows, _digest_or_none)
        if sum(results.dropped.values()):
            why = {"error": ("error line", "to retry"), "torn": ("line", "cut by a crash"),
                   "stale": ("line", "of changed or repeated rows or documents")}  # fmt: skip
            dropped = [f"{n:,} {why[k][0]}{'s' * (n != 1)} {why[k][1]}" for k, n in results.dropped.items() if n]
            log(f"resuming {output}: dropped " + ", ".join(dropped))
        tasks = plan(rows, done)
        tracker = Tracker(results, tasks, on_progress)
        for row in rows:
            if isinstance(row, BadRow):
                tracker.write(None, error_row(row.id, row.line, row.error))
        skipped = sum(isinstance(r, Row) for r in rows) - len(tasks)
        if skipped:
            log(f"skipping {skipped} row{'s' * (skipped != 1)} already answered in {output}")
        if tasks:
            _make_dir(cache_dir)
            if remote is not None:
                rk = None  # loaded for the first task the server cannot take (a request over its body limit)
                for i, task in enumerate(tasks):
                    sent = remote(task)
                    if sent is None:
                        rk = rk or load_worker(settings)
                        for line in run_task(rk, task, cache_dir, settings, log):
                            tracker.write(i, line)
                        continue
                    try:
                        for event in sent:
                            if event.get("event") == "line":
                                tracker.write(i, event["line"])
                            elif event.get("event") == "log":
                                log(str(event.get("message", "")))
                    except InputError as exc:  # this row refused (a path not allowed, …): the batch goes on
                        tracker.write(i, error_row(task.row.id, task.row.line, str(exc)))
            elif ray_address is not None:
                from .ray_pool import run_on_ray

                run_on_ray(ray_address, tasks, cache_dir, settings, workers, tracker, log)
            elif (workers or 1) == 1:
                rk = load_worker(settings)
                for i, task in enumerate(tasks):
                    for line in run_task(rk, task, cache_dir, settings, log):
                        tracker.write(i, line)
            else:
                from .pool import run_in_pool

                run_in_pool(tasks, cache_dir, settings, workers or 1, tracker, log)
        on_progress(tracker.state)
        failed = False
    finally:
        results.close(failed)
    return BatchReport(n_rows=len(rows), n_skipped=skipped, n_written=tracker.written,
                       n_errors=tracker.state.errors, dropped=dict(results.dropped))  # fmt: skip


def _make_dir(cache_dir: Path) -> None:
    if cache_dir.exists() and not cache_dir.is_dir():  # mkdir said "File exists", and "pass --cache-dir" to one who had
        raise OutputError(f"the cache folder {cache_dir} is a file, not a folder", "give --cache-dir a folder")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the cache folder {cache_dir}: {exc.strerror}",
                          "give --cache-dir a folder you can write") from None  # fmt: skip
    if not os.access(cache_dir, os.W_OK):
        raise OutputError(f"cannot write to the cache folder {cache_dir}", "pass a writable --cache-dir")
