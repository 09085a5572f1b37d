"""Checks made before anything heavy is imported or loaded: documents, output paths, cache paths,
and what killed ingests left behind. No torch here (the command line calls these first, so a bad
path or document is refused in a fraction of a second, before the model loads). The question
check, `check_questions`, is the engine's (`engine/inputs.py`, also torch-free) and is re-exported here.

`api/rocketkv.py` re-exports every function of this module.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import struct
from pathlib import Path

from ..engine.inputs import check_questions as check_questions  # the one question check, torch-free
from ..errors import CacheFormatError, OutputError, UsageError
from ..store.atomic import atomic_write, check_target, probe_writable, remove_stale_temp_files
from ..store.folders import AbandonedCheckpoints, abandoned_checkpoints
from .documents import TextStream

MAX_HEADER_BYTES = 100 << 20  # a safetensors header's bound, as `store.format` (torch-free here)


def open_document(path: str, encoding: str = "utf-8", errors: str = "strict", command: str = "ask") -> TextStream:
    """A document as a stream (`-` = stdin), with a regular file decoded once up front so a bad
    document fails before any model loads; `command`: the command whose line a cache given here is
    pointed to. Raises InputError (missing, binary, bad encoding, empty, a cache)."""
    stream = TextStream(path, encoding=encoding, errors=errors, command=command)
    stream.validate()
    return stream


def default_output(document: str) -> Path:
    """Where `ingest DOC` writes without `-o`: DOC's whole name plus `.kv` (`a.txt` → `a.txt.kv`,
    so `a.txt` and `a.md` never replace each other's cache). Raises UsageError (exit 2) for stdin and for
    a document that is not a regular file (a pipe such as `<(cat doc)`, a device): it has no
    name worth keeping, and its directory is not one to write in. Raises OutputError for a document
    in a folder without write permission bits (root could write there; the folder says not to)."""
    if document == "-":
        raise UsageError("reading from stdin needs an output file", "pass -o FILE.kv")
    path = Path(document)
    if not path.is_file():
        raise UsageError(f"{document} is not a regular file (a pipe or a device), so it gives no output name",
                         "pass -o FILE.kv")  # fmt: skip
    check_folder_writable(path, "document", "the cache is", "pass -o FILE.kv")
    return path.with_name(path.name + ".kv")


def check_folder_writable(path: Path, what: str, output: str, hint: str) -> None:
    """Refuse to write `output` ("the cache is": default names) beside `path` (the `what`: document, manifest) when
    its folder has no write permission bits: root could write there, but the folder says not to.
    A folder that cannot be read is left to the output's own checks. Raises OutputError."""
    folder = path.parent if str(path.parent) else Path(".")
    with contextlib.suppress(OSError):
        if not folder.stat().st_mode & 0o222:
            raise OutputError(f"the {what}'s folder {folder} is read-only (no write permission), so {output} "
                              "not written beside it", hint)  # fmt: skip


def check_report(path: Path, force: bool) -> None:
    """Refuse a report's `--json` path before a run, as an `-o` is refused (`check_target`: a
    directory, a missing folder, a special file, an existing file without `force`).
    Raises OutputError."""
    check_target(path, force, "--json")


def write_report(path: Path, force: bool, text: str) -> None:
    """`text` (a JSON report) at `path`, whole or not at all, never over a file that appeared
    meanwhile without `force` (`atomic_write`). Raises OutputError."""
    atomic_write(path, force, lambda f: f.write(text.encode("utf-8")), "--json")


def check_output(output: str | Path, force: bool, document: str | None = None) -> Path:
    """Refuse an output rocketkv must not or cannot write, before any work: what
    `store.atomic.check_target` refuses, a name ending in `/` (a directory), the document
    itself, or a directory this process cannot create files in (checked by creating one).
    Stale temporary files of killed runs in that directory are removed on the way. Returns the
    output as a Path. Raises OutputError; UsageError for `-` (a cache is not written to stdout)."""
    text = str(output)
    target = Path(output)
    if text == "-":
        raise UsageError("-o -: a cache is a file, not a stream to stdout", "name the file, e.g. -o doc.kv")
    if isinstance(output, str) and text.endswith(("/", os.sep)) and not target.is_dir():
        raise OutputError(f"-o {text} names a directory (it ends with /), and there is none",
                          f"create it (mkdir -p {text}) and give a file name in it, e.g. -o {text}DOC.kv")  # fmt: skip
    if document is not None and _same_file(document, target):  # before check_target: --force would not help
        raise OutputError(f"-o {target} is the document itself (it would be replaced by its cache)",
                          "choose another output file, e.g. -o DOC.kv")  # fmt: skip
    parent = check_target(target, force)
    remove_stale_temp_files(parent)
    try:
        probe_writable(parent)
    except OSError as exc:
        raise OutputError(f"cannot write in {parent}: {exc.strerror}", "choose a writable directory with -o") from None
    return target


def _same_file(document: str, target: Path) -> bool:
    """Whether `target` is the file `document` names (`-`: the file stdin reads, when it is one)."""
    try:
        out = os.stat(target)
        src = os.fstat(0) if document == "-" else os.stat(document)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(src.st_mode) and (src.st_dev, src.st_ino) == (out.st_dev, out.st_ino)


def check_cache_file(path: str | Path, command: str = "ask") -> None:
    """Refuse, with the reason, a cache path that is not a readable regular file (missing, a
    directory, a FIFO or device, no permission) before anything reads it. Raises CacheFormatError;
    UsageError for `-` (stdin) when no file has that name. `command`: the rocketkv command the path
    was given to, whose own way with a text document the hint names when the file is text."""
    if str(path) == "-" and not os.path.lexists("-"):  # a file named - (./-) is still read
        raise UsageError("a cache cannot come from stdin (-)", "give the .kv file's path")
    p = Path(path)
    build = (f"build one with: rocketkv ingest DOC -o {path}" if str(path).endswith(".kv")
             else "give a .kv file, written by: rocketkv ingest DOC -o FILE.kv")  # not `-o notes.txt`  # fmt: skip
    try:
        st = p.stat()
    except FileNotFoundError:
        raise CacheFormatError(f"cache file not found: {path}", build) from None
    except PermissionError:
        raise CacheFormatError(f"no permission to reach cache {path}", "check its directories' permissions") from None
    except OSError as exc:
        raise CacheFormatError(f"cannot read cache {path}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise CacheFormatError(f"{path} is a directory, not a cache file",
                               "give a .kv file written by: rocketkv ingest DOC -o FILE.kv")  # fmt: skip
    if not stat.S_ISREG(st.st_mode):
        raise CacheFormatError(f"{path} is not a regular file (a FIFO, socket or device); a cache must be a file",
                               f"copy it to a file first, e.g. cat {path} > copy.kv")  # fmt: skip
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except PermissionError:
        raise CacheFormatError(f"no permission to read cache {path}", "check the file's permissions") from None
    except OSError as exc:
        raise CacheFormatError(f"cannot read cache {path}: {exc.strerror}") from None
    # the safetensors framing, checked here without torch (as `store.header.parse_header` checks it
    # again): a text file given as a cache is refused at once, not after the seconds of an import
    hint = "give a .kv file written by: rocketkv ingest DOC -o FILE.kv"
    if _looks_like_text(head) and p.suffix.lower() == ".kv":  # named as a cache: not a document to ask
        raise CacheFormatError(f"{path} holds text, not a rocketkv cache: damaged, or not written by rocketkv",
                               "rebuild it: rocketkv ingest DOC -o FILE.kv --force")  # fmt: skip
    if _looks_like_text(head):
        raise CacheFormatError(f"{path} is a text document, not a rocketkv cache",
                               _text_hint(command, shlex.quote(str(path))))  # fmt: skip
    if len(head) < 8:
        raise CacheFormatError(f"{path} is not a rocketkv cache (too short)", hint)
    (n,) = struct.unpack("<Q", head[:8])
    if n <= MAX_HEADER_BYTES and n > st.st_size - 8 and head[8:9] == b"{":
        again = "copy it again, or rebuild it: rocketkv ingest DOC -o FILE.kv --force"
        raise CacheFormatError.cut_header(path, n, st.st_size, again)
    if n > MAX_HEADER_BYTES or n > st.st_size - 8:
        raise CacheFormatError(f"{path} is not a rocketkv cache (bad header length)", hint)
    if head[8:9] != b"{":
        raise CacheFormatError(f"{path} is not a rocketkv cache (unreadable header)", hint)


def _text_hint(command: str, path: str) -> str:
    """How `command` takes the text document `path` instead of a cache."""
    if command == "ask":
        return f"ask it directly: rocketkv ask {path} QUESTION"
    if command in ("summarize", "chat"):
        return f"give it without --cache: rocketkv {command} {path}"
    return f"build a cache from it: rocketkv ingest {path}"


def _looks_like_text(head: bytes) -> bool:
    """The first bytes are printable UTF-8 text (a document, not a binary file). A character cut
    by the end of `head` and a leading byte-order mark do not count against it."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3 or exc.reason != "unexpected end of data":
            return False
        text = head[: exc.start].decode("utf-8")  # only the last, incomplete character was cut
    text = text.removeprefix("\ufeff")
    return bool(text) and all(c.isprintable() or c in "\n\r\t" for c in text)


def abandoned_ingests(directory: str | Path) -> list[AbandonedCheckpoints]:
    """Checkpoint folders in `directory` of ingests that are not running (killed, crashed,
    interrupted and never rerun): each names its target, segment count, bytes and age."""
    return abandoned_checkpoints(Path(directory) if str(directory) else Path("."))
