"""`rocketkv batch`, one row's work: many documents and questions with one model load per worker
(docs/batch.md).

Per manifest row: the document is ingested once into the build cache `DIR/<key>.kv`, the key
being a sha256 of the document's bytes, the model's identity and the ingest settings (a file that
exists and matches is reused), then its questions are answered from it and its summary made. Each
result is a JSON line in a `manifest.Results` file, written as it finishes; a failing row becomes
one error line with the one-line message `rocketkv ingest` / `ask` would print. `run.py` hands
the tasks to this process, a local pool (`pool.py`) or Ray (`ray_pool.py`). Nothing here parses
arguments or prints; progress and logs go through callbacks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..api.rocketkv import Answer, AnyCache, RocketKV, open_document
from ..core.cache import SegmentedKVCache
from ..core.config import PrefillConfig, default_kv_dtype
from ..core.quant import KVStorage, resolved
from ..errors import CacheFormatError, InputError, RocketKVError
from .manifest import ROW_FIELDS, BadRow, Results, Row, error_row, parse_row, question_key, summary_key

Log = Callable[[str], None]


@dataclass(frozen=True)
class BatchSettings:
    """How every row is run: the model, the ingest settings and the answer lengths.

    config: stage-1 settings of every ingest (its `max_new_tokens` is also the answer cap).
    storage: how the `.kv` files store keys and values (`--kv-dtype`; None: the model's measured
        default, `core.config.default_kv_dtype`).
    summary_tokens: summary length cap in tokens. segment_tokens: tokens per segment for
    documents longer than the context (None: all that fit). threads: torch threads per worker
    (None: the machine's cores divided among the local workers; 1 per Ray actor).
    focus: answer each question from its `focus` best passages (`RocketKV.ask_focused`, `ask
    --focus`); None: from the whole cache. Raises ValueError: a field out of range, focus with dense.
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"
    config: PrefillConfig = field(default_factory=PrefillConfig)
    storage: KVStorage | None = None
    summary_tokens: int = 256
    segment_tokens: int | None = None
    dense: bool = False
    threads: int | None = None
    trust_remote_code: bool = False
    focus: int | None = None

    def __post_init__(self) -> None:
        for name, kinds in (("model", (str,)), ("device", (str,)), ("dtype", (str,)), ("dense", (bool,)),
                            ("trust_remote_code", (bool,))):  # fmt: skip
            if not isinstance(getattr(self, name), kinds):
                raise ValueError(f"{name} must be a {kinds[0].__name__}, got {getattr(self, name)!r}")
        for name in ("summary_tokens", "segment_tokens", "threads", "focus"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.focus is not None and self.dense:
            raise ValueError("focus answers from the passages it re-reads, so dense does not apply")
        if self.storage is None:
            object.__setattr__(self, "storage", KVStorage.parse(default_kv_dtype(self.model)))

    def to_dict(self) -> dict:
        """The settings as JSON values (`from_dict` reads them back; what `rocketkv batch` sends a server)."""
        return {"model": self.model, "device": self.device, "dtype": self.dtype, "config": self.config.to_dict(),
                "storage": self.kv_storage.name, "summary_tokens": self.summary_tokens,
                "segment_tokens": self.segment_tokens, "dense": self.dense, "threads": self.threads,
                "trust_remote_code": self.trust_remote_code, "focus": self.focus}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> BatchSettings:
        """Settings from `to_dict`'s values. Raises ValueError or TypeError for a wrong field."""
        if not isinstance(d, dict) or not isinstance(d.get("config"), dict) or not isinstance(d.get("storage"), str):
            raise ValueError("settings must hold a config object and a storage name")
        if not isinstance(d.get("model"), str):
            raise ValueError("settings must name a model")
        return cls(**{**d, "config": PrefillConfig(**d["config"]), "storage": KVStorage.parse(d["storage"])})

    @property
    def kv_storage(self) -> KVStorage:
        """`storage`, never None once constructed."""
        if self.storage is None:
            raise ValueError("storage is unset")
        return self.storage


@dataclass(frozen=True)
class Task:
    """What is left of one row: the indices of its unanswered questions and whether its
    summary is still to make."""

    row: Row
    questions: tuple[int, ...]
    summary: bool

    @property
    def n_results(self) -> int:
        return len(self.questions) + int(self.summary)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Task:
        """A task from `to_json`'s text (what `rocketkv batch` sends a server), its row checked as a
        manifest line is (`parse_row`) and its question indices against the row's questions.
        Raises ValueError naming what is wrong (TypeError, KeyError: not `to_json`'s layout)."""
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("row"), dict):
            raise ValueError("a task holds a row object")
        raw, line = d["row"], d["row"].get("line")
        if isinstance(line, bool) or not isinstance(line, int) or line < 1:
            raise ValueError(f"the row's line must be a positive integer, got {line!r}")
        if unknown := sorted(set(raw) - {"line", *ROW_FIELDS}):
            raise ValueError(f"unknown row fields {unknown}")
        document = raw.get("document")
        if isinstance(document, str) and not os.path.isabs(document):
            raise ValueError(f"the row's document must be an absolute path, got {document!r}")
        fields = {k: v for k, v in raw.items() if k != "line" and v is not None}
        row = parse_row(json.dumps(fields).encode(), line, Path("/"))
        if isinstance(row, BadRow):
            raise ValueError(row.error)
        questions, summary = d.get("questions"), d.get("summary")
        if not isinstance(questions, list) or not all(
            type(i) is int and 0 <= i < len(row.questions) for i in questions
        ) or len(set(questions)) != len(questions):  # fmt: skip
            raise ValueError(f"the task's questions must be distinct indices of the row's {len(row.questions)}")
        if not isinstance(summary, bool) or (summary and not row.summary):
            raise ValueError("the task's summary must be true or false, and true only for a row that asks for one")
        return cls(row=row, questions=tuple(questions), summary=summary)


@dataclass
class BatchProgress:
    """Counts for a progress bar: documents (rows with work left), done and in total; answers
    (questions and summaries) done; error rows written."""

    documents_total: int = 0
    documents_done: int = 0
    answers_done: int = 0
    errors: int = 0


@dataclass(frozen=True)
class BatchReport:
    """How a run ended: manifest rows, rows already done by an earlier run (skipped), lines
    written, error rows written (this run), and what a rerun found and dropped from the file."""

    n_rows: int
    n_skipped: int
    n_written: int
    n_errors: int
    dropped: dict[str, int]


def load_worker(settings: BatchSettings, workers: int = 1) -> RocketKV:
    """The model of one of `workers` workers, with torch threads set: `settings.threads`, else
    the cores divided among the workers (unless $ROCKETKV_THREADS or $OMP_NUM_THREADS says
    otherwise), else (one worker) what `RocketKV.load` chooses, as the command line does."""
    threads = settings.threads
    if not threads and workers > 1 and not {"ROCKETKV_THREADS", "OMP_NUM_THREADS"} & set(os.environ):
        threads = max(1, (os.cpu_count() or 1) // workers)
    return RocketKV.load(settings.model, device=settings.device, dtype=settings.dtype,
                         trust_remote_code=settings.trust_remote_code, threads=threads or None)  # fmt: skip


def document_sha256(row: Row) -> str:
    """sha256 of the row's document bytes (inline text: its UTF-8 bytes), as the `.kv` records it.
    Raises InputError with `rocketkv ingest`'s message for a file it cannot read."""
    if row.text is not None:
        return hashlib.sha256(row.text.encode("utf-8")).hexdigest()
    assert row.document is not None  # a Row has exactly one of document and text
    try:
        mode = os.stat(row.document).st_mode
        if stat.S_ISDIR(mode):
            open_document(row.document)  # ingest's message for a folder
        if not stat.S_ISREG(mode):  # a FIFO would block, /dev/zero never end
            raise InputError(f"{row.document} is not a regular file", "a batch reads each document as a file; "
                             "copy it to one first")  # fmt: skip
        digest = hashlib.sha256()
        with open(row.document, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return digest.hexdigest()
    except OSError as exc:
        open_document(row.document)  # raises the message ingest gives for this path
        raise InputError(f"cannot read {row.document}: {exc.strerror}") from None


def cache_key(rk: RocketKV, doc_sha256: str, settings: BatchSettings) -> str:
    """The build-cache key: sha256 of the document, the model identity and the ingest settings."""
    ident = rk.engine.identity
    record = {"document_sha256": doc_sha256, "model_digest": ident.model_digest,
              "tokenizer_digest": ident.tokenizer_digest, "chat_template_digest": ident.chat_template_digest,
              "prompt_template_id": ident.prompt_template_id, "dtype": rk.engine.dtype_name,
              "config": settings.config.to_dict(),
              "storage": resolved(settings.kv_storage, rk.engine.dtype_name).to_dict(),  # uniform: as before v5
              "segment_tokens": settings.segment_tokens}  # fmt: skip
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _locked(cache_dir: Path, key: str) -> Iterator[None]:
    """An exclusive lock per key, so two workers never ingest the same document at once (on
    shared storage without working locks, both would write the same file atomically)."""
    locks = cache_dir / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{key}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _reusable(rk: RocketKV, path: Path, doc_sha256: str, settings: BatchSettings, log: Log) -> AnyCache | None:
    """The cache at `path` if it is whole and was built from this document, for this model, with
    these settings; None (and a log line saying why) when it must be rebuilt."""
    if not path.exists():
        return None
    try:
        cache = rk.open(path)
    except CacheFormatError as exc:
        log(f"rebuilding {path}: {exc.message}")
        return None
    info = (cache.segments[0] if isinstance(cache, SegmentedKVCache) else cache).info
    storage = resolved(settings.kv_storage, rk.engine.dtype_name)  # as files record it: `auto` resolved
    if (info.document_sha256 != doc_sha256 or info.config != settings.config or info.storage != storage
            or info.dtype != rk.engine.dtype_name):  # fmt: skip
        log(f"rebuilding {path}: built from another document or with other settings")
        return None
    return cache


def build(rk: RocketKV, row: Row, cache_dir: Path, settings: BatchSettings, log: Log,
          doc_sha: str | None = None, progress: Callable[[int, int], None] | None = None,
          ) -> tuple[AnyCache, Path]:  # fmt: skip
    """The row's cache from the build cache, ingested (atomically, under a lock) if not there;
    `doc_sha`: the document's `document_sha256`, when the caller has it; `progress`: the ingest's
    (`RocketKV.ingest`).

    Returns (cache, path of its `.kv` file). Raises the errors of `RocketKV.ingest`."""
    doc_sha = doc_sha or document_sha256(row)
    key = cache_key(rk, doc_sha, settings)
    path = cache_dir / f"{key}.kv"
    with _locked(cache_dir, key):
        cache = _reusable(rk, path, doc_sha, settings, log)
        if cache is not None:
            return cache, path
        source = {"text": row.text} if row.text is not None else {"document": open_document(str(row.document))}
        done = rk.ingest(**source, output=path, force=True, config=settings.config, storage=settings.kv_storage,
                         segment_tokens=settings.segment_tokens,
                         progress=progress or (lambda done, total: None))  # fmt: skip
        return done.cache, path


class Stopped(Exception):
    """Raised by a task's `progress` callback when whoever runs it gives up (a server's client went
    away): the task ends there, with no error line."""


def run_task(rk: RocketKV, task: Task, cache_dir: Path, settings: BatchSettings, log: Log = lambda m: None,
             progress: Callable[[int, int], None] | None = None):  # fmt: skip
    """The result lines of one task, each yielded as soon as it is made: `{"id",
    "question_index", "document_sha256", <the ask --json record>}` per question, `{"id",
    "document_sha256", <the summarize --json record>}` for the summary, or one error line (and
    nothing after it) when the row fails. `document_sha256` (the document's bytes) lets a rerun
    tell an answer of a document since changed (`Results.open`). `progress(done, total)`: the
    ingest's tokens, chunk by chunk; it may raise `Stopped` to end the task there."""
    row = task.row
    try:
        doc_sha = document_sha256(row)
        cache, path = build(rk, row, cache_dir, settings, log, doc_sha, progress)
        asked = [row.questions[i] for i in task.questions]
        if asked:
            max_new = settings.config.max_new_tokens
            answers: Iterable[Answer] = (
                _focused(rk, cache, asked, settings.focus, max_new) if settings.focus
                else rk.ask(cache, asked, max_new_tokens=max_new, dense=settings.dense))  # fmt: skip
            for index, ans in zip(task.questions, answers):
                yield {"id": row.id, "question_index": index, "document_sha256": doc_sha,
                       **ans.to_dict(cache=str(path))}  # fmt: skip
        if task.summary:
            yield {**_summary(rk, row, cache, path, settings), "document_sha256": doc_sha}
    except Stopped:
        raise
    except RocketKVError as exc:
        if exc.hint and "--encoding" in exc.hint:  # batch has no such option: documents are read as UTF-8
            exc = type(exc)(exc.message, "batch reads documents as UTF-8: convert it first (iconv -f CODEC -t "
                                         "UTF-8), or ingest it with rocketkv ingest --encoding")  # fmt: skip
        yield error_row(row.id, row.line, str(exc))
    except MemoryError:
        yield error_row(row.id, row.line, "out of memory — try a smaller --budget or a shorter document")
    except Exception as exc:  # unexpected: one error line, the batch goes on
        if os.environ.get("ROCKETKV_DEBUG") == "1":
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        yield error_row(row.id, row.line, f"unexpected {type(exc).__name__}: {first} — rerun with ROCKETKV_DEBUG=1 "
                        "for a traceback")  # fmt: skip


def _focused(rk: RocketKV, cache: AnyCache, questions: list[str], focus: int, max_new_tokens: int) -> Iterator[Answer]:
    """`RocketKV.ask_focused`'s answers to `questions`, one at a time."""
    for question in questions:
        got = rk.ask_focused(cache, question, passages=focus, max_new_tokens=max_new_tokens).answer
        assert got is not None  # set once the answer is decoded
        yield got


def _summary(rk: RocketKV, row: Row, cache: AnyCache, path: Path, settings: BatchSettings) -> dict:
    """The summarize --json record of the row's document, with its id."""
    cfg = PrefillConfig(token_budget=settings.config.token_budget, max_new_tokens=settings.summary_tokens)
    partials: list[dict] = []
    t0 = time.perf_counter()
    final = rk.summarize(cache, max_new_tokens=settings.summary_tokens, dense=settings.dense, config=cfg,
                         on_partial=lambda e: partials.append({"level": e.level, "segment": e.index,
                                                               "summary": e.text, "mode": e.mode}))  # fmt: skip
    record: dict[str, Any] = {"id": row.id, "summary": final.text, "source": str(path),
                              "n_answer_tokens": final.n_answer_tokens, "stop_reason": final.stop_reason,
                              "summarize_s": round(time.perf_counter() - t0, 3), "mode": final.mode,
                              "rejected": list(final.rejected)}  # fmt: skip
    if partials:
        record["partial_summaries"] = partials
    return record


def plan(rows: list[Row | BadRow], done: set[tuple[str, str, int]]) -> list[Task]:
    """The tasks left: for each row, what the results file does not hold yet."""
    tasks = []
    for row in rows:
        if isinstance(row, BadRow):
            continue
        questions = tuple(i for i in range(len(row.questions)) if question_key(row.id, i) not in done)
        summary = row.summary and summary_key(row.id) not in done
        if questions or summary:
            tasks.append(Task(row, questions, summary))
    return tasks


class Tracker:
    """Writes result lines and counts them (a task is done after its last line or an error)."""

    def __init__(self, results: Results, tasks: list[Task], on_progress: Callable[[BatchProgress], None]):
        self.results, self.on_progress = results, on_progress
        self.left = {i: t.n_results for i, t in enumerate(tasks)}
        self.state = BatchProgress(documents_total=len(tasks))
        self.written = 0
        on_progress(self.state)  # the documents to do, known before the first result (a bar showed "0/?")

    def write(self, task_index: int | None, line: dict) -> None:
        self.results.write(line)
        self.written += 1
        if "error" in line:
            self.state.errors += 1
        else:
            self.state.answers_done += 1
        if task_index is not None and task_index in self.left:
            self.left[task_index] -= 1
            if self.left[task_index] <= 0 or "error" in line:
                del self.left[task_index]
                self.state.documents_done += 1
        self.on_progress(self.state)
