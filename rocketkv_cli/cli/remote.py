"""Answering through a running `rocketkv serve` (imports no torch): the questions go to the server,
the pieces and records come back and are printed exactly as an in-process answer is
(`AnswerPrinter`, the same stderr lines), and errors are raised as the same types, so the output,
the `--json` records and the exit codes do not depend on where the answer was computed."""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import SimpleNamespace

from rich.markup import escape

from ..core.config import PRESET_WEIGHTS_DEFAULTS  # keyed by the presets
from ..errors import UsageError
from ..serve.client import Server, ServerError, answer_record, events, health, locate
from .answers import AnswerPrinter, answer_log_of, decode_timing
from .common import Timings, err, log, spinners, spinning


def check_server_flags(url: str | None, no_server: bool) -> None:
    """`--server URL` with `--no-server` (one was ignored): a usage error, exit 2. `$ROCKETKV_SERVER`
    with `--no-server` is fine: the flag overrides the environment."""
    if url is not None and no_server:
        raise UsageError("--server names a server and --no-server says answer here: give one of them")
    if url is not None and not url.strip():  # `--server "$UNSET"`: not the default socket, silently
        raise UsageError("--server is empty: give unix:/path/to/socket or http://host:port")


def server_for(url: str | None, no_server: bool, timings: Timings | None = None) -> Server | None:
    """The server to answer through, or None (in this process); a server still starting (`rocketkv
    serve &` a moment ago) is waited for, said on stderr, and the wait is a span of `timings`
    (`--verbose`). Raises ServerError for a `--server` that does not answer, UsageError for a
    malformed URL."""
    return locate(url, no_server, lambda pid: starting_said(pid, timings))


@contextlib.contextmanager
def starting_said(pid: int, timings: Timings | None = None) -> Iterator[None]:
    """While a starting server (`pid`) is waited for: a spinner on a terminal, else one line; the
    wait timed into `timings` when given."""
    with spinning(f"waiting for the rocketkv server to start (pid {pid})", elsewhere_logged=True):
        if timings is None:
            yield
        else:
            with timings.span("waiting for the server to start"):
                yield


def unused_threads_note(server: Server | None, threads: int | None) -> None:
    """Say on stderr that a `--threads` given (`threads`) is not used by `server` (nothing when no
    server answers, none was given, or the server computes with that count whatever the load:
    `rocketkv serve --threads` the same, from `/health`). Called once the server has taken the
    request, so that an error (a cache not found) is not preceded by a note about threads."""
    if server is None or threads is None:
        return
    info = health(server) or {}
    if info.get("threads_fixed") and info.get("threads") == threads:
        return
    now = f" ({info['threads']} now)" if isinstance(info.get("threads"), int) else ""
    log(f"note: --threads {threads} is not used: the server at {server.url} computes with its own threads{now} "
        "(rocketkv serve --threads N); --no-server computes here")  # fmt: skip


def server_running(url: str | None) -> bool:
    """Whether `server_for(url, False)` would find a server (never raises)."""
    try:
        return locate(url, False) is not None
    except (ServerError, UsageError, OSError):  # a malformed --server URL is reported where it is used
        return False


def read_here_note(command: str, document: str) -> str:
    """What `command DOC` says, after its answer, when a server was running but the document was
    read in this process (a server answers only from a cache): the two commands for `document`
    (its `ingest` default output name; stdin's `-` has none: FILE.kv), or the one where that
    cache exists."""
    if document == "-":
        ingest, cache = "rocketkv ingest - -o FILE.kv", "FILE.kv"
    else:
        cache = shlex.quote(document + ".kv")
        ingest = f"rocketkv ingest {shlex.quote(document)}"
        if os.path.isfile(document + ".kv"):  # ingested already (its default name)
            return (f"a server is running, but this document was read in this process: rocketkv {command} --cache "
                    f"{cache} answers from its cache through the server")  # fmt: skip
    return (f"a server is running, but this document was read in this process: ingest it once ({ingest}), then "
            f"rocketkv {command} --cache {cache} answers through the server")  # fmt: skip


def model_for_server(options: dict) -> dict:
    """`options` with a `model` that names an existing path here (`./dir`, `~/m.gguf`; not a
    preset) made absolute: the server takes a model path only absolute and inside its allowed
    folders (a relative one or `~` would be its own folder's and home's)."""
    model = options.get("model")
    if model and model not in PRESET_WEIGHTS_DEFAULTS and os.path.lexists(os.path.expanduser(model)):
        return {**options, "model": os.path.abspath(os.path.expanduser(model))}
    return options


def cache_fields(cache: Path, command: str = "ask") -> dict:
    """The `cache` and `display` fields of a request, the file checked first as `ask` checks it
    here (torch-free: a missing or unreadable file fails as it would in this process)."""
    from ..api.preflight import check_cache_file

    check_cache_file(cache, command)
    return {"cache": os.path.abspath(cache), "display": str(cache)}


def server_events(server: Server, path: str, body: dict) -> Iterator[dict]:
    """`events` of a request, with the server's `status` events (a model loading there, a long
    question read, a wait behind another request) shown as a spinner on a terminal until the next
    other event (dropped elsewhere)."""
    shown = None
    try:
        for event in events(server, path, body):
            status = event.get("event") == "status"
            if shown is not None and status:  # the next status: the same spinner, its text updated
                shown.update(escape(str(event.get("message", ""))))
                continue
            if shown is not None:
                shown.stop()
                shown = None
            if not status:
                yield event
            elif spinners():
                shown = err.status(escape(str(event.get("message", ""))), spinner="dots")
                shown.start()
    finally:
        if shown is not None:
            shown.stop()


def _answer_of(server: Server, event: dict) -> tuple[dict, list | None]:
    """An `answer` event's record (checked: `client.answer_record`) and its citations as objects
    with the attributes `api.citations.Citation` has (None: none asked for)."""
    record = answer_record(server, event)
    citations = event.get("citations")
    return record, None if citations is None else [SimpleNamespace(**c) for c in citations]


def ask_remote(server: Server, cache: Path, questions: list[str], options: dict, printer: AnswerPrinter,
               timings: Timings | None = None, accepted: Callable[[], None] | None = None) -> None:  # fmt: skip
    """Answer `questions` from `cache` on `server` and print them as `ask` does.

    options: `RocketKV.ask`'s keyword options and the model choice (model, device, dtype, weights,
    trust_remote_code). `accepted` is called once the server has taken the request (its first
    event; before the first question's header, so that a note it prints never lands inside an
    answer). Raises the server's error as its rocketkv type; ServerError when the server goes
    away before the last answer."""
    body = {**cache_fields(cache), "questions": questions, **model_for_server(options)}
    done, started = 0, False
    for event in server_events(server, "/v1/rocketkv/ask", body):
        if not started:
            if accepted is not None:
                accepted()
            printer.start(questions[0])
            started = True
        kind = event.get("event")
        if kind == "piece":
            printer.piece(str(event.get("text", "")))
        elif kind == "log":
            log(str(event.get("message", "")))
        elif kind == "answer":
            record, citations = _answer_of(server, event)
            printer.finish(record["answer"], record, citations)
            log(answer_log_of(record))
            if timings is not None:
                label, seconds = decode_timing(record)
                timings.add(f"question {done + 1} prefill (server)", record["prefill_s"])
                timings.add(f"{label} (server)", seconds)
            done += 1
            if done < len(questions):
                printer.start(questions[done])
    if done < len(questions):  # the stream said done with answers missing: never an exit 0 without them
        raise ServerError(f"the server at {server.url} sent {done} of {len(questions)} answers",
                          "run the command again (with --no-server to answer without it)")  # fmt: skip


Turn = Generator[str, None, tuple[str, dict, list | None, str]]  # pieces; then (text, record, citations, log line)


class RemoteChat:
    """`rocketkv chat`'s questions answered by a server, one request each. The options are checked
    once on construction, as a local session checks them before the prompt appears."""

    def __init__(self, server: Server, cache: Path, options: dict):
        fields = cache_fields(cache, "chat")
        self.server = server
        self.body = {**fields, **model_for_server(options)}
        for event in server_events(server, "/v1/rocketkv/ask", {**self.body, "questions": [], "check_only": True}):
            if event.get("event") == "log":  # the model loaded for it; else "checked": the options passed
                log(str(event.get("message", "")))

    def turn(self, question: str) -> Turn:
        """The answer's pieces as they are decoded; returns (text, record, citations, log line).
        Closing the generator early (Ctrl-C) closes the connection, which cancels the answer there."""
        result = None
        for event in server_events(self.server, "/v1/rocketkv/ask", {**self.body, "questions": [question]}):
            if event.get("event") == "piece":
                yield str(event.get("text", ""))
            elif event.get("event") == "log":
                log(str(event.get("message", "")))
            elif event.get("event") == "answer":
                record, citations = _answer_of(self.server, event)
                result = (record["answer"], record, citations, answer_log_of(record))
        if result is None:
            raise ServerError(f"the server at {self.server.url} sent no answer", "run the command again")
        return result


def summarize_remote(server: Server, cache: Path, options: dict, on_partial) -> SimpleNamespace:
    """A summary of `cache` made by `server`; `on_partial(event)` per partial summary (an object with
    level, index, total, text, mode, as `api.summaries.PartialSummary`). Returns the final summary
    (text, n_answer_tokens, stop_reason, mode, rejected). Raises the server's error as its type."""
    body = {**cache_fields(cache, "summarize"), **model_for_server(options)}
    final = None
    for event in server_events(server, "/v1/rocketkv/summarize", body):
        if event.get("event") == "log":
            log(str(event.get("message", "")))
        elif event.get("event") == "partial":
            on_partial(SimpleNamespace(**{k: v for k, v in event.items() if k != "event"}))
        elif event.get("event") == "summary":
            final = SimpleNamespace(**{k: v for k, v in event.items() if k != "event"})
    if final is None or not isinstance(getattr(final, "text", None), str):
        raise ServerError(f"the server at {server.url} sent no summary", "run the command again")
    return final
