"""Focus: answer a question from the few passages of the document that match it best, re-read next
to the question, instead of from the whole stored cache.

Small models answer better from a short context than from thousands of tokens. Focus cuts the
stored text (decoded from the cache's token ids, as routing reads it) into passages of consecutive
lines, ranks them by Okapi BM25 of the question's words (`segments.bm25`, the rule routing uses to
pick a segment), keeps the best `n` in document order and prefills only their text, a short
document of its own, before the question is answered from it (`RocketKV.ask_focused`). Whether
that helps is measured, not assumed: docs/prose-questions.md has it as the `focus` row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.cache import AnyCache
from ..engine.engine import Engine
from ..errors import UsageError
from ..store.metadata import all_segments
from .citations import Citation
from .segments import bm25
from .summaries import PartTokens, part_text

PASSAGE_CHARS = 600  # a passage's length limit in characters (about 150 tokens of English)
FOCUS_PASSAGES = 4  # passages re-read per question


@dataclass(frozen=True)
class Passage:
    """Consecutive lines of the stored text (the text decoded from the cache): characters
    [start, end) on lines first_line … last_line (1-based), their text, and `score`, its BM25
    score for the question it was chosen for (0.0 before ranking)."""

    start: int
    end: int
    first_line: int
    last_line: int
    text: str
    score: float = 0.0


def passages(text: str, max_chars: int = PASSAGE_CHARS) -> list[Passage]:
    """`text` cut into passages of whole lines: a passage ends at a blank line or before the line
    that would take it past `max_chars` (a longer line is a passage alone). Blank lines belong to
    no passage. Raises UsageError: `max_chars` < 1."""
    if max_chars < 1:
        raise UsageError(f"a passage must hold at least 1 character, got {max_chars}")
    out: list[Passage] = []
    lines: list[tuple[int, int, str]] = []  # (line number, start offset, text without its line end)

    def close() -> None:
        if lines:
            (first, start, _), (last, last_start, last_text) = lines[0], lines[-1]
            out.append(Passage(start, last_start + len(last_text), first, last, "\n".join(x for _, _, x in lines)))
        lines.clear()

    offset = 0
    for number, raw in enumerate(text.splitlines(keepends=True), start=1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            close()
        else:
            if lines and sum(len(x) + 1 for _, _, x in lines) + len(line) > max_chars:
                close()
            lines.append((number, offset, line))
        offset += len(raw)
    close()
    return out


def rank(texts: list[str], question: str, n: int, keep_start: bool = False) -> list[tuple[int, float]]:
    """(index, BM25 score) of the `n` texts that score highest for `question`, in document order;
    only texts that share a word with the question; [] when none does. keep_start: text 0 too
    (a document's title and front matter), whatever its score, when any text is chosen.
    Raises UsageError: `n` < 1."""
    if n < 1:
        raise UsageError(f"focus needs at least 1 passage, got {n}")
    scores = bm25(texts, question).tolist()
    ranked = sorted((i for i, s in enumerate(scores) if s > 0.0), key=lambda i: (-scores[i], i))
    chosen = set(ranked[:n])
    if keep_start and chosen:
        chosen.add(0)
    return [(i, scores[i]) for i in sorted(chosen)]


def best_passages(text: str, question: str, n: int = FOCUS_PASSAGES, max_chars: int = PASSAGE_CHARS,
                  keep_start: bool = False) -> list[Passage]:  # fmt: skip
    """The passages of `text` (`passages`) that `rank` chooses for `question`, each with its score.
    Raises UsageError: `n` < 1."""
    cut = passages(text, max_chars)
    return [replace(cut[i], score=score) for i, score in rank([p.text for p in cut], question, n, keep_start)]


def focus_text(chosen: list[Passage]) -> str:
    """The short document re-read before the question: the passages' texts, a blank line apart."""
    return "\n\n".join(p.text for p in chosen) + "\n"


def stored_passages(engine: Engine, cache: AnyCache, max_chars: int = PASSAGE_CHARS) -> list[tuple[int, Passage]]:
    """(part index, passage) of the text each stored part holds (`part_text`: decoded from its
    token ids), in document order; a passage never spans two segments.
    Raises InputError: a cache without token ids (an old file)."""
    return [(j, p) for j, part in enumerate(all_segments(cache)) for p in passages(part_text(engine, part), max_chars)]


def source_passages(engine: Engine, cache: AnyCache, chosen: list[tuple[int, Passage]]) -> list[Citation]:
    """The chosen passages as `Citation`s of the source document (characters and lines through the
    stored token offsets, `summaries.PartTokens`; weight: the passage's share of the scores).
    Raises InputError: a cache without token offsets (an old file)."""
    parts = all_segments(cache)
    tracers: dict[int, PartTokens] = {}
    total = sum(p.score for _, p in chosen) or 1.0
    out = []
    for j, p in chosen:
        tracer = tracers.setdefault(j, PartTokens(engine, parts[j]))
        span = tracer.document_range(p.start, p.end)
        if span is not None:
            out.append(replace(tracer.passage(*span), weight=p.score / total, text=p.text))
    return out
