"""`rocketkv eval`: the command (tasks are in `eval_tasks.py`, the runs and scoring in `evaluate.py`)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..api.documents import read_document
from ..errors import InputError, UsageError
from ..eval.names import DEFAULT_METHODS, eval_methods
from ..methods import registry
from .common import StderrConsole, default_kjv, err, load_engine, log, one_line, setup, steps_bar, storage
from .options import DeviceOpt, DtypeOpt, KvDtypeOpt, ModelOpt, QuietOpt, ThreadsOpt, WeightsOpt, path_value


def _ints(name: str, text: str, allow_auto: bool = False) -> tuple[int, ...]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if allow_auto and part == "auto":
            out.append(0)
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise UsageError(f"--{name} must be comma-separated integers{' or auto' if allow_auto else ''}, "
                             f"got {text!r}") from None  # fmt: skip
    return tuple(out)


def _names(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if text.strip() == "all":
        return allowed
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _table(report: dict, n: int, what: str) -> Table:

    rows = [r for r in report["summary"] if r["context_tokens"] == n]
    columns = sorted({(r["label"], r["budget"]) for r in rows}, key=lambda c: (c[1] or 0, c[0] != "full", c[0]))
    tasks = [t for t in report["config"]["tasks"] if any(r["task"] == t for r in rows)] + ["mean"]
    cell = {(r["task"], r["label"], r["budget"]): r for r in rows}
    title = f"rocketkv eval: {report['model']['model_id']}, {n} tokens — {what}"
    table = Table(title=escape(title), title_justify="left")
    table.add_column("task")
    for label, budget in columns:
        table.add_column(escape(label if budget is None else f"{label}\nt={budget}"), justify="right")
    for task in tasks:
        values = []
        for label, budget in columns:
            r = cell.get((task, label, budget))
            v = None if r is None else (r["score"] if what.startswith("score") else r["agreement"])
            values.append("-" if v is None else f"{100 * v:.0f}")
        table.add_row(task, *values, style="bold" if task == "mean" else None)
    return table


def eval_command(
    context_tokens: Annotated[str, typer.Option(help="Comma-separated document lengths in tokens.")] = "4096",
    budgets: Annotated[str, typer.Option(help="Comma-separated token budgets t (tokens).")] = "128,256,512,1024",
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated: full, rocketkv, snapkv (stage 1 only), hsa (stage 2 only), then each stage-1 "
            f"method ({', '.join(registry())}; X_reselect: store budget, per-question re-selection; X_adaptive: "
            f"adaptive layer budgets): {', '.join(eval_methods())}; 'default' ({', '.join(DEFAULT_METHODS)}) or all."
        ),  # fmt: skip
    ] = "default",
    tasks: Annotated[
        str,
        typer.Option(
            help="Comma-separated: niah_noise, niah_text, multikey, multivalue, multiquery, vt, fwe; or all."
        ),  # fmt: skip
    ] = "all",
    samples: Annotated[int, typer.Option(min=1, help="Samples per task and length.")] = 4,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the task generators.")] = 0,
    observations: Annotated[
        str, typer.Option(help="Stage-1 observation windows for rocketkv: tail, probe, wide (comma-separated).")
    ] = "tail",
    pool_kernels: Annotated[str, typer.Option(help="Stage-1 pool kernels for rocketkv: odd sizes or auto.")] = "63",
    window_size: Annotated[int, typer.Option(min=1, help="Observation window W in tokens (tail, probe).")] = 32,
    wide_window_size: Annotated[int, typer.Option(min=1, help="Window of the 'wide' observation, tokens.")] = 128,
    store_factor: Annotated[int, typer.Option(min=2, help="reselect's store budget as a multiple of t.")] = 2,
    reconstruct_pool_kernel: Annotated[int, typer.Option(min=1, help="reconstruct's pool kernel (odd).")] = 7,
    max_new_tokens: Annotated[
        Optional[int], typer.Option(min=1, help="Answer cap in tokens (default: each task's own).")
    ] = None,
    haystack: Annotated[
        Optional[Path],
        typer.Option(
            parser=path_value,
            help="Real text for niah_text (default: shared/data/kjv.txt in or above the current directory).",
        ),
    ] = None,
    json_path: Annotated[
        Optional[Path],
        typer.Option(
            "--json", parser=path_value, help="Write the report (every record, configuration, versions) here."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace an existing --json file.")] = False,
    stage2: Annotated[
        str,
        typer.Option(
            help="How pruned caches decode: hsa (each method's stage 2) or exact (exact attention, as ask on a CPU)."
        ),  # fmt: skip
    ] = "hsa",
    kv_dtype: KvDtypeOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    quiet: QuietOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Score full attention, rocketkv and baselines on generated long-context tasks (docs/accuracy.md)."""
    from ..api.rocketkv import DEFAULT_MODEL
    from ..eval.bench import machine_info

    setup(quiet, threads)
    numbers = {"samples": samples, "seed": seed, "window_size": window_size, "wide_window_size": wide_window_size,
               "max_new_tokens": max_new_tokens, "store_factor": store_factor,
               "reconstruct_pool_kernel": reconstruct_pool_kernel}  # fmt: skip
    cfg = eval_config(methods, tasks, stage2, context_tokens, budgets, observations, pool_kernels, kv_dtype, numbers)
    check_report_path(json_path, force)
    cfg, haystack_text, haystack_path = with_haystack(cfg, haystack)
    engine = load_engine(model or DEFAULT_MODEL, device, dtype or "auto", False, weights).engine
    report = run_with_progress(engine, cfg, haystack_text)
    report["config"]["haystack"] = str(haystack_path) if haystack_text is not None else None
    report["versions"] = machine_info()
    report["date"] = time.strftime("%Y-%m-%d")  # the run's day, for pages rendered later from the JSON
    for row in report["summary"]:
        typer.echo(json.dumps({"model": engine.loaded.model_id, **row}))
    if not quiet:
        console = StderrConsole(width=max(err.width, 160))
        for n in cfg.context_tokens:
            console.print(_table(report, n, "score % (expected values found)"))
            if "full" in cfg.methods:
                console.print(_table(report, n, "agreement % with full attention (greedy tokens)"))
    if json_path is not None:
        write_report(json_path, force, json.dumps(report, indent=1, ensure_ascii=False))


def eval_config(methods: str, tasks: str, stage2: str, context_tokens: str, budgets: str, observations: str,
                pool_kernels: str, kv_dtype: Optional[str], numbers: dict):  # fmt: skip
    """The options as an `EvalConfig` (`numbers`: its integer fields as given), checked before the
    model loads. Raises UsageError naming the option."""
    from ..eval.plan import OBSERVATIONS, EvalConfig
    from ..eval.tasks import TASKS

    task_list = _names(tasks, TASKS)
    method_list = DEFAULT_METHODS if methods.strip() == "default" else _names(methods, eval_methods())
    if stage2 == "exact" and methods.strip() in ("all", "default"):  # stage 2 alone has no meaning without stage 2
        method_list = tuple(m for m in method_list if m != "hsa")
    try:
        return EvalConfig(
            context_tokens=_ints("context-tokens", context_tokens), budgets=_ints("budgets", budgets),
            methods=method_list, tasks=task_list, observations=_names(observations, OBSERVATIONS),
            pool_kernels=_ints("pool-kernels", pool_kernels, True),
            kv_dtype=storage(kv_dtype).name if kv_dtype is not None else None, stage2=stage2, **numbers,
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"invalid option: {exc}") from None


def check_report_path(json_path: Optional[Path], force: bool) -> None:
    """Refuse a `--json` path before the run (`api.preflight.check_report`). Raises OutputError."""
    from ..api.preflight import check_report

    if json_path is not None:
        check_report(json_path, force)


def write_report(json_path: Path, force: bool, text: str) -> None:
    """`text` (a JSON report) at `json_path`, whole or not at all. Raises OutputError."""
    from ..api.preflight import write_report as write

    write(json_path, force, text)
    log(f"wrote {one_line(str(json_path))}")


def with_haystack(cfg, haystack: Optional[Path]):
    """(cfg, haystack text or None, its path) for niah_text: `--haystack`, else shared/data/kjv.txt;
    without either, niah_text is skipped (a line on stderr). Raises InputError when niah_text was
    the only task, or for an unreadable `--haystack`."""
    from ..eval.tasks import NEEDS_HAYSTACK_TEXT

    haystack_text, haystack_path = None, haystack or default_kjv()
    if any(t in NEEDS_HAYSTACK_TEXT for t in cfg.tasks):
        if haystack_path is not None:  # an explicit --haystack that is missing fails here
            haystack_text = read_document(str(haystack_path)).text
        else:
            kept = tuple(t for t in cfg.tasks if t not in NEEDS_HAYSTACK_TEXT)
            if not kept:
                raise InputError("niah_text needs real text and none was found", "pass --haystack FILE")
            log("skipping niah_text: no real text found (pass --haystack FILE, e.g. ../shared/data/kjv.txt)")
            cfg = dataclasses.replace(cfg, tasks=kept)
    return cfg, haystack_text, haystack_path


def run_with_progress(engine, cfg, haystack_text: Optional[str]) -> dict:
    """`run_eval` with a bar on stderr (or, without a live bar, a line per sample with its ETA).
    Returns the report."""
    import tempfile

    from ..eval.runner import run_eval

    with steps_bar() as bar, tempfile.TemporaryDirectory(prefix="rocketkv-eval-") as tmp:
        task = bar.add_task("eval", total=None)
        started = time.perf_counter()

        def on_progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)
            if bar.disable and what.endswith(": prefill"):  # no live bar (a log file): one line per sample
                left = (time.perf_counter() - started) / done * (total - done) if done else None
                log(f"{done}/{total} steps; {what}" + (f"; ETA {left / 60:.0f} min" if left is not None else ""))

        return run_eval(engine, cfg, Path(tmp), haystack_text, on_progress)
