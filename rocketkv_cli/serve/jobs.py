"""The server's work, run in a worker thread under the decode lock (`Warm.job`): answering
questions from a cache and ingesting a document. Each job reports through `Job.emit` as events
(dicts) that the HTTP layer (`app.py`) turns into NDJSON lines, OpenAI chunks or SSE.

The requests are frozen dataclasses checked on construction (`AskRequest.parse`,
`IngestRequest.parse`): every field's type and range, and every path inside the server's allowed
roots with symlinks resolved. A bad request raises `BadRequest` (HTTP 4xx) before any work.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import stat
import threading
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..api.preflight import check_questions
from ..api.rocketkv import (
    DEFAULT_MODEL,
    PRESETS,
    RocketKV,
    check_cite,
    check_decode_options,
    check_model_choice,
    decode_weights_for,
    question_progress,
)
from ..batch.tasks import BatchSettings, Stopped, Task
from ..core.config import SUMMARY_WRITE_FROM, focus_conflicts
from ..errors import CacheFormatError, InputError, OutputError, RocketKVError
from .client import MAX_QUESTIONS
from .warm import ModelKey, Warm

_live_lock = threading.Lock()


class BadRequest(Exception):
    """A request refused before any work: HTTP `status`, error `type` (a rocketkv_cli.errors name
    where the CLI would raise that type), a one-line `message` and a `hint`; `retry`: a 503 that
    says Retry-After (the queue is full; not a server that is stopping, which a retry cannot reach)."""

    def __init__(self, status: int, message: str, kind: str = "InputError", hint: str | None = None,
                 retry: bool = True):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.hint, self.retry = status, message, kind, hint, retry

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "hint": self.hint, "param": None,
                          "code": self.status}}  # fmt: skip


class Cancelled(Stopped):
    """The client went away: the job stops at the next piece of text (or chunk of a prefill)."""


def _field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise BadRequest(400, f"missing field {name!r}")
        return default
    value = body[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
        raise BadRequest(400, f"field {name!r} must be {_JSON_KINDS.get(kind, kind)}, not {_json_kind(value)}")
    return value


_JSON_KINDS: dict[Any, str] = {int: "an integer", (int, float): "a number", float: "a number", str: "a string",
                               bool: "true or false", list: "a list", dict: "an object"}  # fmt: skip


def _json_kind(value: Any) -> str:
    """What a JSON value is, as `_field`'s refusal names it ("true", "a string", "2.0", …)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # "2.0", "1.5", "inf": the value itself says why it is not an integer
    return next((what for kind, what in _JSON_KINDS.items() if kind is not float and isinstance(value, kind)), "null")


def _number(body: dict, name: str, default: float) -> float:
    """A number field as a float. Raises BadRequest: not a number, or an integer too large for one."""
    value = _field(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise BadRequest(400, f"field {name!r} is out of range") from None


def only_known(body: dict, known: frozenset[str], what: str) -> None:
    """Refuse a field `known` does not hold (400, naming it and the fields `what` takes): a
    misspelt option (`"max_tokens"` for `"max_new_tokens"`, `"focsu"`) silently ignored would
    answer with the default instead, and a client newer than the server would not be told."""
    unknown = sorted(set(body) - known)
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise BadRequest(400, f"unknown field{'s' * (len(unknown) > 1)} {names} in a {what} request",
                         hint=f"its fields: {', '.join(sorted(known))}")  # fmt: skip


def _positive(body: dict, name: str, limit: int | None = None) -> int | None:
    value = _field(body, name, int)
    if value is not None and (value < 1 or (limit is not None and value > limit)):
        bound = f" and ≤ {limit}" if limit is not None else ""
        raise BadRequest(400, f"field {name!r} must be ≥ 1{bound}, got {value}", "UsageError")
    return value


PATH_MAX, NAME_MAX = 4096, 255  # bytes: Linux's limits on a path and on one name in it (ENAMETOOLONG beyond)


def allowed_path(raw: str, roots: tuple[Path, ...] | None, what: str) -> Path:
    """`raw` (an absolute path) resolved, symlinks included, and inside one of `roots` (None: any).
    Raises BadRequest (400 a relative path, a name too long, or one that cannot be resolved, such
    as a symlink loop; 403 outside the roots)."""
    if not raw or "\x00" in raw or not Path(raw).is_absolute():
        raise BadRequest(400, f"{what} must be an absolute path, got {raw!r}")
    try:
        os.fsencode(raw)  # a name's undecodable byte comes as U+DC80-DCFF from the CLI: that encodes back
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): no file system path is that
        raise BadRequest(400, f"{what} is not a file system path (a lone surrogate), got {raw!r}") from None
    if len(os.fsencode(raw)) >= PATH_MAX or any(len(os.fsencode(part)) > NAME_MAX for part in Path(raw).parts):
        raise BadRequest(400, f"{what} is a file name too long: {raw[:60]}…", hint="use a shorter name")
    try:
        resolved = Path(raw).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop: RuntimeError before Python 3.13, OSError after
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "a symlink loop"
        raise BadRequest(400, f"{what} {raw} cannot be resolved: {reason}") from None
    if roots is not None and not any(resolved == root or root in resolved.parents for root in roots):
        raise BadRequest(403, f"{raw} is outside the server's allowed folders",
                         hint="start the server with --allow-dir for its folder")  # fmt: skip
    return resolved


def model_choice(body: dict, roots: tuple[Path, ...] | None) -> str | None:
    """The `model` field: a preset or a hub id (`org/name`, no such folder here) as given; anything
    else is a path (a model directory, a .gguf file: absolute, resolved, inside the allowed roots
    like any other path; `~/…` and `org/../x` were read from the server's home and working
    folder). Raises BadRequest."""
    model = _field(body, "model", str)
    if model is None or model in PRESETS or _hub_id(model):
        return model
    return str(allowed_path(model, roots, "'model'"))


def _hub_id(model: str) -> bool:
    """Whether `model` names a model of the Hugging Face hub (`org/name`, or a bare name), which
    the server reads only from the hub's local cache: not when a file or folder of that name lies
    in the server's working folder (the loader would read that)."""
    parts = model.split("/")
    named = len(parts) <= 2 and all(re.fullmatch(r"[A-Za-z0-9][\w.-]*", part) for part in parts)
    return named and not os.path.lexists(model)  # a bare name that is no preset: the loader says "unknown model"


def trusted(body: dict, allowed: bool) -> bool:
    """`trust_remote_code` of a request: refused (403) unless the server was started with it."""
    wanted = bool(_field(body, "trust_remote_code", bool, False))
    if wanted and not allowed:
        raise BadRequest(403, "this server does not run code from model folders",
                         hint="start it with `rocketkv serve --trust-remote-code`")  # fmt: skip
    return wanted


# the fields of a request answered from one cache (`AskRequest.parse` reads them), ask's and summarize's
_CACHE_FIELDS = frozenset({"cache", "display", "questions", "check_only", "max_new_tokens", "dense", "cite", "model",
                           "device", "dtype", "weights", "trust_remote_code"})  # fmt: skip


@dataclass(frozen=True)
class AskRequest:
    """Questions for one cache. `path`: the resolved file; `display`: how the client named it (used
    in messages and `--json` records, as the CLI would); the rest: `RocketKV.ask`'s options and the
    model choice of `rocketkv ask`."""

    path: Path
    display: str
    questions: tuple[str, ...]
    options: dict
    check_only: bool
    model: str | None
    device: str
    dtype: str | None
    weights: str | None
    trust_remote_code: bool
    focus: int | None = None  # `ask --focus N`: answer from the N best passages (`RocketKV.ask_focused`)

    FIELDS = _CACHE_FIELDS | {"hsa", "topk", "page_size", "n_score_dims", "segments", "segment", "temperature",
                              "top_p", "seed", "focus"}  # fmt: skip

    @classmethod
    def parse(cls, body: dict, roots: tuple[Path, ...] | None, max_tokens_limit: int | None,
              trust_allowed: bool = False, fields: frozenset[str] = FIELDS,
              what: str = "ask") -> AskRequest:  # fmt: skip
        """`max_tokens_limit`: the most answer tokens a request may ask for (None: the context's bound);
        `trust_allowed`: whether the server runs model code (`serve --trust-remote-code`); `fields`:
        the fields the request may hold (`what` names it in the error).
        Raises BadRequest for a field of the wrong type or out of range, an unknown field, or a path
        not allowed."""
        only_known(body, fields, what)
        raw = _field(body, "cache", str, required=True)
        questions = _field(body, "questions", list, required=True)
        check_only = bool(_field(body, "check_only", bool, False))
        if (not questions and not check_only) or len(questions) > MAX_QUESTIONS:
            raise BadRequest(400, f"'questions' must be 1-{MAX_QUESTIONS} strings")
        if not all(isinstance(q, str) for q in questions):
            raise BadRequest(400, f"'questions' must be 1-{MAX_QUESTIONS} strings")
        if questions:
            try:
                check_questions(questions)  # the CLI's own check, so the same one-line error
            except InputError as exc:
                raise BadRequest(400, exc.message, hint=exc.hint) from None
        temperature = _number(body, "temperature", 0.0)
        top_p = _number(body, "top_p", 1.0)
        if not math.isfinite(temperature) or temperature < 0:
            raise BadRequest(400, f"temperature {temperature} is not a finite number ≥ 0", "UsageError")
        if not 0 < top_p <= 1:
            raise BadRequest(400, f"top_p {top_p} is not in (0, 1]", "UsageError")
        seed = _field(body, "seed", int)
        if seed is not None and seed < 0:
            raise BadRequest(400, f"seed must be ≥ 0, got {seed}", "UsageError")
        options = {
            "max_new_tokens": _positive(body, "max_new_tokens", max_tokens_limit),
            "dense": bool(_field(body, "dense", bool, False)),
            "hsa": bool(_field(body, "hsa", bool, False)),
            "topk": _field(body, "topk", int),
            "page_size": _field(body, "page_size", int),
            "n_score_dims": _field(body, "n_score_dims", int),
            "segments": _positive(body, "segments") or 1,
            "segment": _field(body, "segment", int),
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "cite": _field(body, "cite", int, 0),
        }
        focus = _positive(body, "focus")
        if focus is not None and (given := focus_conflicts(options)):
            raise BadRequest(400, f"'focus' answers from the passages it re-reads, greedy: drop {', '.join(given)}",
                             "UsageError")  # fmt: skip
        return cls(
            path=allowed_path(raw, roots, "'cache'"),
            display=_field(body, "display", str, raw),
            questions=tuple(questions),
            options=options,
            check_only=check_only,
            model=model_choice(body, roots),
            device=_field(body, "device", str, "auto"),
            dtype=_field(body, "dtype", str),
            weights=_field(body, "weights", str),
            trust_remote_code=trusted(body, trust_allowed),
            focus=focus,
        )


@dataclass(frozen=True)
class IngestRequest:
    """A document to ingest into `output` (both resolved and allowed), with `token_budget` (None:
    the preset's default), `model` (None: the default model) and `force` (replace `output`)."""

    document: Path
    output: Path
    force: bool
    token_budget: int | None
    model: str | None

    @classmethod
    def parse(cls, body: dict, roots: tuple[Path, ...] | None) -> IngestRequest:
        """Raises BadRequest for a field of the wrong type, an unknown field, or a path not allowed."""
        only_known(body, frozenset({"document", "output", "force", "token_budget", "model"}), "ingest")
        output = _field(body, "output", str, required=True)
        if not output.endswith(".kv"):  # the server writes caches, never another kind of file
            raise BadRequest(400, f"'output' must name a .kv file, got {output!r}")
        if Path(output).name == ".kv":  # no stem: Path's suffix is "" (a hidden file), not a link's target
            raise BadRequest(400, f"'output' {output!r} has no name before .kv", hint="name the file, e.g. doc.kv")
        resolved = allowed_path(output, roots, "'output'")
        if resolved.suffix != ".kv":  # a link named .kv to another file: that file would be replaced
            raise BadRequest(400, f"'output' {output!r} is a link to {str(resolved)!r}, which is not a .kv file")
        document = allowed_path(_field(body, "document", str, required=True), roots, "'document'")
        try:
            regular = stat.S_ISREG(os.stat(document).st_mode)
        except FileNotFoundError:
            raise BadRequest(400, f"document not found: {document}", hint="check the path") from None
        except OSError as exc:
            raise BadRequest(400, f"cannot read document {document}: {exc.strerror}") from None
        if not regular:  # a FIFO or a device would hold the decode lock while it is read
            raise BadRequest(400, f"'document' {str(document)!r} is not a regular file")
        return cls(
            document=document,
            output=resolved,
            force=bool(_field(body, "force", bool, False)),
            token_budget=_positive(body, "token_budget"),
            model=model_choice(body, roots),
        )


WAIT_NOTE_S = 1.0  # a wait for the decode lock this long is said on the client's stderr (`Job.waiting`)


class Job:
    """One request's work: events go from the worker thread to the request's asyncio queue;
    `cancelled` is set when the client goes away."""

    cancelled_total = 0  # jobs stopped because their client went away (for /health and tests)
    live = 0  # job threads not yet ended (waiting for the lock or working): the queue bound counts them
    running: set[Job] = set()  # those jobs (under `_live_lock`), for `stop_all`

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[dict | None] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.announce = False  # the client asked for `status` events (header X-RocketKV-Events: status)

    def emit(self, event: dict | None) -> None:
        """Hand `event` to the HTTP side (None ends the stream); nothing once the server's loop has
        ended (a job that outlived a stop: its client was already told)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed
            pass

    @classmethod
    def stop_all(cls) -> None:
        """The server is stopping: every job not yet ended is cancelled and its stream ends now with
        an error event (503: the client says so in one line and exits 1), not when uvicorn's
        graceful shutdown runs out and cancels the response mid-stream (a traceback in the log)."""
        with _live_lock:
            jobs = list(cls.running)
        for job in jobs:
            job.cancelled.set()
            job.emit({"event": "error", "type": "ServerError", "code": 503,
                      "message": "the rocketkv server was stopped before the answer was complete",
                      "hint": "start it again with `rocketkv serve`, or pass --no-server"})  # fmt: skip
            job.emit(None)

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled()

    def status(self, message: str) -> None:
        """A `status` event (the CLI shows it in a spinner until the next event), to a client that
        asked for them (`announce`)."""
        if self.announce:
            self.emit({"event": "status", "message": message})

    def waiting(self, waited: float | None) -> None:
        """Called when this job waits for the decode lock behind another request (None), and when
        its turn came (the seconds it waited): the client's spinner says which, and a wait of
        `WAIT_NOTE_S` or more is said in a `log` event too (the answer's own time, said after it,
        leaves the wait out), both only to a client that asked for status events (`announce`)."""
        if waited is None:
            self.status("waiting: the server is busy with another request")
            return
        self.status(f"working on this request in the server (after waiting {waited:.1f} s)")
        if self.announce and waited >= WAIT_NOTE_S:
            self.emit({"event": "log", "message": f"waited {waited:.1f} s in the server behind another request"})

    def reading(self, done: int, total: int) -> None:
        """A long question's prefill, chunk by chunk (`question_progress`): the client told, and
        the work abandoned between chunks once its client has gone (Cancelled)."""
        self.check()
        self.status(f"reading the question in the server: {done:,} of {total:,} tokens")

    def run(self, work, *args) -> None:
        """Start `work(job, *args)` in a thread; its errors become an `error` event, then None."""

        def target() -> None:
            try:
                work(self, *args)
            except Cancelled:
                Job.cancelled_total += 1
            except BadRequest as exc:
                self.emit({"event": "error", **exc.body()["error"]})
            except RocketKVError as exc:
                self.emit({"event": "error", "type": type(exc).__name__, "message": exc.message, "hint": exc.hint})
            except Exception as exc:  # an unexpected failure: one line for the client, the trace on the server
                traceback.print_exc()
                self.emit({"event": "error", "type": "RocketKVError", "message": f"the server failed: {exc!r}"})
            finally:
                with _live_lock:
                    Job.live -= 1
                    Job.running.discard(self)
                self.emit(None)

        with _live_lock:
            Job.live += 1
            Job.running.add(self)
        threading.Thread(target=target, name="rocketkv-job", daemon=True).start()


def _open(warm: Warm, req: AskRequest, job: Job):
    """The cache and the model for `req`, checked as `rocketkv ask` checks them; a model loaded for
    it is announced to a client that asked for it (`job.announce`: a `status` event before, a `log`
    event after; other clients keep an error as the response's HTTP status whether or not the
    model was warm)."""
    try:
        stored = warm.cache(req.path)
    except FileNotFoundError:
        raise BadRequest(404, f"{req.display} does not exist", hint="check the path") from None
    except CacheFormatError as exc:  # the message names the resolved path: show the client's
        raise CacheFormatError(exc.message.replace(str(req.path), req.display), exc.hint) from None
    check_model_choice(stored, req.model, req.display)
    check_cite(stored, req.options["cite"], req.options["segments"])
    opts = req.options
    check_decode_options(stored, dense=opts["dense"], hsa=opts["hsa"], topk=opts["topk"],
                         page_size=opts["page_size"], n_score_dims=opts["n_score_dims"])  # fmt: skip
    key = ModelKey(req.model or stored.info.identity.model_id, req.device, req.dtype or stored.info.dtype,
                   req.weights or decode_weights_for(stored), req.trust_remote_code)  # fmt: skip
    if not job.announce:
        rk = warm.model(key, keep_cache=req.path)
    else:
        rk = warm.model(key, log=lambda message: job.emit({"event": "log", "message": message}),
                        loading=job.status, keep_cache=req.path)  # fmt: skip
    warm.check(rk, key, req.path, stored, req.display)
    return rk, stored


def answer_job(job: Job, warm: Warm, req: AskRequest) -> None:
    """Answer `req`'s questions one at a time under the decode lock: `piece` events as text is
    decoded, an `answer` event (the `--json` record; citations with unrounded weights) per answer."""
    with warm.job(job.waiting):
        job.check()
        rk, stored = _open(warm, req, job)
        if req.check_only:  # what `rocketkv chat` asks before its prompt: every option checked as a session does
            rk.session(stored, **req.options)
            job.emit({"event": "checked"})
            return

        def piece(text: str) -> None:
            job.check()
            job.emit({"event": "piece", "text": text})

        def log(message: str) -> None:
            job.emit({"event": "log", "message": message})

        if req.focus is not None:
            opts = req.options
            answers: Any = (rk.ask_focused(stored, q, passages=req.focus, max_new_tokens=opts["max_new_tokens"],
                                           cite=bool(opts["cite"]), on_text=piece,
                                           on_chosen=lambda picked: log(picked.note())).answer
                            for q in req.questions)  # fmt: skip
        else:
            answers = rk.ask(stored, list(req.questions), on_text=piece, log=log, **req.options)
        with question_progress(job.reading):  # a long question: its client told, and stopped if it leaves
            for ans in answers:
                citations = None if ans.citations is None else [
                    {"start": c.start, "end": c.end, "first_line": c.first_line, "last_line": c.last_line,
                     "weight": c.weight, "text": c.text} for c in ans.citations]  # fmt: skip
                job.emit({"event": "answer", "record": ans.to_dict(cache=req.display), "citations": citations})
                job.check()


@dataclass(frozen=True)
class SummarizeRequest:
    """A summary of one cache (`rocketkv summarize --cache`): the cache as in `AskRequest`, the
    summary's token limit, the token budget for the summaries ingested in memory (segmented
    caches), `dense`, `extractive`, `write_from` (`summaries.WRITE_FROM`; None with `extractive`
    False: the model's measured default, `core.config.summary_writing`), and the model choice."""

    ask: AskRequest
    max_new_tokens: int
    token_budget: int
    extractive: bool
    write_from: str | None = None

    # what `rocketkv summarize --cache` sends; ask's sampling, focus and stage-2 fields do not apply
    FIELDS = _CACHE_FIELDS | {"write_from", "extractive", "token_budget"}

    @classmethod
    def parse(cls, body: dict, roots: tuple[Path, ...] | None, trust_allowed: bool = False) -> SummarizeRequest:
        """Raises BadRequest for a field of the wrong type or out of range, or a path not allowed."""
        ask = AskRequest.parse({**body, "questions": [], "check_only": True}, roots, None, trust_allowed,
                               cls.FIELDS, "summarize")  # fmt: skip
        write_from = _field(body, "write_from", str, None)
        if write_from is not None and write_from not in SUMMARY_WRITE_FROM:
            raise BadRequest(400, f"field 'write_from' must be one of {', '.join(SUMMARY_WRITE_FROM)}, "
                                  f"got {write_from!r}", "UsageError")  # fmt: skip
        return cls(ask=ask, max_new_tokens=_positive(body, "max_new_tokens") or 256,
                   token_budget=_positive(body, "token_budget") or 512,
                   extractive=bool(_field(body, "extractive", bool, False)), write_from=write_from)  # fmt: skip


def summarize_job(job: Job, warm: Warm, req: SummarizeRequest) -> None:
    """Summarize under the decode lock: a `partial` event per partial summary (segmented caches),
    then `summary` (text, tokens, stop reason, mode, rejected; with `cite`, each has `citations`,
    unrounded weights, as `ask`'s events)."""
    from ..api.summaries import extractable, summarize
    from ..core.config import PrefillConfig, summary_writing

    with warm.job(job.waiting):
        job.check()
        rk, stored = _open(warm, req.ask, job)
        cite = req.ask.options["cite"]  # checked by `_open`

        def cited(summary) -> dict:
            found = getattr(summary, "citations", None)
            if not cite or found is None:
                return {}
            return {"citations": [{"start": c.start, "end": c.end, "first_line": c.first_line, "last_line": c.last_line,
                                   "weight": c.weight, "text": c.text} for c in found]}  # fmt: skip

        def on_partial(event) -> None:
            job.check()
            job.emit({"event": "partial", "level": event.level, "index": event.index, "total": event.total,
                      "text": event.text, "mode": event.mode, **cited(event)})  # fmt: skip
            job.status("summarizing in the server")  # the spinner again until the next part or the summary

        try:
            cfg = PrefillConfig(token_budget=req.token_budget, max_new_tokens=req.max_new_tokens)
        except ValueError as exc:
            raise BadRequest(400, f"invalid option: {exc}", "UsageError") from None
        writing = summary_writing(
            rk.model_id, req.extractive, req.write_from, extractable(stored)
        )  # checked by `parse`
        job.status("summarizing in the server")  # a model writing takes seconds: the client's spinner says so
        final = summarize(rk.engine, stored, cfg, req.max_new_tokens, not req.ask.options["dense"], on_partial,
                          extractive=writing is None, cite=cite,
                          write_from=writing or "document")  # as `rk.summarize`, with citations  # fmt: skip
        job.emit({"event": "summary", "text": final.text, "n_answer_tokens": final.n_answer_tokens,
                  "stop_reason": final.stop_reason, "mode": getattr(final, "mode", "abstractive"),
                  "rejected": list(getattr(final, "rejected", ())), **cited(final)})  # fmt: skip


@dataclass(frozen=True)
class BatchTaskRequest:
    """One row of a `rocketkv batch` run (`batch.tasks.Task`: the row and what is left of it), its
    build-cache folder and the batch's settings (`BatchSettings.to_dict`), run on the warm model
    by `batch.tasks.run_task` as a worker would run it."""

    task: Task
    cache_dir: Path
    settings: BatchSettings

    @classmethod
    def parse(cls, body: dict, roots: tuple[Path, ...] | None, trust_allowed: bool = False) -> BatchTaskRequest:
        """Raises BadRequest: a malformed task or settings, a path outside the allowed roots (the
        cache folder, the row's document, a model folder), a cache folder that does not exist,
        model code not allowed."""
        only_known(body, frozenset({"task", "settings", "cache_dir"}), "batch")
        raw_task, raw_settings = (
            _field(body, "task", dict, required=True),
            _field(body, "settings", dict, required=True),
        )
        try:
            task = Task.from_json(json.dumps(raw_task))
            settings = BatchSettings.from_dict(raw_settings)
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(400, f"not a batch task: {exc}", "UsageError") from None
        raw_dir = _field(body, "cache_dir", str, required=True)
        cache_dir = allowed_path(raw_dir, roots, "'cache_dir'")
        if not cache_dir.is_dir():
            raise BadRequest(400, f"'cache_dir' {raw_dir} is not a folder", hint="create it first (mkdir -p)")
        if task.row.document is not None:
            allowed_path(task.row.document, roots, "the document")
        model = model_choice({"model": settings.model}, roots)
        trusted({"trust_remote_code": settings.trust_remote_code}, trust_allowed)
        return cls(task=task, cache_dir=cache_dir, settings=replace(settings, model=model or settings.model))


def batch_job(job: Job, warm: Warm, req: BatchTaskRequest) -> None:
    """Run one batch task under the decode lock: a `line` event per result line (as the results
    file takes it), `log` events (a build-cache file rebuilt, …)."""
    from ..batch.tasks import run_task

    def log(message: str) -> None:
        job.emit({"event": "log", "message": message})

    with warm.job(job.waiting):
        job.check()
        s = req.settings
        rk = warm.model(ModelKey(s.model, s.device, s.dtype, None, s.trust_remote_code), log)

        def progress(done: int, total: int) -> None:  # a row's ingest stops between chunks once its client has gone
            job.check()
            job.status(f"reading the document in the server: {done:,} of {total:,} tokens")

        for line in run_task(rk, req.task, req.cache_dir, s, log, progress):
            job.emit({"event": "line", "line": line})
            job.check()


def ingest_job(job: Job, warm: Warm, req: IngestRequest) -> None:
    """Ingest `req.document` into `req.output` under the decode lock: `progress` events (tokens
    done, total), then `written` with the file's path, bytes and seconds."""
    with warm.job(job.waiting):
        job.check()
        key = ModelKey(req.model or DEFAULT_MODEL, "auto", "auto", None, False)
        rk: RocketKV = warm.model(key)

        def progress(done: int, total: int) -> None:
            job.check()
            job.emit({"event": "progress", "done": done, "total": total})

        fields: dict = {} if req.token_budget is None else {"token_budget": req.token_budget}
        try:
            made = rk.ingest(str(req.document), output=req.output, force=req.force, progress=progress, **fields)
        except OutputError as exc:  # the CLI's hint names its option; a request has a field
            hint = 'send "force": true to replace it' if exc.hint and "--force" in exc.hint else exc.hint
            raise OutputError(exc.message, hint) from None
        assert made.path is not None  # an output was given
        job.emit({"event": "written", "path": str(made.path), "bytes": made.path.stat().st_size,
                  "seconds": round(made.seconds, 3)})  # fmt: skip
