"""Batch manifests and result files for `rocketkv batch` (docs/batch.md). No torch here.

A manifest is JSON lines, one document per line: `{"id": ..., "document": PATH | "text": ...,
"questions": [...], "summary": true}`. A results file is JSON lines too, one per answer (keyed by
`id` and `question_index`), per summary (keyed by `id`) or per failed row (`error`). It is always
valid JSON lines: each line is written whole with one `write` and fsynced, and a rerun first
repairs what a crash can leave (a torn last line, a line of zeros after a power loss), so that
it can skip what is answered and redo the rest.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..api.preflight import check_questions
from ..errors import InputError, OutputError

ROW_FIELDS = ("id", "document", "text", "questions", "summary")
MAX_MANIFEST_BYTES = 1 << 30  # 1 GiB of rows; more is a mistake (a device, a runaway pipe), not a batch
RowId = str | int


@dataclass(frozen=True)
class Row:
    """One manifest line: an `id`, a document (`document`: an absolute path, or inline `text`),
    its questions and whether a summary is wanted. `line` is the 1-based manifest line."""

    line: int
    id: RowId
    document: str | None
    text: str | None
    questions: tuple[str, ...]
    summary: bool

    def __post_init__(self) -> None:
        if (self.document is None) == (self.text is None):
            raise ValueError(f"a row needs exactly one of document and text, got {self.document!r}, {self.text!r}")
        if not self.questions and not self.summary:
            raise ValueError(f"row {self.id!r} asks for nothing")


@dataclass(frozen=True)
class BadRow:
    """A manifest line that cannot be run, with the one-line message of its error row."""

    line: int
    id: RowId | None
    error: str
    not_json: bool = False  # the line is not JSON at all (not UTF-8, or no JSON value)


def question_key(row_id: RowId, index: int) -> tuple[str, str, int]:
    return ("q", json.dumps(row_id), index)


def summary_key(row_id: RowId) -> tuple[str, str, int]:
    return ("s", json.dumps(row_id), -1)


def error_row(row_id: RowId | None, line: int, message: str) -> dict:
    """The results line of a failed row: its id, its manifest line, and the error's one line."""
    return {"id": row_id, "line": line, "error": message.replace("\r", "\\r").replace("\n", "\\n")}


def check_manifest_path(path: Path) -> os.stat_result:
    """Refuse a manifest path that is missing, a directory or a device, before anything else is
    done (the command said where its rows would run first); returns its `os.stat`. Raises InputError."""
    try:
        found = os.stat(path)
        mode = found.st_mode
    except FileNotFoundError:
        raise InputError(f"manifest not found: {path}", "check the path") from None
    except OSError as exc:
        raise InputError(f"cannot read manifest {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{path} is a directory, not a manifest", "give a .jsonl file")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # /dev/zero would be read until memory ran out
        raise InputError(f"{path} is a device, not a manifest", "give a .jsonl file")
    return found


def read_manifest(path: Path) -> list[Row | BadRow]:
    """Every non-blank line of the manifest at `path`, as a `Row` or a `BadRow`.

    Relative document paths are relative to the manifest's folder (made absolute here, so that
    workers on other machines read the same file from shared storage). An `id` seen on an
    earlier line (a good or a bad row) makes a `BadRow`. Raises InputError: the manifest itself
    cannot be read, or none of its lines is JSON (a document given as the manifest: its lines would
    each become an error line).
    """
    found = check_manifest_path(path)
    too_large = InputError(f"manifest {path} is larger than {MAX_MANIFEST_BYTES >> 30} GiB", "split it into several")
    if stat.S_ISREG(found.st_mode) and found.st_size > MAX_MANIFEST_BYTES:
        raise too_large
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)  # a pipe (`<(…)`) has no size to check first
    except FileNotFoundError:
        raise InputError(f"manifest not found: {path}", "check the path") from None
    except OSError as exc:
        raise InputError(f"cannot read manifest {path}: {exc.strerror}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise too_large
    base = path.resolve().parent
    rows: list[Row | BadRow] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        row = parse_row(raw, number, base)
        if row.id is not None:  # a bad row's id counts too: its error line carries it
            key = json.dumps(row.id)
            if key not in first_line:
                first_line[key] = number
            elif isinstance(row, Row):
                row = BadRow(number, row.id, f"line {number}: duplicate id {key} (first on line {first_line[key]})"
                             " — give each row its own id")  # fmt: skip
        rows.append(row)
    if rows and all(isinstance(r, BadRow) and r.not_json for r in rows):
        first = rows[0].error.split(" — ")[0]  # type: ignore[union-attr]  # "line 1 is not UTF-8 text", …
        lines = "its one line is" if len(rows) == 1 else f"none of its {len(rows):,} lines is"
        raise InputError(f"{path} is not a JSON-lines manifest: {lines} JSON ({first})",
                         'write one JSON object per line in UTF-8, e.g. {"id": 1, "document": "book.txt", '
                         '"questions": ["Who wrote it?"]}')  # fmt: skip
    return rows


def _encodes(text: str, encode=lambda t: t.encode("utf-8")) -> bool:
    """Whether `encode(text)` works: UTF-8 by default (JSON's `\\ud800` escapes can make a lone
    surrogate); `os.fsencode` for a file name (the bytes of a name that is not UTF-8 come back as
    `\\udc80`-`\\udcff` escapes, Python's way; half of any other pair cannot be a name)."""
    try:
        encode(text)
    except UnicodeEncodeError:
        return False
    return True


def parse_row(raw: bytes, number: int, base: Path) -> Row | BadRow:
    """One manifest line as a `Row`, or a `BadRow` saying what is wrong with it."""
    where = f"line {number}"
    try:
        obj = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
    except UnicodeDecodeError:
        return BadRow(number, None, f"{where} is not UTF-8 text — save the manifest as UTF-8", not_json=True)
    except json.JSONDecodeError as exc:
        return BadRow(number, None, f"{where} is not valid JSON ({exc.msg} at column {exc.colno})"
                      " — write one JSON object per line", not_json=True)  # fmt: skip
    except (ValueError, RecursionError) as exc:  # an integer of over 4,300 digits; nesting past Python's recursion
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        return BadRow(number, None, f"{where} cannot be read as JSON ({why}) — write one JSON object per line")
    if not isinstance(obj, dict):
        return BadRow(number, None, f"{where} is not a JSON object — write one object per line")
    row_id = obj.get("id")
    if row_id is None or row_id == "":
        return BadRow(number, None, f'{where}: no id — give each row an "id" (a string or an integer)')
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        return BadRow(number, None, f'{where}: "id" must be a string or an integer, got {json.dumps(row_id)}')
    if isinstance(row_id, str) and not _encodes(row_id):  # its results line could not be written
        return BadRow(number, None, f'{where}: "id" is not valid Unicode (an escape of half a surrogate pair, '
                                    f"{json.dumps(row_id)})")  # fmt: skip
    try:
        return Row(number, row_id, *_fields(obj, where, base))
    except InputError as exc:
        return BadRow(number, row_id, str(exc))


def _fields(obj: dict[str, Any], where: str, base: Path) -> tuple[str | None, str | None, tuple[str, ...], bool]:
    unknown = sorted(set(obj) - set(ROW_FIELDS))
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}", "the fields are " + ", ".join(ROW_FIELDS))
    document, text = obj.get("document"), obj.get("text")
    if (document is None) == (text is None):
        raise InputError(f'{where}: give "document" (a path) or "text", {"not both" if document else "none given"}')
    if document is not None and (not isinstance(document, str) or not document):
        raise InputError(f'{where}: "document" must be a file path (a non-empty string)')
    if document is not None and ("\x00" in document or not _encodes(document, os.fsencode)):
        raise InputError(f'{where}: "document" {json.dumps(document)} is not a file path (a NUL byte or half a '
                         "surrogate pair)")  # fmt: skip
    if text is not None and not isinstance(text, str):
        raise InputError(f'{where}: "text" must be a string')
    if text is not None and not _encodes(text):
        raise InputError(f'{where}: "text" is not valid UTF-8 text', "check the text's encoding")
    questions = obj.get("questions", [])
    if not isinstance(questions, list) or not all(isinstance(q, str) for q in questions):
        raise InputError(f'{where}: "questions" must be a list of strings')
    summary = obj.get("summary", False)
    if not isinstance(summary, bool):
        raise InputError(f'{where}: "summary" must be true or false')
    if not questions and not summary:
        raise InputError(f"{where}: nothing to do", 'add "questions": [...] or "summary": true')
    if questions:
        check_questions(questions)  # the messages `rocketkv ask` gives, word for word
    path = None if document is None else str(base / os.path.expanduser(document))
    return path, text, tuple(questions), summary


def utf8_stdout() -> bool:
    """Whether stdout writes UTF-8 (else JSON lines go out as ASCII with \\u escapes, still valid)."""
    return (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "").replace("_", "") == "utf8"


def _recorded_digest(raw: bytes) -> Any:
    """The `document_sha256` a result line recorded (None: none, an older rocketkv's line)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj.get("document_sha256") if isinstance(obj, dict) else None


class Results:
    """The results file: what an earlier run finished, and appending rows as they finish.

    `path` None writes to stdout (nothing to resume). `open(rows)` reads an existing file,
    keeps every answered or summarized line (also those of ids not in this manifest) and drops
    error lines (their rows are redone), a last line cut by a crash, and answers whose question
    no longer matches the manifest; if it dropped anything the file is rewritten atomically.
    Returns the keys already done. Raises OutputError: the file cannot be read or written, or a
    whole line of it is not one rocketkv writes (a note, another tool's output: never dropped).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self._fd: int | None = None
        self._lock: int | None = None  # the lock file's descriptor while this run writes the file
        self._lock_file: Path | None = None
        self._created = self._wrote = False  # a file this run made, and whether a line went into it
        self.dropped = {"error": 0, "torn": 0, "stale": 0}  # torn: a last line cut by a crash

    def open(self, rows: Iterable[Row | BadRow],
             digest: Callable[[Row], str | None] = lambda row: None) -> set[tuple[str, str, int]]:  # fmt: skip
        """Read what an earlier run wrote (the keys of the answers kept); drop error lines, lines cut
        by a crash, and stale lines: of a question no longer asked, a row repeated, or a document
        whose bytes changed since it was answered (a line's `document_sha256` against
        `digest(row)`, the document's now, read only for rows with such lines; None: unknown)."""
        if self.path is None:
            return set()
        self._check_path()
        self._take_lock()
        by_id = {json.dumps(r.id): r for r in rows if isinstance(r, Row)}
        questions = {rid: r.questions for rid, r in by_id.items()}
        digests: dict[str, str | None] = {}

        def changed(rid: str, recorded: Any) -> bool:
            if not isinstance(recorded, str) or rid not in by_id:
                return False
            if rid not in digests:
                digests[rid] = digest(by_id[rid])
            return digests[rid] is not None and digests[rid] != recorded

        done: set[tuple[str, str, int]] = set()
        kept: list[bytes] = []
        data = self._read()
        if not _results_or_empty(data):
            raise OutputError(f"{self.path} exists and is not a results file of `rocketkv batch` (no line of it is "
                              "a result), so it is left as it is",
                              "give -o a new file name (a rerun with the same -o resumes from it)")  # fmt: skip
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            self.dropped["torn"] += 1  # no newline at the end: a line cut by a crash
            lines.pop()
        for number, raw in enumerate(lines, 1):
            key, kind = self._classify(raw, questions)
            if kind == "torn" and raw.strip(b"\x00 \t\r"):  # not blank, nor a power loss's zeros: not ours to drop
                raise OutputError(f"{self.path}: line {number} is not a line `rocketkv batch` writes, so the file is "
                                  "left as it is", "give -o a new file name, or take that line out of it")  # fmt: skip
            if kind == "keep" and key is not None and changed(key[1], _recorded_digest(raw)):
                kind = "stale"
            if kind != "keep":
                self.dropped[kind] += 1
                continue
            if key is not None:
                if key in done:
                    self.dropped["stale"] += 1
                    continue
                done.add(key)
            kept.append(raw)
        if sum(self.dropped.values()):
            self._rewrite(kept)
        self._fd = self._open_append()
        return done

    @staticmethod
    def _classify(raw: bytes, questions: dict[str, tuple[str, ...]]) -> tuple[tuple[str, str, int] | None, str]:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None, "torn"
        if not isinstance(obj, dict) or "id" not in obj:
            return None, "torn"
        if "error" in obj:
            return None, "error"
        rid = json.dumps(obj["id"])
        index = obj.get("question_index")
        if isinstance(index, int) and not isinstance(index, bool) and isinstance(obj.get("question"), str):
            asked = questions.get(rid)
            if asked is not None and (index >= len(asked) or asked[index] != obj["question"]):
                return None, "stale"
            return ("q", rid, index), "keep"
        if isinstance(obj.get("summary"), str):
            return ("s", rid, -1), "keep"
        return None, "keep"  # someone else's line: not ours to drop

    def _lock_path(self) -> Path:
        assert self.path is not None
        real = Path(os.path.realpath(self.path))  # one lock for a file however it is named (links, ../)
        return real.with_name(f".{real.name}.lock")

    def _take_lock(self) -> None:
        """Hold an exclusive lock on `.<name>.lock` beside the results file (its real path) while
        this run writes it: two runs with one `-o` wrote every answer twice. The lock file is
        removed by `close`; a lock taken on a file another run removed meanwhile is taken again on
        the new one. Where no lock file can be made (a folder this user cannot write, whose results
        file they can) or the file system has no locks (some NFS and FUSE mounts), the run goes on
        unlocked, as before locks were taken.
        Raises OutputError: another run holds it."""
        path = self._lock_path()
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputError(f"another rocketkv batch is writing {self.path} now (it holds {path})",
                                  "wait for it to finish (or stop it: a rerun resumes), then run this again, "
                                  "or give -o another file") from None  # fmt: skip
            except OSError:  # ENOLCK, EOPNOTSUPP: no locks here
                os.close(fd)
                return
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                self._lock, self._lock_file = fd, path
                return
            os.close(fd)  # removed (or replaced) by the run that held it: lock the file there now

    def _check_path(self) -> None:
        """Raises OutputError: the results path is a directory, a device or a pipe (it is read to its
        end, then rewritten in place), or its folder does not exist."""
        assert self.path is not None
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            if not self.path.parent.is_dir():
                raise OutputError(f"output directory {self.path.parent} does not exist",
                                  f"create it first: mkdir -p {self.path.parent}") from None  # fmt: skip
            return
        except OSError as exc:
            raise OutputError(f"cannot read results file {self.path}: {exc.strerror}") from None
        if stat.S_ISDIR(mode):
            raise OutputError(f"results path {self.path} is a directory", "give a file name with -o")
        if not stat.S_ISREG(mode):
            hint = "give -o a file name, or -o - to print the results"
            raise OutputError(f"results path {self.path} is not a regular file: a results file is resumed and "
                              "rewritten in place", hint)  # fmt: skip

    def _read(self) -> bytes:
        assert self.path is not None
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""
        except OSError as exc:
            raise OutputError(f"cannot read results file {self.path}: {exc.strerror}") from None

    def _rewrite(self, kept: list[bytes]) -> None:
        assert self.path is not None
        folder = self.path.parent
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(line + b"\n" for line in kept))
                f.flush()
                with contextlib.suppress(OSError):  # the file keeps its mode (mkstemp's is 0600)
                    os.fchmod(f.fileno(), stat.S_IMODE(os.stat(self.path).st_mode))
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(folder)

    def _open_append(self) -> int:
        assert self.path is not None  # its folder was checked by `_check_path`
        try:
            self._created = not self.path.exists()
            return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as exc:
            raise OutputError(f"cannot write results file {self.path}: {exc.strerror}") from None

    def write(self, row: dict) -> None:
        """Append one row as one JSON line: a single write, then fsync (stdout: print and flush)."""
        line = json.dumps(row, ensure_ascii=self._fd is None and not utf8_stdout()) + "\n"  # valid JSON on any stdout
        if self._fd is None:
            sys.stdout.write(line)
            sys.stdout.flush()
            return
        data = line.encode("utf-8", "surrogateescape")
        self._wrote = True
        try:
            while data:
                data = data[os.write(self._fd, data) :]
            os.fsync(self._fd)
        except OSError as exc:  # a full disk: a torn last line is repaired by the rerun
            raise OutputError(f"cannot write results file {self.path}: {exc.strerror}",
                              "fix that and rerun the same command: the answered rows are kept") from None  # fmt: skip

    def close(self, failed: bool = False) -> None:
        """Close the file. After a `failed` run (the model did not load, Ray was unreachable), a
        file this run created and wrote nothing into is removed: no empty results file is left
        behind. A run that succeeded keeps it, even empty (a manifest of no rows)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if failed and self._created and not self._wrote and self.path is not None:
                with contextlib.suppress(OSError):
                    if self.path.stat().st_size == 0:
                        self.path.unlink()
        if self._lock is not None and self._lock_file is not None:  # removed while held: no run locks a file
            with contextlib.suppress(OSError):  # about to go
                self._lock_file.unlink()
            os.close(self._lock)
            self._lock = None


def _is_result(raw: bytes) -> bool:
    """Whether a line is a results line this command writes: a JSON object with an id and an
    answer (question_index, question), a summary or an error."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return (
        isinstance(obj, dict)
        and "id" in obj
        and (("question_index" in obj and "question" in obj) or "summary" in obj or "error" in obj)
    )


def _results_or_empty(data: bytes) -> bool:
    """Whether `data` may be resumed and repaired as a results file: empty, only what a crash
    leaves (NUL bytes after a power loss, blank space, one unterminated line of ours), or with
    at least one results line. Anything else (a document, a manifest given as -o by mistake)
    must not be rewritten or appended to."""
    lines = [line.strip(b"\x00 \t\r") for line in data.split(b"\n")]
    lines = [line for line in lines if line]
    if not lines:
        return True
    if any(_is_result(line) for line in lines):
        return True
    return len(lines) == 1 and not data.rstrip(b"\x00").endswith(b"\n") and lines[0].startswith(b'{"id": ')


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
