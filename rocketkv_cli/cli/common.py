"""Shared pieces of the command line: the stderr console, error mapping, progress, helpers (the
option types are in `options.py`).

One module per command beside this one; each parses, calls the Python API
(`rocketkv_cli.api.rocketkv`), prints, and maps errors. No tensor math or orchestration here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from ..errors import InputError, RocketKVError, UsageError
from ..methods import method_class
from ..serve.client import process_age_s
from ..signals import EXIT_CODES, Terminated, install, mark_reported, message, received


class StderrConsole(Console):
    """A Rich console on stderr that outlives stderr's reader (`2> >(head -1)`): Rich's own
    `on_broken_pipe` copied /dev/null over *stdout* and exited 1, losing the answers still to be
    printed there and failing a command whose file was written. Here stderr's later lines go to
    /dev/null and the command goes on (a broken stdout still ends it: 141)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(stderr=True, highlight=False, **kwargs)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
        os.close(devnull)


err = StderrConsole()
_state: dict = {"quiet": False, "threads": None}


def log(message: str, wrap: bool = False) -> None:
    """One status line on stderr (user text is never parsed as Rich markup). wrap: broken between
    words at a terminal's width (a long message read by a person: chat's banner and help), not
    left to the terminal, which breaks it inside words."""
    if not _state["quiet"]:
        err.print(f"[dim]rocketkv:[/dim] {escape(shown(message))}", emoji=False,
                  soft_wrap=not (wrap and err.is_terminal))  # fmt: skip


def spinners() -> bool:
    """Whether spinners and bars are drawn: stderr is a terminal and --quiet was not given."""
    return err.is_terminal and not _state["quiet"]


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # control characters but tab and line feed


def shown(text: str) -> str:
    """`text` with its control characters but tab and line feed written as `\\xNN` (an ESC in a
    file name would otherwise reach the terminal as the start of a command to it: colours, a
    cleared screen), CR as `\\r`."""
    return _CONTROL.sub(lambda m: "\\r" if m.group() == "\r" else f"\\x{ord(m.group()):02x}", text)


def one_line(text: str) -> str:
    """`text` on one line: its line breaks written as `\\n` and `\\r`, other control characters
    as `shown` writes them (a path or message on one line)."""
    return shown(text).replace("\n", "\\n")


def echo_path(path: str | Path) -> None:
    """A path written on stdout as its bytes, for a script to use (`kv=$(rocketkv ingest doc.txt)`):
    a name that is not valid UTF-8 came out as "\\udcff" text, which names no file."""
    out = getattr(sys.stdout, "buffer", None)
    if out is None:  # an in-process text stream (a test runner's capture)
        typer.echo(str(path))
        return
    sys.stdout.flush()
    out.write(os.fsencode(path) + b"\n")
    out.flush()


def utf8_text(text: str) -> str:
    """An argument or a terminal line read as UTF-8 where Python decoded it with another encoding
    (`LC_ALL=C` without UTF-8 mode: every non-ASCII byte a surrogate escape, so "日本?" read as not
    UTF-8): bytes that are valid UTF-8 become the text they encode; anything else is left as it was."""
    if not any("\udc80" <= c <= "\udcff" for c in text):
        return text
    try:
        return os.fsencode(text).decode("utf-8")
    except UnicodeError:
        return text


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]Error:[/bold red] {escape(one_line(message))}", soft_wrap=True, emoji=False)
    return typer.Exit(code)


def _reopen_closed_stdin() -> None:
    """A closed stdin (`<&-`: Python starts with `sys.stdin` None) reads as empty, as `< /dev/null`
    does: `chat` ends at once, `ingest -` and `--questions-file -` say their input is empty."""
    if sys.stdin is not None:
        return
    fd = os.open(os.devnull, os.O_RDONLY)  # descriptor 0 when it was closed
    if fd != 0:
        os.dup2(fd, 0)
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115  (the process's stdin, never closed)


def _stdout_closed() -> typer.Exit:
    """stdout's reader went away (`| head`): stop quietly, as Unix tools do (128 + SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return typer.Exit(141)


def _signal_exit(signum: int) -> typer.Exit:
    """The one line for an interrupt (printed once), and its exit code (130, 143, 129)."""
    mark_reported(signum)
    return fail(message(signum), EXIT_CODES[signum])


def stdout_usable() -> bool:
    """Whether stdout is open for writing (`>&-` closes it; `1<file` opens it read-only), so a
    command can refuse to start rather than lose its results silently."""
    if sys.stdout is None:  # Python found descriptor 1 closed at start-up
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # an in-process stream (a test runner's capture)
        return not getattr(sys.stdout, "closed", False)
    try:
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:  # closed after start-up
        return False
    return mode in (os.O_WRONLY, os.O_RDWR)


def command(fn):
    """Wrap a command body: known errors → one line + exit 1 (usage errors 2); Ctrl-C → 130;
    SIGTERM → 143; SIGHUP → 129.

    Signals are handled by `rocketkv_cli.signals` (installed before the heavy imports); an
    unexpected error after a signal was received is reported as that signal (an interrupted
    import can resurface as an ImportError much later)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        install()
        _reopen_closed_stdin()
        try:
            if not stdout_usable():
                raise InputError(
                    "stdout is closed, so the results would be lost",
                    "redirect it to a file or to /dev/null instead of closing it (>&-)",
                )
            return fn(*args, **kwargs)
        except RocketKVError as exc:  # a UsageError (an option value no input could satisfy): exit 2
            message = str(exc)
            if message.startswith("invalid option:"):  # wrapped config errors name fields: show the options
                message = option_names(message)
            raise fail(message, 2 if isinstance(exc, UsageError) else 1) from None
        except KeyboardInterrupt:
            raise _signal_exit(signal.SIGINT) from None
        except Terminated as stop:
            raise _signal_exit(stop.signum) from None
        except (typer.Exit, typer.Abort, typer.BadParameter, SystemExit):  # BadParameter: a usage error, exit 2
            raise
        except BrokenPipeError:
            raise _stdout_closed() from None
        except MemoryError:
            raise fail("out of memory — try a smaller --chunk-tokens or --budget, or a shorter document") from None
        except OSError as exc:  # the system refused a file operation nothing checked for: say what and why
            signum = received()
            if signum is not None:
                raise _signal_exit(signum) from None
            if os.environ.get("ROCKETKV_DEBUG") == "1":
                raise
            raise fail(os_error_line(exc)) from None
        except Exception as exc:  # unexpected: still one line unless debugging
            signum = received()
            if signum is not None:  # the interrupt surfaced as another error on its way up
                raise _signal_exit(signum) from None
            if os.environ.get("ROCKETKV_DEBUG") == "1":
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise fail(
                f"unexpected {type(exc).__name__}: {first} — rerun with ROCKETKV_DEBUG=1 for a traceback"
            ) from None

    return wrapper


def os_error_line(exc: OSError) -> str:
    """The one line for an OSError that reached a command: the system's reason and the file, with
    what to do for a full disk or a name too long. (What a rerun keeps is said where the writes
    that keep it are made: batch's results file, ingest's checkpoints.)"""
    name = exc.filename if isinstance(exc.filename, str) else None
    shown = name if name is None or len(name) <= 120 else name[:60] + "…" + name[-40:]
    where = f": {shown}" if shown else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device{where} — free some space and run the command again"
    if exc.errno == errno.ENAMETOOLONG:
        return f"file name too long{where} — use a shorter name"
    return f"{exc.strerror or exc}{where}"


class Timings:
    """Named wall-clock spans of one command, for `--verbose` (seconds)."""

    def __init__(self) -> None:
        age = process_age_s()
        self.spans: list[tuple[str, float]] = [("start-up (interpreter, CLI)", age)] if age is not None else []

    @contextlib.contextmanager
    def span(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((name, time.perf_counter() - t0))

    def add(self, name: str, seconds: float) -> None:
        self.spans.append((name, seconds))

    def summary(self) -> str:
        total = process_age_s()
        parts = ", ".join(f"{name} {s:.2f}s" for name, s in self.spans)
        return f"timing: {parts}" + (f"; wall {total:.2f}s" if total is not None else "")


def setup(quiet: bool, threads: int | None = None) -> None:
    """Per-command start: quiet or not, and torch's threads (`--threads`, else `$ROCKETKV_THREADS`, else
    chosen when the model loads: the cores this process may use less those other processes keep
    busy, `api.threads`). Nothing heavy is imported here, so that the checks that follow
    (options, documents, paths) answer in a fraction of a second. Raises UsageError for a thread
    count < 1 or a `$ROCKETKV_KERNELS` that is not auto, torch or triton."""
    from ..api.threads import requested_threads
    from ..core.config import kernels_choice

    _state["quiet"] = quiet
    _state["threads"] = requested_threads(threads)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if threads is not None and omp and not re.fullmatch(r"\s*0*[1-9][0-9]*\s*(,\s*0*[1-9][0-9]*\s*)*", omp):
        del os.environ["OMP_NUM_THREADS"]  # --threads decides; OpenMP would warn twice about "abc" as torch loads
    kernels_choice()  # a misspelt $ROCKETKV_KERNELS: a usage error now, not after the model loads


def threads_note() -> str:
    """ "threads: 2 (2 cores this process may use, 0.0 busy with other processes)" for `--verbose`."""
    n, source = _state.get("threads") or (None, "torch's default")
    return f"threads: {n} ({source})"


@contextlib.contextmanager
def spinning(message: str, elsewhere_logged: bool = False):
    """A spinner with `message` on a terminal while the body runs, unless quiet; elsewhere
    nothing, or the message as one stderr line with `elsewhere_logged`."""
    if spinners():
        with err.status(escape(message), spinner="dots"):
            yield
    else:
        if elsewhere_logged:
            log(message)
        yield


def starting():
    """A spinner on a terminal while torch and transformers are imported (several seconds on a
    small CPU, before any other output), unless quiet."""
    return spinning("starting (importing torch)")


def shown_step(message: str) -> str:
    """A model-load step's line as a spinner's text: its first clause ("converting X to safetensors
    once (about a minute on 2 cores)" → "converting X to safetensors once"), one line."""
    return one_line(message.split(" (")[0].rstrip(":;, "))


def load_engine(model: Optional[str], device: str, dtype: str, trust_remote_code: bool, weights: str | None = None):
    """`RocketKV.load` (None: the default model) with transformers offline and silent, a spinner
    on a terminal and a timing line on stderr."""
    with starting():
        from ..api.rocketkv import DEFAULT_MODEL, RocketKV, configure

    from ..api.threads import apply, resolve_threads

    quiet = _state["quiet"]
    configure(quiet, progress_bars=spinners())
    _state["threads"] = _state.get("threads") or resolve_threads()  # the default measured now, after the imports
    apply(_state["threads"][0])
    model = model or DEFAULT_MODEL
    t0 = time.perf_counter()
    with (
        err.status(escape(f"loading {model}"), spinner="dots")  # a path may hold "[/b]"
        if spinners()
        else contextlib.nullcontext()
    ) as spinner:

        def step(message: str) -> None:
            """A first load's step (assembling, converting: a minute) logged, and named by the spinner,
            which said "loading" throughout."""
            log(message)
            if spinner is not None:
                spinner.update(escape(shown_step(message)))

        rk = RocketKV.load(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code, log=step,
                           weights=weights, threads=_state["threads"][0])  # fmt: skip
    log(f"loaded {rk.description} in {time.perf_counter() - t0:.1f}s")
    return rk


class _TokenRate(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"{task.speed:,.0f} tokens/s" if task.speed else "")


class _TokenCount(ProgressColumn):
    """ "done/total tokens"; the total is unknown ("?") until the first chunk reports it."""

    def render(self, task) -> Text:
        total = "?" if task.total is None else f"{task.total:,.0f}"
        return Text(f"{task.completed:,.0f}/{total} tokens")


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        _TokenCount(),
        _TokenRate(),
        TextColumn("ETA"),  # the time left says what it is, as batch's bar does
        TimeRemainingColumn(),
        console=err,
        disable=not spinners(),
        transient=True,
    )


@contextlib.contextmanager
def question_bar():
    """Around answering in this process: a question long enough to be prefilled in chunks (over
    1,024 tokens) draws a progress bar while it is read (tokens, tokens/s, ETA; a terminal only),
    gone before its answer is printed. Short questions draw nothing."""
    from ..api.rocketkv import question_progress

    bar = progress_bar()
    task = None

    def report(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            task = bar.add_task("reading the question", total=total)
            bar.start()
        bar.update(task, completed=done)
        if done >= total:
            bar.stop()
            bar.remove_task(task)
            task = None

    try:
        with question_progress(report):
            yield
    finally:
        bar.stop()


def steps_bar() -> Progress:
    """A bar over counted steps (eval's runs, bench's measurements): description, M/N, elapsed, ETA.
    Result lines printed while it runs go through `print_row`."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(), console=err, disable=not spinners(),
        transient=True,
    )  # fmt: skip


def print_row(bar: Progress, line: str) -> None:
    """One result line on stdout while `bar` may be drawn on stderr. When stdout is a terminal too
    (the same screen), the bar is cleared first and drawn again after, so the line is neither
    printed onto the bar's line nor wrapped by Rich: it stays whole, to copy. A piped stdout gets
    the line as it is."""
    live = not bar.disable and bar.live.is_started and sys.stdout.isatty()
    if live:
        bar.stop()
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if live:
        bar.start()


def reading_terminal(what: str) -> None:
    """Before `what` is read from stdin: when stdin is a terminal, say so (the command otherwise
    waits with nothing shown for input the user may not know it wants)."""
    if sys.stdin is not None and sys.stdin.isatty():
        log(f"reading {what} from the terminal: type, then press Ctrl-D at the start of a line to end")


def open_stream(doc_path: str, encoding: str, errors: str = "strict", command: str = "ask"):
    """The document as a validated stream (fails before any model loads); `command`: for the hint
    when a cache is given instead."""
    from ..api.preflight import open_document

    if doc_path == "-":
        reading_terminal("the document")

    return open_document(doc_path, encoding, errors, command)


def ingest(rk, document, cfg, output=None, force=False, segment_tokens=None, kv_dtype=None,
           explicit=("token_budget", "max_new_tokens"), checkpointed: int = 0):  # fmt: skip
    """`RocketKV.ingest` with a progress bar (tokens, tokens/s, ETA) and a line per segment;
    `checkpointed`: the checkpoints an earlier run left (said when none of them could be used).

    `cfg` gets the loaded preset's measured stage-1 defaults in the fields not in `explicit`
    (the options the user gave; `with_preset_defaults`). Returns the `Ingested` result."""
    from ..core.config import default_kv_dtype, with_preset_defaults

    try:
        cfg = with_preset_defaults(cfg, rk.model_id, explicit)
    except ValueError as exc:
        raise UsageError(f"invalid option: {exc}") from None
    so_far, reused = [0], [0, 0]  # tokens so far; segments and tokens read back from checkpoints
    # a method that re-reads the document (context reconstruction) does so after each prefill: the bar's second half
    label = "prefill + re-read" if method_class(cfg).capture == "reconstruct" else "prefill"
    with progress_bar() as bar:
        task = bar.add_task(label, total=None)

        def on_segment(event) -> None:
            so_far[0] += event.n_tokens
            what = "found checkpointed" if event.resumed else "prefilled"
            log(f"segment {event.index}: {what} ({event.n_tokens:,} tokens; {so_far[0]:,} so far)")
            if event.resumed:  # read back, not prefilled: the bar's rate and time left start again after it
                reused[0], reused[1] = reused[0] + 1, reused[1] + event.n_tokens
                bar.reset(task, total=bar.tasks[0].total, completed=so_far[0])

        done = rk.ingest(document, output=output, force=force, config=cfg, segment_tokens=segment_tokens,
                         storage=storage(kv_dtype or default_kv_dtype(rk.model_id)), on_segment=on_segment,
                         progress=lambda n, total: bar.update(task, completed=n, total=total))  # fmt: skip
    stored = done.cache
    n_parts = stored.n_segments
    where = f" in {n_parts} segments" if n_parts > 1 else ""
    if reused[0]:  # a resumed ingest: what was read back is not what this run prefilled
        where += f" ({reused[1]:,} tokens of {plural(reused[0], 'segment')} read back from checkpoints)"
    elif checkpointed:
        log(f"none of the {plural(checkpointed, 'segment')} checkpointed earlier matched this run (another document, "
            "model, --segment-tokens or option): every segment was prefilled")  # fmt: skip
    log(f"prefilled {stored.n_context_tokens:,} tokens{where} in {done.seconds:.1f}s; "
        f"keeping up to {stored.max_kept_tokens:,} per KV head per layer{' per segment' if where else ''}"
        + ("; adaptive layer budgets: the layers keep different counts, the same total"
           if cfg.layer_budgets != "uniform" else ""))  # fmt: skip
    return done


def plural(n: int, noun: str) -> str:
    """ "1 row", "4 rows" (nouns that take an s)."""
    return f"{n:,} {noun}{'s' * (n != 1)}"


def report_abandoned(directory: Path, skip: Optional[Path] = None) -> None:
    """One line on stderr per checkpoint folder in `directory` left by an ingest that is not
    running (killed, crashed, interrupted), with how to resume it or remove it (`skip`: the
    target whose own checkpoints the current ingest resumes from)."""
    from ..api.preflight import abandoned_ingests

    for found in abandoned_ingests(directory):
        if skip is not None and found.target == skip:
            continue
        age = _age(time.time() - found.modified)
        log(f"{found.folder} holds {found.n_segments} checkpointed segments ({found.n_bytes / 1e6:.1f} MB, "
            f"last written {age} ago) of an unfinished ingest into {found.target} — rerun that ingest to resume "
            f"it, or remove them: rm -r {shlex.quote(str(found.folder))}")  # fmt: skip


def _age(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def cache_budget_note(budget: Optional[int], cache: Path) -> None:
    """One line on stderr when `--budget` is given with `--cache`: the file keeps its own budget.
    Raises UsageError for a budget no ingest would take (the hint would suggest a failing command)."""
    if budget is not None and budget < 1:
        raise UsageError(f"invalid option: --budget must be a positive integer, got {budget}")
    if budget is not None:
        log(f"--budget {budget} applies to a DOC ingested here; {cache} keeps the budget it was built with "
            f"(to change it: rocketkv ingest DOC --budget {budget})")  # fmt: skip


def storage(kv_dtype: str):
    """The storage named by `--kv-dtype`. Raises InputError for an unknown name."""
    from ..core.quant import KVStorage

    try:
        return KVStorage.parse(kv_dtype)
    except ValueError as exc:
        said = str(exc).replace("kv_dtype must be one of", "--kv-dtype must be one of")
        said = said if said.startswith("--kv-dtype") else f"--kv-dtype {kv_dtype}: {said}"
        raise UsageError(f"invalid option: {said}", "e.g. --kv-dtype int8, int4 or float16 (docs/storage.md)") from None


def default_kjv() -> Optional[Path]:
    """`shared/data/kjv.txt` in the current directory or above it (the repository's sibling), or None."""
    for base in (Path.cwd(), *Path.cwd().parents):
        candidate = base / "shared" / "data" / "kjv.txt"
        if candidate.is_file():
            return candidate
    return None


def prefill_config(preset: str | None = None, **kw):
    """A `PrefillConfig` from option values (`pool_kernel_size` as text: odd or 'auto';
    `store_budget` as text: a token count or 'all'); `preset`: the model whose measured defaults
    fill the options not given, checked with them (`core.config.preset_config`).
    Raises UsageError naming the invalid value."""
    from ..core.config import PrefillConfig, preset_config

    pool = kw.pop("pool_kernel_size", None)
    if pool is None:
        pass
    elif pool == "auto":
        kw["pool_kernel_size"] = 0
    else:
        try:
            kw["pool_kernel_size"] = int(pool)
        except ValueError:
            raise UsageError(f"--pool-kernel-size must be an odd integer or 'auto', got {pool!r}") from None
    store = kw.get("store_budget")
    if store is not None and store != "all":
        try:
            kw["store_budget"] = int(store)
        except ValueError:
            raise UsageError(f"--store-budget must be a token count or 'all', got {store!r}") from None
    fields = {k: v for k, v in kw.items() if v is not None}
    try:
        return PrefillConfig(**fields) if preset is None else preset_config(preset, fields)
    except ValueError as exc:
        raise UsageError(f"invalid option: {exc}") from None  # `command` shows the options' names


# configuration fields (what `PrefillConfig` names in its errors) → the options users typed; only
# identifiers that are not English words ("observation" is both a field and a word of the messages)
OPTION_NAMES = {"token_budget": "--budget", "store_budget": "--store-budget", "max_new_tokens": "--max-new-tokens",
                "window_size": "--window-size", "pool_kernel_size": "--pool-kernel-size",
                "prompt_budget": "--prompt-budget", "chunk_tokens": "--chunk-tokens", "n_score_dims": "--n-score-dims",
                "page_size": "--page-size", "topk": "--topk", "layer_budgets": "--layer-budgets",
                "method_options": "--method-option"}  # fmt: skip


def option_names(message: str) -> str:
    """`message` with configuration field names replaced by the command-line options that set them."""
    return re.sub(r"(?<![\w-])(" + "|".join(OPTION_NAMES) + r")(?![\w-])", lambda m: OPTION_NAMES[m.group(1)], message)


def is_question(line: str) -> bool:
    """Whether a line read from a questions file or a pipe is a question: not blank, and not a
    comment: `#` alone or followed by a space ("#1 risk factor?" and "#MeToo: when?" are asked)."""
    text = line.strip()
    return bool(text) and text != "#" and not text.startswith("# ")
