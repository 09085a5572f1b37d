"""Reading documents (files or stdin) as streams of text (`TextStream`, `read_document`,
`TextPieces`) and cutting them into segments of a token budget (`segment_texts`). No torch here.
The engine takes the result as an `engine.inputs.Document` or text."""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from ..engine.inputs import Document
from ..errors import InputError, UsageError

READ_BLOCK_BYTES = 1 << 20
DECODE_ERRORS = ("strict", "replace", "ignore", "backslashreplace")  # handlers whose output is plain text
MAX_PIECE_CHARS = 1 << 20  # a line longer than this is cut (at whitespace when there is some)


def with_cache(command: str, path: str) -> str:
    """The command line that answers from the cache `path` for `command` (ask, chat, summarize;
    ingest and the rest: ask), as a hint for a cache given where a document goes."""
    quoted = shlex.quote(path)
    if command in ("chat", "summarize"):
        return f"rocketkv {command} --cache {quoted}"
    return f"rocketkv ask --cache {quoted} QUESTION"


# formats that are not text in any encoding, by their first bytes: (pattern, what, hint; {q}: the quoted
# path); a compressed format's hint is the command that decompresses it to stdout (`binary_format`)
BINARY_FORMATS = tuple((re.compile(pattern, re.DOTALL), what, hint) for pattern, what, hint in (
    (rb"%PDF-", "a PDF", "extract its text first, e.g. pdftotext -layout {q} out.txt"),
    (rb"\x1f\x8b", "gzip-compressed", "gunzip -c"),
    (rb"BZh[1-9]1AY&SY", "bzip2-compressed", "bunzip2 -c"),
    (rb"\xfd7zXZ\x00", "xz-compressed", "xz -dc"),
    (rb"\x28\xb5\x2f\xfd", "zstd-compressed", "zstd -dc"),
    (rb"PK\x03\x04", "a ZIP archive (or a .docx, .odt or .epub)",
     "extract its text first, e.g. pandoc {q} -t plain -o out.txt"),
    (rb"\x7fELF", "a program (ELF)", "rocketkv reads text documents"),
    (rb"\x89PNG\r\n", "a PNG image", "rocketkv reads text documents"),
    (rb"\xff\xd8\xff", "a JPEG image", "rocketkv reads text documents"),
))  # fmt: skip


# what reads a decompressed document from a pipe, per command (chat's stdin holds its questions)
PIPED_INTO = {"ask": "rocketkv ask - QUESTION", "summarize": "rocketkv summarize -"}


def binary_format(head: bytes, path: str, command: str = "ingest") -> tuple[str, str] | None:
    """(what the file is, what to do) when `head`, a file's first bytes, starts as a known binary
    format does (`BINARY_FORMATS`): a PDF or a compressed file given as a document would otherwise
    be refused as "not valid utf-8", with a hint (another encoding) that reads it as garbage. A
    compressed file's hint pipes it into `command` where that reads a document from stdin (else
    into ingest); stdin (`-`) is told to be piped through the decompressor."""
    for pattern, what, hint in BINARY_FORMATS:
        if not pattern.match(head):
            continue
        if not what.endswith("-compressed"):
            return what, hint.format(q=shlex.quote(path))
        if path == "-":  # already a pipe: the decompressor goes before rocketkv in it
            return what, f"decompress it first: pipe it through {hint}"
        then = PIPED_INTO.get(command, "rocketkv ingest - -o out.kv")
        return what, f"decompress it first: {hint} {shlex.quote(path)} | {then}"
    return None


def _looks_like_cache(head: bytes, path: str) -> bool:
    """A file's first bytes are a safetensors header (8-byte length, then a JSON object) written by
    rocketkv, or by anything when the name ends in .kv: a cache given where a document goes."""
    return len(head) > 10 and head[8:10] == b'{"' and (b'"rocketkv.kv_cache"' in head or path.endswith(".kv"))


class TextStream:
    """The decoded text of `path` (`-` = stdin), read in 1 MiB blocks and yielded in pieces.

    Iterating yields strings that end at a newline (except a document's last piece, and a line
    longer than MAX_PIECE_CHARS, which is cut), so that no more than one block of text is held
    at a time. After iteration, `sha256` is the digest of all bytes read and `has_text` says
    whether any non-whitespace text was seen. `bytes_read` / `total_bytes` (None for stdin and
    other non-regular files) drive progress bars. A UTF-8 BOM is dropped.

    Raises InputError (one line, with a hint) for a missing path, a directory, no permission, an
    unknown codec or error handler, NUL bytes (binary or UTF-16 without `encoding`), undecodable
    bytes (naming the byte offset).
    """

    def __init__(self, path: str, encoding: str = "utf-8", errors: str = "strict", command: str = "ask"):
        self.path, self.encoding, self._errors, self._command = path, encoding, errors, command
        codec = "utf-8-sig" if encoding.lower().replace("_", "-") in ("utf-8", "utf8") else encoding
        try:
            if not codecs.lookup(codec)._is_text_encoding:
                raise LookupError(codec)
            self._decoder = codecs.getincrementaldecoder(codec)(errors=errors)
            self._codec = codecs.lookup(codec).name  # canonical name, for the NUL check ("u8" is utf-8)
        except LookupError as exc:
            raise UsageError(f"unknown text encoding {encoding!r}", "pass a text codec name to --encoding") from exc
        if errors not in DECODE_ERRORS:  # others fail decoding (xmlcharrefreplace) or give lone surrogates
            raise UsageError(f"unknown --errors handler {errors!r}", "use strict, replace, ignore or backslashreplace")
        try:
            self._stream = sys.stdin.buffer if path == "-" else open(path, "rb")
        except FileNotFoundError as exc:
            raise InputError(f"document not found: {path}", "check the path") from exc
        except IsADirectoryError as exc:
            raise InputError(f"{path} is a directory, not a document", "give a text file, or - for stdin") from exc
        except PermissionError as exc:
            raise InputError(f"no permission to read {path}", "check the file's permissions") from exc
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from exc
        st = os.fstat(self._stream.fileno()) if path != "-" else None
        self.total_bytes: int | None = st.st_size if st is not None and Path(path).is_file() else None
        self.bytes_read = 0
        self.has_text = False
        self._digest = hashlib.sha256()
        self._peeked: bytes | None = None  # a stream's first block, read by `validate`
        # absolute: the path is shown and offered back in "rebuild it with" hints, from any directory
        self.source = "-" if path == "-" else os.path.abspath(path).encode("utf-8", "backslashreplace").decode()

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def __iter__(self) -> Iterator[str]:
        carry = ""
        try:
            for text in self._decoded():
                self.has_text = self.has_text or bool(text.strip())
                carry += text
                cut = carry.rfind("\n") + 1
                if cut == 0 and len(carry) > MAX_PIECE_CHARS:
                    cut = max(carry.rfind(" ", 0, MAX_PIECE_CHARS), carry.rfind("\t", 0, MAX_PIECE_CHARS)) + 1
                    cut = cut or MAX_PIECE_CHARS
                if cut:
                    yield carry[:cut]
                    carry = carry[cut:]
            if carry:
                yield carry
        finally:
            if self.path != "-":
                self._stream.close()

    def _decoded(self) -> Iterator[str]:
        path, encoding, decoder = self.path, self.encoding, self._decoder
        hint = "pass --encoding latin-1 (or the right codec), or --errors replace"
        for block in self._blocks():
            self._digest.update(block)
            if self.bytes_read == 0:  # a cache first: its header's length can start as gzip's magic does
                if b"\x00" in block and _looks_like_cache(block, str(path)):
                    fix = f"pass it with --cache: {with_cache(self._command, str(path))}"
                    raise InputError(f"{path} is a rocketkv cache, not a document", fix)
                if (known := binary_format(block, str(path), self._command)) is not None:
                    named = "stdin" if path == "-" else path
                    raise InputError(f"{named} is {known[0]}, not a text document", known[1])
            if b"\x00" in block and self._codec.lower().startswith("utf-8"):
                at = self.bytes_read + block.index(b"\x00")
                raise InputError(
                    f"{path} looks binary (NUL byte at offset {at})",
                    "for UTF-16 text pass --encoding utf-16; rocketkv reads text documents",
                )
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{path} is not valid {encoding} (byte offset {self.bytes_read + exc.start})", hint
                ) from exc
            except UnicodeError as exc:  # a codec's own complaint ("UTF-16 stream does not start with BOM")
                raise InputError(f"{path} is not valid {encoding}: {exc}", hint) from exc
            self.bytes_read += len(block)
            yield text
        pending = len(decoder.getstate()[0])
        try:
            yield decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            at = self.bytes_read - pending + exc.start
            raise InputError(
                f"{path} is not valid {encoding} (incomplete character at byte offset {at})", hint
            ) from exc
        except UnicodeError as exc:
            raise InputError(f"{path} is not valid {encoding}: {exc}", hint) from exc

    def _blocks(self) -> Iterator[bytes]:
        """The raw blocks, the one `validate` peeked at first."""
        if self._peeked is not None:
            block, self._peeked = self._peeked, None
            if not block:
                return
            yield block
        while block := self._stream.read(READ_BLOCK_BYTES):
            yield block

    def validate(self) -> None:
        """Decode a regular file once, up front (cheap), so that encoding errors and empty files
        fail before a long prefill (and before a model loads). Of stdin and other streams (a pipe,
        /dev/null) only the first block is read here, kept for the iteration: a stream with no
        bytes fails now; the rest is checked as it is read."""
        if self.total_bytes is None:
            if self._peeked is None and self.bytes_read == 0:
                self._peeked = self._stream.read(READ_BLOCK_BYTES)
                if not self._peeked:
                    self.check_not_empty()
            return
        check = TextStream(self.path, self.encoding, self._errors, self._command)
        for _ in check:
            pass
        check.check_not_empty()

    def check_not_empty(self) -> None:
        """Raise InputError when the whole stream (already read) had no text."""
        if not self.has_text:
            what = "whitespace only" if self.bytes_read else "empty"
            raise InputError(
                f"document {self.source if self.path != '-' else '(stdin)'} is {what}", "give a document with text"
            )


def read_document(path: str, encoding: str = "utf-8", errors: str = "strict") -> Document:
    """Read all of `path` (`-` = stdin) into one `Document` (for documents that fit the context).

    Raises InputError as `TextStream` does, and for an empty / whitespace-only document.
    """
    stream = TextStream(path, encoding, errors)
    text = "".join(stream)
    stream.check_not_empty()
    return Document(text=text, sha256=stream.sha256, source=stream.source)


def token_counts(tokenizer, pieces: list[str]) -> list[int]:
    """Token count of each string of `pieces` (one batched tokenizer call; no special tokens)."""
    if not pieces:
        return []
    return [len(ids) for ids in tokenizer(pieces, add_special_tokens=False)["input_ids"]]


def _split_long_line(tokenizer, line: str, n_tokens: int, max_tokens: int) -> list[tuple[str, int]]:
    """Cut a line of `n_tokens` > `max_tokens` into parts of at most `max_tokens` tokens each,
    at whitespace where there is some (character cuts sized in proportion to the token count)."""
    parts: list[tuple[str, int]] = []
    stack = [(line, n_tokens)]
    while stack:
        text, n = stack.pop()
        if n <= max_tokens or len(text) < 2:
            parts.append((text, n))
            continue
        size = max(1, min(len(text) - 1, int(len(text) * max_tokens * 0.8 / n)))
        cut = max(text.rfind(" ", 0, size), text.rfind("\t", 0, size)) + 1 or size
        head, tail = text[:cut], text[cut:]
        n_head, n_tail = token_counts(tokenizer, [head, tail])
        stack += [(tail, n_tail), (head, n_head)]  # head is popped first: order is kept
    return parts


def segment_texts(tokenizer, pieces, max_tokens: int) -> Iterator[str]:
    """Group the lines of `pieces` (an iterable of text, e.g. a `TextStream`) into consecutive
    segment texts of at most about `max_tokens` tokens each (counted per line, no special tokens).

    Segments end at line ends; a line longer than a segment is cut (at whitespace when possible).
    Joining the yielded texts gives back the input exactly. Holds one segment of text at a time.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    buf: list[str] = []
    n_buf = 0
    for piece in pieces:
        lines = piece.splitlines(keepends=True)
        for line, n in zip(lines, token_counts(tokenizer, lines)):
            parts = _split_long_line(tokenizer, line, n, max_tokens) if n > max_tokens else [(line, n)]
            for part, n_part in parts:
                if buf and n_buf + n_part > max_tokens:
                    yield "".join(buf)
                    buf, n_buf = [], 0
                buf.append(part)
                n_buf += n_part
    if buf:
        yield "".join(buf)


class TextPieces:
    """An in-memory text with `TextStream`'s interface (for text rocketkv made itself, e.g. summaries)."""

    def __init__(self, text: str, source: str):
        """Raises InputError: a text that is not valid Unicode (a lone surrogate)."""
        self.text, self.source = text, source
        try:
            self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        except UnicodeEncodeError as exc:
            raise InputError(f"document {source} is not valid UTF-8 text (character {exc.start})",
                             "decode it with errors='replace' first") from None  # fmt: skip
        self.total_bytes = self.bytes_read = len(text.encode("utf-8"))

    def __iter__(self) -> Iterator[str]:
        yield self.text

    def check_not_empty(self) -> None:
        """Refuse what a document file would be refused for: no text, or a NUL character (a file
        with one is refused as binary; so is an in-memory text: `text=`, a batch row's "text").
        Raises InputError."""
        if not self.text.strip():
            what = "whitespace only" if self.text else "empty"
            raise InputError(f"document {self.source} is {what}", "give a document with text")
        if "\x00" in self.text:
            at = len(self.text[: self.text.index("\x00")].encode("utf-8"))
            raise InputError(f"document {self.source} looks binary (NUL character at byte offset {at})",
                             "rocketkv reads text documents")  # fmt: skip
