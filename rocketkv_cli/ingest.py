"""Reading documents (files or stdin) into text, and text into token ids. No torch kernels here."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

READ_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class Document:
    """A decoded document: its text, the sha256 of its bytes, and where it came from."""

    text: str
    sha256: str
    source: str


def read_document(path: str, encoding: str = "utf-8", errors: str = "strict") -> Document:
    """Read `path` (`-` = stdin) in blocks and decode it.

    A UTF-8 BOM is dropped. Raises InputError (one line, with a hint) for a missing path, a
    directory, no permission, NUL bytes (binary or UTF-16 without `--encoding`), undecodable
    bytes (naming the byte offset), or an empty / whitespace-only document.
    """
    digest = hashlib.sha256()
    codec = "utf-8-sig" if encoding.lower().replace("_", "-") in ("utf-8", "utf8") else encoding
    try:
        if not codecs.lookup(codec)._is_text_encoding:
            raise LookupError(codec)
        decoder = codecs.getincrementaldecoder(codec)(errors=errors)
        codec = codecs.lookup(codec).name  # canonical name, for the NUL check below ("u8" is utf-8)
    except LookupError as exc:
        raise InputError(f"unknown text encoding {encoding!r}", "pass a text codec name to --encoding") from exc
    try:
        codecs.lookup_error(errors)
    except LookupError as exc:
        raise InputError(f"unknown --errors handler {errors!r}", "use strict, replace or ignore") from exc
    parts: list[str] = []
    offset = 0
    try:
        stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    except FileNotFoundError as exc:
        raise InputError(f"document not found: {path}", "check the path") from exc
    except IsADirectoryError as exc:
        raise InputError(f"{path} is a directory, not a document", "give a text file, or - for stdin") from exc
    except PermissionError as exc:
        raise InputError(f"no permission to read {path}", "check the file's permissions") from exc
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from exc
    with stream if path != "-" else contextlib.nullcontext(stream):
        while block := stream.read(READ_BLOCK_BYTES):
            digest.update(block)
            if b"\x00" in block and codec.lower().startswith("utf-8"):
                at = offset + block.index(b"\x00")
                raise InputError(
                    f"{path} looks binary (NUL byte at offset {at})",
                    "for UTF-16 text pass --encoding utf-16; rocketkv reads text documents",
                )
            try:
                parts.append(decoder.decode(block))
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{path} is not valid {encoding} (byte offset {offset + exc.start})",
                    "pass --encoding latin-1 (or the right codec), or --errors replace",
                ) from exc
            offset += len(block)
        pending = len(decoder.getstate()[0])
        try:
            parts.append(decoder.decode(b"", final=True))
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{path} is not valid {encoding} (incomplete character at byte offset {offset - pending + exc.start})",
                "pass --encoding latin-1 (or the right codec), or --errors replace",
            ) from exc
    text = "".join(parts)
    if not text.strip():
        what = "empty" if not text else "whitespace only"
        raise InputError(f"document {path if path != '-' else '(stdin)'} is {what}", "give a document with text")
    source = "-" if path == "-" else str(Path(path)).encode("utf-8", "backslashreplace").decode("utf-8")
    return Document(text=text, sha256=digest.hexdigest(), source=source)


def tokenize(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text` (the engine works on ids only)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
