"""Focus: answer a question from the few passages of the document that match it best, re-read next
to the question, instead of from the whole stored cache.

Small models answer better from a short context than from thousands of tokens. Focus cuts the
stored text (decoded from the cache's token ids, as routing reads it) into passages of consecutive
lines, ranks them by Okapi BM25 of the question's words (`segments.bm25`, the rule routing uses to
pick a segment), keeps the best `n` in document order and prefills only their text, a short
document of its own, before the question is answered from it (`RocketKV.ask_focused`). Whether
that helps is measured, not assumed: docs/prose-questions.md has it as the `focus` row.

Two other rankings are measured beside BM25 (`FOCUS_RANKINGS`): `attention`, the question's own
attention over the stored cache (every query of its prefill, exact softmax weights, relative to
what a generic question pays each token, as `ask --cite` scores tokens: `engine/attribution.py`),
a passage scoring the best of its word tokens; and `mixed`, the two rankings taking turns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.cache import AnyCache, CompressedKVCache
from ..core.config import FOCUS_RANKINGS
from ..engine.answer import decode_config_for, prepare_questions
from ..engine.attribution import baseline_mass, token_scores
from ..engine.decoder import Decoder
from ..engine.engine import Engine
from ..errors import InputError, UsageError
from ..model.hf import AttentionMass, attention_mass
from ..model.templates import read_prompt
from ..store.metadata import all_segments
from .citations import Citation, token_texts
from .segments import bm25
from .summaries import PartTokens, part_text

PASSAGE_CHARS = 600  # a passage's length limit in characters (about 150 tokens of English)
FOCUS_PASSAGES = 4  # passages re-read per question


@dataclass(frozen=True)
class Passage:
    """Consecutive lines of the stored text (the text decoded from the cache): characters
    [start, end) on lines first_line … last_line (1-based), their text, and `score`, its ranking
    score for the question it was chosen for (BM25 unless ranked otherwise, `ranked`; 0.0 before
    ranking)."""

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

    offset = 0  # lines end at "\n" only, as the cache's token lines count them (not at \f, \v, \u2028, …)
    for number, raw in enumerate(text.split("\n"), start=1):
        raw += "\n"
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
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # "x" was a TypeError of `<`
        raise UsageError(f"focus needs at least 1 passage, got {n!r}")
    scores = bm25(texts, question).tolist()
    ranked = sorted((i for i, s in enumerate(scores) if s > 0.0), key=lambda i: (-scores[i], i))
    chosen = set(ranked[:n])
    if keep_start and chosen:
        chosen.add(0)
    return [(i, scores[i]) for i in sorted(chosen)]


def check_ranking(ranking: str, n: int) -> None:
    """Raises UsageError: an unknown ranking (`FOCUS_RANKINGS`) or `n` < 1 passages."""
    if ranking not in FOCUS_RANKINGS:
        raise UsageError(f"unknown focus ranking {ranking!r}", f"one of {', '.join(FOCUS_RANKINGS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # "x" was a TypeError of `<`
        raise UsageError(f"focus needs at least 1 passage, got {n!r}")


def ranked(texts: list[str], question: str, n: int, keep_start: bool = False, ranking: str = "bm25",
           attention: list[float] | None = None) -> list[tuple[int, float]]:  # fmt: skip
    """`rank` by `ranking` (`FOCUS_RANKINGS`): "bm25" is `rank`; "attention" the `n` texts with the
    highest `attention` score (`QuestionAttention.passage_scores`), each with that score; "mixed"
    BM25's and attention's rankings taking turns (`mixed`), each with 1 / its turn. Document order.
    Raises UsageError: an unknown ranking, `n` < 1, or no `attention` scores for one that needs them."""
    check_ranking(ranking, n)
    if ranking == "bm25":
        return rank(texts, question, n, keep_start)
    if attention is None or len(attention) != len(texts):
        raise UsageError(f"focus ranking {ranking!r} needs an attention score per passage")
    by_attention = sorted(range(len(texts)), key=lambda i: (-attention[i], i))
    if ranking == "attention":
        chosen = {i: attention[i] for i in by_attention[:n]}
    else:
        scored = rank(texts, question, len(texts)) if texts else []
        by_bm25 = [i for i, _ in sorted(scored, key=lambda x: (-x[1], x[0]))]
        chosen = {i: 1.0 / (turn + 1) for turn, i in enumerate(mixed(by_bm25, by_attention, n))}
    if keep_start and chosen:
        chosen.setdefault(0, 0.0)
    return sorted(chosen.items())


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


class QuestionAttention:
    """The question's own attention over one stored part (`CompressedKVCache`), by passage. Built
    once per part: the word tokens of each source line and, at the first question, what a generic
    question attends to (`attribution.baseline_mass`, one prefill of prompts/probe.txt). Holds no
    reference to the part (a server's cache LRU can free it).

    Raises InputError: a part without token ids, lines or offsets (an old file)."""

    def __init__(self, engine: Engine, part: CompressedKVCache):
        if part.token_ids is None or part.token_lines is None or part.token_offsets is None:
            raise InputError("ranking passages by attention needs token lines", "rebuild the cache: rocketkv ingest")
        self.engine = engine
        ids, lines, offsets = part.token_ids.tolist(), part.token_lines.tolist(), part.token_offsets.tolist()
        words = {i: any(ch.isalnum() for ch in text) for i, text in token_texts(engine.tokenizer, ids).items()}
        doc = [k for k, off in enumerate(offsets) if off >= 0]
        self.first_line = lines[doc[0]] if doc else 1  # the source line of the part's text line 1
        self.by_line: dict[int, list[int]] = {}  # source line → positions of its word tokens
        for k in doc:
            if words[ids[k]]:
                self.by_line.setdefault(lines[k], []).append(k)
        self.probe_tokens = len(engine.question_ids(read_prompt("probe.txt")))  # what baseline_mass prefills
        self._baseline: AttentionMass | None = None

    def scores(self, question: str, part: CompressedKVCache) -> torch.Tensor:
        """`[n_context_tokens]` by position: each stored token's share of the attention every query
        of the question's prefill (framed as `ask` frames it) pays `part` (exact attention over all
        it stores), over the share a generic question pays it (`attribution.token_scores`).
        Raises InputError (an empty question), BudgetError (one that does not fit the context)."""
        ((_, ids),) = prepare_questions(self.engine, part, [question], 0)
        tail = max(len(ids), self.probe_tokens) + 1
        decoder = Decoder(self.engine, part, tail, decode_config_for(part, sparse=False), reselect=False)
        with torch.inference_mode():
            if self._baseline is None:
                self._baseline = baseline_mass(self.engine, decoder, part)
            with attention_mass(part.n_context_tokens, self.engine.loaded.device, queries="all") as mass:
                with decoder.attention():
                    decoder.prefill(ids)
        return token_scores(mass, self._baseline)[0]

    def passage_scores(self, question: str, part: CompressedKVCache, cut: list[Passage]) -> list[float]:
        """Per passage of `part`'s text (`passages`), the best score of a word token on its lines."""
        got = self.scores(question, part).tolist()
        shift = self.first_line - 1
        return [max((got[k] for ln in range(p.first_line + shift, p.last_line + shift + 1)
                     for k in self.by_line.get(ln, ())), default=0.0) for p in cut]  # fmt: skip


def mixed(first: list[int], second: list[int], n: int) -> list[int]:
    """The first `n` distinct indices of two rankings taking turns (`first`'s best, `second`'s best, …)."""
    out: list[int] = []
    for pair in zip(first + [-1] * len(second), second + [-1] * len(first)):
        for i in pair:
            if i >= 0 and i not in out and len(out) < n:
                out.append(i)
    return out
