"""What the engine takes in: a decoded `Document`, its token ids with each token's place in the
source (`tokenize_document`), and questions (`check_questions`, the one question check). Standard
library only: the command line, batch manifests and the server check questions before torch loads.
Reading files into documents is `api/documents.py`.
"""

from __future__ import annotations

import bisect
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class Document:
    """A decoded document: its text, the sha256 of its bytes, and where it came from."""

    text: str
    sha256: str
    source: str


_INVISIBLE = {"Cc", "Cf", "Zs", "Zl", "Zp"}  # controls, format characters (zero-width), spaces, line ends


def check_questions(questions: Iterable[str]) -> list[str]:
    """The questions of an `ask`, a `chat` line or a batch row, checked here once for every
    caller: each a non-empty, UTF-8-encodable string, at least one.

    Raises InputError with one-line messages (empty question, a NUL character, control characters
    only, not UTF-8, none given)."""
    qs = list(questions)
    wrong = [q for q in qs if not isinstance(q, str)]
    if wrong:
        kind = type(wrong[0]).__name__
        hint = "decode bytes first" if kind == "bytes" else None
        raise InputError(f"a question must be text (str), got {kind}", hint)
    if any(not q.strip() for q in qs):
        raise InputError("empty question", "give each question some text")
    if any("\0" in q for q in qs):  # UTF-16 read as UTF-8, a binary file: never a question to answer
        raise InputError("a question holds a NUL character (binary data, or UTF-16 read as UTF-8)",
                         "give questions as UTF-8 text")  # fmt: skip
    blank = next((i for i, q in enumerate(qs, 1) if all(unicodedata.category(c) in _INVISIBLE for c in q)), None)
    if blank is not None:  # an unknown or private-use character counts as visible (Python's tables may be older)
        which = f"question {blank} of {len(qs)}" if len(qs) > 1 else "the question"
        raise InputError(f"{which} has no visible text (control or format characters only)",
                         "give each question some text")  # fmt: skip
    for q in qs:
        try:
            q.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError("a question is not valid UTF-8 text", "check the question's encoding") from None
    if not qs:
        raise InputError("no question given", "pass questions as arguments or with --questions-file")
    return qs


def tokenize(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text` (the engine works on ids only)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


@dataclass(frozen=True)
class DocumentTokens:
    """A framed document's token ids and, per token, where it starts in the source document.

    ids: token ids (framing included). offsets: each token's first character in the source
    document (-1 for framing and special tokens). lines: its 1-based line there (0 for those).
    offsets/lines are None when the tokenizer cannot report character offsets (a slow tokenizer).
    """

    ids: list[int]
    offsets: list[int] | None
    lines: list[int] | None


def tokenize_document(tokenizer, framing: str, text: str, add_special_tokens: bool, char_start: int = 0,
                      line_start: int = 1) -> DocumentTokens:  # fmt: skip
    """Token ids of `framing + text` with each token's character offset and line in the source.

    char_start/line_start: where `text` begins in the source document (a segment of a book), in
    characters (0-based) and lines (1-based). Offsets come from the tokenizer's offset mapping.
    """
    framed = framing + text
    try:
        enc = tokenizer(framed, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return DocumentTokens(list(tokenizer(framed, add_special_tokens=add_special_tokens)["input_ids"]), None, None)
    ids = list(enc["input_ids"])
    newlines = [i for i, ch in enumerate(text) if ch == "\n"]
    offsets, lines = [], []
    for start, end in enc["offset_mapping"]:
        at = start - len(framing)
        if end <= start or at < 0:  # framing, BOS and other special tokens
            offsets.append(-1)
            lines.append(0)
            continue
        offsets.append(char_start + at)
        lines.append(line_start + bisect.bisect_left(newlines, at))
    return DocumentTokens(ids, offsets, lines)


def overflow_error(dtype: str | None = None) -> InputError:
    """The error for a model whose numbers left `dtype`'s range (inf or NaN in its keys, values or
    logits): an answer or a cache made of them would be garbage that looks like a result."""
    where = f" in {dtype}" if dtype else ""
    return InputError(f"the model overflowed{where} (inf or NaN in its activations)",
                      "run it with --dtype bfloat16 or --dtype float32")  # fmt: skip
