"""`rocketkv batch`: many documents and questions from a JSON-lines manifest (docs/batch.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text

from ..errors import UsageError
from ..signals import Terminated
from .answers import FocusOpt, usage_error
from .common import echo_path, err, fail, log, one_line, plural, prefill_config, setup, spinners, storage
from .options import (
    BudgetOpt,
    DeviceOpt,
    DtypeOpt,
    KvDtypeOpt,
    ModelOpt,
    NoServerOpt,
    QuietOpt,
    SegmentTokensOpt,
    ServerOpt,
    TrustOpt,
    path_text,
    path_value,
)


def _since_first(task) -> tuple[float, float, float]:
    """(documents, answers, seconds) since the run's first result (`first` in the task's fields:
    its elapsed time and counts then), so that the model's load and a start-up before it are not
    averaged into the rates; before a second sample, since the bar started."""
    elapsed = task.elapsed or 0.0
    first = task.fields.get("first")
    if first is not None and task.completed > first[1] and elapsed > first[0]:
        return task.completed - first[1], task.fields.get("answers", 0) - first[2], elapsed - first[0]
    return task.completed, task.fields.get("answers", 0), elapsed


class _Rates(ProgressColumn):
    """Documents and questions per second, averages since the first result (Rich's windowed speed
    read 125 documents/s for the whole ingest of a third document, two small ones having finished
    within a few milliseconds), short enough for an 80-column terminal."""

    def render(self, task) -> Text:
        docs_done, answers, seconds = _since_first(task)
        docs = f"{docs_done / seconds:.2f}/s" if seconds > 0 and docs_done else "–/s"
        qs = f"{answers / seconds:.2f} questions/s" if seconds > 0 and answers else "– questions/s"
        return Text(f"{docs}  {qs}")


class _Left(ProgressColumn):
    """The time left at the average rate (`_Rates`): documents left × seconds / documents done."""

    def render(self, task) -> Text:
        docs_done, _, seconds = _since_first(task)
        if not docs_done or task.total is None or seconds <= 0:
            return Text("-:--:--")
        left = round((task.total - task.completed) * seconds / docs_done)
        return Text(f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}")


def batch_bar() -> Progress:
    """The documents done, their rate and the questions', and the time left, on a terminal
    (78 columns at most: `batch ━━━━━━━━━━━━━━━━ 12/340 documents 0.10/s 0.82 questions/s ETA 0:54:10`)."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(bar_width=16), MofNCompleteColumn(), TextColumn("documents"),
        _Rates(), TextColumn("ETA"), _Left(), console=err,
        disable=not spinners(), transient=True,
    )  # fmt: skip


def with_bare_ray(argv: list[str]) -> list[str]:
    """`rocketkv batch … --ray` with no value (last, or before another option) means `--ray auto`
    (Typer options cannot take an optional value)."""
    if not argv or argv[0] != "batch" or "--" in argv:
        return argv
    out = list(argv)
    for i in range(len(out) - 1, 0, -1):
        if out[i] == "--ray" and (i == len(out) - 1 or out[i + 1].startswith("-")):
            out.insert(i + 1, "auto")
    return out


def _stem(manifest: Path) -> str:
    return manifest.name.removesuffix(".jsonl")


def default_output(manifest: Path) -> Path:
    """MANIFEST.jsonl → MANIFEST.results.jsonl beside it."""
    return manifest.with_name(_stem(manifest) + ".results.jsonl")


def batch_command(
    manifest: Annotated[
        Path,
        typer.Argument(
            metavar="MANIFEST",
            parser=path_value,
            help='JSON lines: {"id", "document" | "text", "questions", "summary"} per document.',
        ),
    ],  # fmt: skip
    output: Annotated[
        Optional[str],
        typer.Option(
            "--output",
            "-o",
            parser=path_text,
            help="Results (JSON lines; - = stdout). Default: MANIFEST.results.jsonl.",
        ),
    ] = None,
    cache_dir: Annotated[
        Optional[Path],
        typer.Option(
            parser=path_value,
            help="Build cache of .kv files (default: beside MANIFEST, named after it: jobs.jsonl → jobs.kv-cache/).",
        ),
    ] = None,
    workers: Annotated[
        Optional[int], typer.Option(min=1, help="Model copies: local processes (default 1), or Ray actors.")
    ] = None,
    ray: Annotated[
        Optional[str],
        typer.Option(
            "--ray",
            metavar="[ADDRESS|auto|local]",
            help="Run on Ray: a cluster address, auto (a running cluster; also a bare --ray) or local (start one).",
        ),
    ] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="Torch threads per worker.")] = None,
    budget: BudgetOpt = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Answer length limit (the budget plans for it).")] = 128,
    summary_tokens: Annotated[int, typer.Option(min=1, help="Summary length limit in tokens.")] = 256,
    segment_tokens: SegmentTokensOpt = None,
    kv_dtype: KvDtypeOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    no_server: NoServerOpt = False,
    quiet: QuietOpt = False,
    focus: FocusOpt = None,
) -> None:
    """Answer the questions (and summaries) of many documents, loading the model once per worker.

    With a running `rocketkv serve` (and neither --workers nor --ray), the server runs each row on
    its warm model instead: no model load here (but for a row over its request limit); the same lines.

    Each document is ingested once into the cache folder (reused while the document, model and
    settings match); results are written one JSON line per answer as they finish. Rerun the same
    command after an interruption: answered rows are skipped, failed rows are retried.
    """
    from ..batch.manifest import check_manifest_path  # torch-free: the checks below answer before torch loads
    from .remote import check_server_flags

    check_server_flags(server, no_server)
    if not manifest.name:  # "" or "/": no file name to read, nor to name the results after
        raise usage_error("MANIFEST", f"{str(manifest)!r} names no file")
    setup(quiet)
    check_manifest_path(manifest)  # a missing manifest is said first, not after "rows run by the server"
    beside = [what for what, given in (("the results", output is not None), ("the cache folder", cache_dir is not None))
              if not given]  # fmt: skip
    if beside:
        from ..api.preflight import check_folder_writable

        written = " and ".join(beside) + (" are" if len(beside) > 1 else " is")
        check_folder_writable(manifest, "manifest", written, "pass -o RESULTS.jsonl and --cache-dir DIR")
    from ..api.rocketkv import DEFAULT_MODEL, configure
    from ..batch.run import BatchSettings, run_batch

    configure(quiet, progress_bars=err.is_terminal and not quiet)  # transformers offline and silent (one worker too)
    out = None if output == "-" else Path(output) if output is not None else default_output(manifest)
    folder = cache_dir if cache_dir is not None else manifest.with_name(_stem(manifest) + ".kv-cache")
    from ..core.config import default_kv_dtype, with_preset_defaults

    given = ("max_new_tokens",) + (("token_budget",) if budget is not None else ())  # the model's own t otherwise
    cfg = with_preset_defaults(prefill_config(token_budget=budget, max_new_tokens=max_new_tokens),
                               model or DEFAULT_MODEL, given)  # fmt: skip
    try:
        settings = BatchSettings(model=model or DEFAULT_MODEL, device=device, dtype=dtype or "auto", config=cfg,
                                 storage=storage(kv_dtype or default_kv_dtype(model or DEFAULT_MODEL)),
                                 summary_tokens=summary_tokens,
                                 segment_tokens=segment_tokens, threads=threads,
                                 trust_remote_code=trust_remote_code, focus=focus)  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"invalid option: {exc}") from None
    remote = None
    if workers is None and ray is None:
        from .remote import model_for_server, server_for, unused_threads_note

        found = server_for(server, no_server)
        if found is not None:
            import json

            from ..serve.client import events, fits

            sent = {**settings.to_dict(), **model_for_server({"model": settings.model})}
            cache_abs = str(folder.resolve())
            log(f"rows run by the server at {found.url}")
            unused_threads_note(found, threads)

            def remote(task):
                body = {"task": json.loads(task.to_json()), "cache_dir": cache_abs, "settings": sent}
                if fits(found, body):
                    return events(found, "/v1/rocketkv/batch", body)
                log(f"row {one_line(str(task.row.id))} is over the server's request limit: run in this process")
                return None  # run here (the model loads here for the first such row)

    with batch_bar() as bar:
        task = bar.add_task("batch", total=None, answers=0, visible=False)  # shown once the rows are counted

        logged = [0]  # documents done, as last said on stderr where no bar is drawn (a pipe, a log file)

        def on_progress(state) -> None:
            began = state.documents_done or state.answers_done or state.errors  # a result: not the start's call
            if began and "first" not in bar.tasks[0].fields:  # the rates count from here: the model's load is behind
                bar.update(task, first=(bar.tasks[0].elapsed or 0.0, state.documents_done, state.answers_done))
            bar.update(task, total=state.documents_total, completed=state.documents_done, answers=state.answers_done,
                       visible=True)  # fmt: skip
            if bar.disable and state.documents_done > logged[0]:
                logged[0] = state.documents_done
                log(f"{state.documents_done}/{state.documents_total} documents done, "
                    f"{plural(state.answers_done, 'answer')} written")  # fmt: skip

        try:
            report = run_batch(manifest, out, folder, settings, workers=workers, ray_address=ray,
                               on_progress=on_progress, log=lambda m: log(one_line(m)),  # a path on one line
                               remote=remote)  # fmt: skip
        except (KeyboardInterrupt, Terminated):
            if out is not None:  # the answers written are kept: say how to go on
                bar.stop()
                log(f"the answers written so far are kept in {one_line(str(out))}: rerun the same command to resume")
            raise
    where = "stdout" if out is None else one_line(str(out))
    log(f"{plural(report.n_rows, 'row')}: {report.n_skipped} already answered, {plural(report.n_written, 'line')} "
        f"written to {where}, {report.n_errors} failed")  # fmt: skip
    if out is not None:
        echo_path(out)
    if report.n_errors:
        rerun = (
            "rerun the same command; answered rows are kept"
            if out is not None
            else f"run {'them' if report.n_errors > 1 else 'it'} again (with -o FILE, a rerun keeps the answered rows "
            f"and redoes only {'these' if report.n_errors > 1 else 'this one'})"
        )
        many = report.n_errors > 1
        lines = "their error lines are" if many else "its error line is"
        raise fail(f"{plural(report.n_errors, 'row')} failed ({lines} in {where}) — fix "
                   f"{'them' if many else 'it'} and {rerun}")  # fmt: skip
