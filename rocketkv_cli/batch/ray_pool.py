"""`rocketkv batch --ray`: the manifest as a Ray Dataset, rows run by actors that each hold a model.

`ray.data.from_items` makes one block per task; `map_batches(RowActor, batch_size=1,
compute=ActorPoolStrategy(size=workers))` runs each document's ingest and answers in an actor
that loaded the model once, writing `.kv` files to the (shared) cache folder. Ray's streaming
executor applies its own backpressure; a task whose actor dies is retried on a restarted actor
(Ray Data's actor defaults: `max_restarts=-1`, `max_task_retries=-1`, without a limit). The
driver (this process) is the only writer of the results file and writes each document's lines
when its output block arrives, so a retried block never writes twice.
Needs `pip install 'rocketkv[ray]'`; nothing imports Ray until `run_on_ray` runs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError, ModelLoadError, RocketKVError

if TYPE_CHECKING:
    from .tasks import BatchSettings, Log, Task, Tracker


FATAL = "__rocketkv_fatal__"  # an actor's line saying its model did not load


class RowActor:
    """A Ray Data actor: one loaded model, then `__call__` on batches of task rows.

    Input batch: `{"index": [int], "task": [Task JSON]}`; output: `{"index": [int], "line":
    [result line JSON]}`, every result line of those tasks (see `batch.tasks.run_task`)."""

    def __init__(self, settings: BatchSettings, cache_dir: str):
        from ..api.rocketkv import configure
        from .tasks import load_worker

        configure(quiet=True, progress_bars=False)
        self.settings, self.cache_dir = settings, Path(cache_dir)
        self.rk, self.fatal = None, ""
        try:
            self.rk = load_worker(settings, workers=1)
        except RocketKVError as exc:  # no row can run: say so (Ray would restart a failing actor forever)
            self.fatal = str(exc)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        from .tasks import Task, run_task

        if self.rk is None:
            return {"index": [int(i) for i in batch["index"]][:1], "line": [json.dumps({FATAL: self.fatal})]}
        indices, lines = [], []
        for index, task_json in zip(batch["index"], batch["task"]):
            for line in run_task(self.rk, Task.from_json(str(task_json)), self.cache_dir, self.settings):
                indices.append(int(index))
                lines.append(json.dumps(line, ensure_ascii=False))
        return {"index": indices, "line": lines}


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """For a `host:port` address (or `ray://host:port`), refuse one nothing listens on within
    `timeout_s` seconds: `ray.init` retries such an address for minutes while printing its own
    log lines. `auto` and `local` are Ray's to resolve. Raises InputError."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port: left to Ray, which names what it cannot parse
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
        raise InputError(f"cannot reach a Ray cluster at {address!r}: {why}",
                         "start one with `ray start --head`, or pass --ray local") from None  # fmt: skip


def _connect(address: str, workers: int | None):
    """Import Ray and join (`auto`, an address) or start (`local`) a cluster. Raises InputError."""
    if address == "local":  # a private one-machine cluster: keep it on the loopback address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        import ray.data  # noqa: F401  (Ray Data is the `data` extra of ray)
    except ImportError:
        raise InputError("--ray needs Ray Data installed", "pip install 'rocketkv[ray]'") from None
    if ray.is_initialized():
        return ray, False
    _check_reachable(address)
    try:
        ray.init(address=None if address == "local" else address, num_cpus=workers if address == "local" else None,
                 include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"cannot reach a Ray cluster at {address!r}: {first}",
                         "start one with `ray start --head`, or pass --ray local") from None  # fmt: skip
    return ray, True


def run_on_ray(address: str, tasks: list[Task], cache_dir: Path, settings: BatchSettings, workers: int | None,
               tracker: Tracker, log: Log) -> None:  # fmt: skip
    """Run `tasks` on a Ray cluster with `workers` actors (None: the cluster's CPUs / threads per
    actor); every line goes through `tracker`.

    cache_dir must be a path every node sees (shared storage); so must document paths.
    Raises InputError: Ray is missing or the cluster cannot be reached."""
    ray, started = _connect(address, workers)
    try:
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # the CLI draws its own bar
        ctx.execution_options.preserve_order = False  # results are keyed; write them as they come
        threads = settings.threads or 1
        if workers is None:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
        workers = min(workers, len(tasks))
        items = [{"index": i, "task": t.to_json()} for i, t in enumerate(tasks)]
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        out = ds.map_batches(
            RowActor, fn_constructor_kwargs={"settings": settings, "cache_dir": str(cache_dir)}, batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=threads,
        )  # fmt: skip
        log(f"running {len(tasks)} rows on Ray with {workers} actors ({threads} CPU each)")
        for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
            for index, line in zip(batch["index"], batch["line"]):
                row = json.loads(str(line))
                if FATAL in row:
                    raise ModelLoadError(str(row[FATAL]))
                tracker.write(int(index), row)
    finally:
        if started:
            ray.shutdown()
