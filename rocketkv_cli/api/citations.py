"""Citations: the passages of the source document an answer drew on most (`ask --cite`).

The answer loop scores every stored token by the attention the answer paid it beyond what a
generic question pays it (`engine/attribution.py`) and hands the scores to the `citer` built
here. The cache keeps each stored token's id, first character and line in the source document
(`CompressedKVCache.token_ids`, `token_offsets`, `token_lines`; framing tokens have offset -1).

Passages (`cite`): the document token with the best score (words and numbers only: line breaks
and punctuation collect attention wherever they are, as attention sinks) picks its line of the
source; the line, cut to `window_chars` characters around that token when it is longer (shifted
to stay inside the line), is a passage; its tokens are then out of the running and the next token
picks the next passage. A whole line takes in the whole lines before and after it whose best
token scores at least `JOIN_SHARE` of its own (hard-wrapped prose: a sentence over two lines is
one passage, not two fragments), while the passage spans under twice the window.
Each passage's weight is the share of the answer's attention on the document that falls on it.
How often the cited passage holds a planted fact was measured by scripts/citation_report.py
(commit 275f22f; docs/citations.md).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from functools import partial

import torch

from ..core.cache import CompressedKVCache
from ..engine.attribution import Citer
from ..errors import InputError

DEFAULT_WINDOW_CHARS = 240


@dataclass(frozen=True)
class Citation:
    """One cited passage: characters [start, end) of the source document, on lines
    first_line … last_line (1-based); weight: its share (0–1) of the answer's attention on the
    document; text: the passage (decoded from the stored token ids)."""

    start: int
    end: int
    first_line: int
    last_line: int
    weight: float
    text: str

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "line": self.first_line, "end_line": self.last_line,
                "weight": round(self.weight, 4), "text": self.text}  # fmt: skip


def check_citable(cache: CompressedKVCache) -> None:
    """Raises InputError when `cache` has no token offsets to cite from (a file written before
    rocketkv stored them)."""
    if cache.token_ids is None or cache.token_offsets is None or cache.token_lines is None:
        source = cache.info.document_source
        raise InputError(
            "this cache has no token offsets to cite from (written by an older rocketkv)",
            f"rebuild it: rocketkv ingest {shlex.quote(source) if source else 'DOC'} -o FILE.kv --force",
        )


def citer(tokenizer, cache: CompressedKVCache, n_passages: int) -> Citer | None:
    """The answer loop's `cite` callback (`engine.answer.Answerer`): an answer's scores to its
    `n_passages` best passages of `cache` (`cite`); None for 0 (no citations, no attention captured).
    Raises:
        InputError: `n_passages` > 0 for a cache without token offsets (`check_citable`).
    """
    if not n_passages:
        return None
    check_citable(cache)
    return partial(cite, tokenizer, cache, n_passages=n_passages)


def token_texts(tokenizer, ids: list[int]) -> dict[int, str]:
    """The text of each distinct id on its own."""
    unique = sorted(set(ids))
    return dict(zip(unique, tokenizer.batch_decode([[i] for i in unique], skip_special_tokens=True)))


def _line_span(line: list[int], ids: list[int], offsets: list[int], texts: dict[int, str]) -> tuple[int, int]:
    """Characters [start, end) of a line's text without the whitespace around it (its indent, the
    space a token such as " And" carries, its line break), from the positions of its tokens."""
    words = [i for i in line if texts[ids[i]].strip()] or line
    first, last = texts[ids[words[0]]], texts[ids[words[-1]]]
    return offsets[words[0]] + len(first) - len(first.lstrip()), offsets[words[-1]] + len(last.rstrip())


def _window(start: int, end: int, at: int, width: int) -> tuple[int, int]:
    """Characters [lo, hi) of a passage around character `at` of the line [start, end): the whole
    line when it is at most `width` characters, else `width` characters centred on `at`, shifted
    to stay inside the line."""
    if end - start <= width:
        return start, end
    lo = min(max(at - width // 2, start), end - width)
    return lo, lo + width


def _whole_words(span: list[int], ids: list[int], texts: dict[int, str]) -> list[int]:
    """`span` (consecutive positions of one line) without the pieces of words cut at its ends."""

    def starts_word(k: int) -> bool:
        i = span[k]
        return i == 0 or texts[ids[i]][:1].isspace() or texts[ids[i - 1]][-1:].isspace()

    first = next((k for k in range(len(span)) if starts_word(k)), 0)
    last = next((k - 1 for k in range(len(span) - 1, first, -1) if starts_word(k)), len(span) - 1)
    return span[first : last + 1] or span


JOIN_SHARE = 0.25  # a neighbouring line joins a cited line when its best score is at least this share of the line's


def _with_neighbours(span: list[int], by_line: dict[int, list[int]], lines: list[int], offsets: list[int],
                     used: set[int], best_of, score: float, most_chars: int, line_span) -> list[int]:  # fmt: skip
    """`span` (a whole line's positions) with the whole lines before and after it whose best word
    scores at least `JOIN_SHARE` × `score` (the cited line's best), none of their tokens cited
    yet, the passage spanning fewer than `most_chars` characters; the better neighbour first.
    Hard-wrapped prose: a sentence over two lines is one passage, not two fragments."""
    here = lines[span[0]]
    out = list(span)
    for ln in sorted((here - 1, here + 1), key=lambda n: -best_of(n) if n in by_line else 0.0):
        if ln not in by_line or any(i in used for i in by_line[ln]) or best_of(ln) < JOIN_SHARE * score:
            continue
        lo, hi = line_span(ln)
        first, last = min(lo, offsets[out[0]]), max(hi, offsets[out[-1]])
        if last - first < most_chars and hi - lo <= most_chars // 2:  # the neighbour fits a window whole
            out = sorted(out + by_line[ln])
    return out


def _token_text(tokenizer, ids: list[int], i: int) -> str:
    return tokenizer.decode([ids[i]], skip_special_tokens=True)


def source_start(tokenizer, ids: list[int], offsets: list[int], first: int, last: int) -> int:
    """The source character where the text of tokens first … last begins: past whitespace-only
    tokens (a line's indent) and past the space a token such as " And" (byte-level BPE) carries
    in front of its word, which its offset points at."""
    while first < last and not _token_text(tokenizer, ids, first).strip():
        first += 1
    text = _token_text(tokenizer, ids, first)
    word = text.lstrip()
    return offsets[first] + (len(text) - len(word) if word else 0)


def source_end(tokenizer, ids: list[int], offsets: list[int], first: int, last: int) -> int:
    """The source character after the text of tokens first … last: before whitespace-only tokens
    at its end (a line break) and the spaces or line break a token such as ".\n" carries after
    its text; else the next document token's offset (or the last token's own end)."""
    while last > first and not _token_text(tokenizer, ids, last).strip():
        last -= 1
    text = _token_text(tokenizer, ids, last)
    own = offsets[last] + len(text)
    after = next((offsets[j] for j in range(last + 1, len(ids)) if offsets[j] >= 0), own)
    word = text.rstrip()
    return after - (len(text) - len(word)) if word and after == own else after


def cite(
    tokenizer,
    cache: CompressedKVCache,
    scores: torch.Tensor,
    share: torch.Tensor,
    n_passages: int,
    window_chars: int = DEFAULT_WINDOW_CHARS,
    rank: str = "peak",
) -> tuple[Citation, ...]:
    """The `n_passages` best passages of the source, in the order of their best tokens (`rank`), so a
    later passage can have the larger weight.

    scores, share: `[n_context_tokens]` by position (`engine.attribution.token_scores`). rank: "peak" (a passage is
    picked by its best token, as described above) or "sum" (by the total score of its line's
    word tokens; compared in docs/citations.md).
    Raises:
        InputError: a cache without token offsets (`check_citable`).
    """
    check_citable(cache)
    assert cache.token_ids is not None and cache.token_offsets is not None and cache.token_lines is not None
    ids = cache.token_ids.tolist()
    offsets = cache.token_offsets.tolist()
    lines = cache.token_lines.tolist()
    weights = scores.detach().float().cpu()[: len(ids)]
    shares = share.detach().float().cpu()[: len(ids)]
    doc = [i for i, off in enumerate(offsets) if off >= 0]
    if not doc:
        return ()
    total = float(shares[doc].sum()) or 1.0
    texts = token_texts(tokenizer, ids)
    content = {i: any(ch.isalnum() for ch in text) for i, text in texts.items()}
    by_line: dict[int, list[int]] = {}
    for i in doc:
        by_line.setdefault(lines[i], []).append(i)
    candidates = [i for i in doc if content[ids[i]]]
    if rank == "sum":
        line_score = {ln: float(weights[[i for i in toks if content[ids[i]]] or toks].sum())
                      for ln, toks in by_line.items()}  # fmt: skip
        candidates.sort(key=lambda i: (-line_score[lines[i]], -float(weights[i])))
    else:
        candidates.sort(key=lambda i: -float(weights[i]))
    used: set[int] = set()
    out: list[Citation] = []
    line_best: dict[int, float] = {}

    def best_of(ln: int) -> float:  # the best score of a line's word tokens
        if ln not in line_best:
            toks = [i for i in by_line[ln] if content[ids[i]]]
            line_best[ln] = float(weights[toks].max()) if toks else 0.0
        return line_best[ln]

    for best in candidates:
        if len(out) == n_passages:
            break
        if best in used:
            continue
        line = by_line[lines[best]]
        start, end = _line_span(line, ids, offsets, texts)
        lo, hi = _window(start, end, offsets[best], window_chars)
        # the window's characters, and the line's indent or line break where it reaches them
        span = [i for i in line if (lo <= offsets[i] < hi or offsets[i] < lo <= start or offsets[i] >= hi >= end)
                and i not in used]  # fmt: skip
        if len(span) < len(line):  # a window inside a longer line: whole words only
            span = _whole_words(span, ids, texts)
        else:  # a whole line takes in a whole neighbouring line the answer drew on nearly as much
            whole_line = lambda ln: _line_span(by_line[ln], ids, offsets, texts)  # noqa: E731
            span = _with_neighbours(span, by_line, lines, offsets, used, best_of, float(weights[best]),
                                    2 * window_chars, whole_line)  # fmt: skip
        used.update(span, by_line[lines[best]] if rank == "sum" else ())
        first, last = span[0], span[-1]
        text = " ".join(tokenizer.decode(ids[first : last + 1], skip_special_tokens=True).split())
        start = source_start(tokenizer, ids, offsets, first, last)
        end = source_end(tokenizer, ids, offsets, first, last)
        out.append(Citation(start=start, end=end, first_line=lines[first], last_line=lines[last],
                            weight=float(shares[span].sum()) / total, text=text))  # fmt: skip
    return tuple(out)
