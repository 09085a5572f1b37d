"""Summaries of a stored document, never a degenerate one; hierarchical over a segmented cache
(`summarize`: each segment, then the joined summaries, ingested in memory, recursively).

One summary of one stored part (`summarize_part`): the model writes it, is asked once more
in another framing when the result fails the summary check (`rejection_reasons`: degenerate,
not grounded in the part's text, or naming too few of its main names), and the part's most
central sentences are extracted when that fails too.

What the model writes from (`write_from`, one of WRITE_FROM): "sentences" (extract, then write:
the part's most central sentences, `summary_check.extract_sentences`, become a short document of
their own, ingested in memory with every token stored, and the model summarizes that: a tiny
model writes best from a short context; `summarize_text`) or "document" (the model attends the
stored part itself, every token of up to a segment, as `ask` does).

Modes (`Summary.mode`): "written" and "written-retry" (the model's text from the key sentences,
in the first or the retry framing), "abstractive" (from the stored part, the first framing's
text, unchanged), "abstractive-retry" (`prompts/summarize_retry.txt` asked as a question in the
cache's question framing: for the base model, which is first asked to continue the document
after "Summary:", this is the question framing; for a chat model, a reworded request) and
"extractive" (`summary_check.extract_sentences` over the part's text, decoded from its stored
token ids). `summarize` runs it for every part and for the final condensation. No printing here.

Citations (`summarize(cite=N)`, `summarize --cite`): every summary (each part's and the final one)
lists the passages of the source document it came from, as `api.citations.Citation`s sorted by
line (`Summary.citations`, `PartialSummary.citations`):

- extracted sentences cite exactly the text they were extracted from: each sentence is found in
  the part's decoded text, its first and last document tokens give its characters and lines in
  the document (`token_offsets`, `token_lines`); a sentence extracted from joined summaries cites
  the passages of the part summary it came from. Every sentence is cited (N does not apply).
- a summary the model wrote from a stored part of the document cites the N passages its
  generation attended to most, as `ask --cite` does (`engine/attribution.py`, `citations.cite`).
- a summary the model wrote from key sentences cites the passages those sentences came from
  (as the extracted sentences would; N does not apply).
- a summary the model wrote from joined summaries (a condensation) is not attended over the
  document, so it cites the passages of the part summaries it was written from (of the parts
  whose text its stored part holds).

A citation's weight is its share of the summary: the attention share for the model's own
citations; otherwise the share of the summary's characters traced to it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache

from ..core.cache import CompressedKVCache, SegmentedKVCache
from ..core.config import DEFAULT_SUMMARY_WRITE_FROM, STORE_ALL, SUMMARY_WRITE_FROM, PrefillConfig
from ..engine.answer import Answer, Answerer, TextCallback, answer, decode_config_for
from ..engine.engine import Engine
from ..engine.inputs import Document, tokenize
from ..errors import BudgetError, InputError, UsageError
from ..model.templates import read_prompt
from .checks import check_cite
from .citations import Citation, citer, source_end, source_start
from .documents import TextPieces, segment_texts
from .segments import SEGMENT_SLACK_TOKENS, frame_tokens, ingest_stream, segment_limit
from .summary_check import (
    coverage,
    degenerate_reasons,
    document_names,
    extract_sentences,
    grounding,
    outline_placed,
    split_sentences,
)

SUMMARY_STOP_STRINGS = ("\n\n\n",)  # summaries are paragraphs: only a long gap ends one early
MODES = ("written", "written-retry", "abstractive", "abstractive-retry", "extractive")
WRITE_FROM, DEFAULT_WRITE_FROM = SUMMARY_WRITE_FROM, DEFAULT_SUMMARY_WRITE_FROM  # module docstring
PROMPT_FILES = ("summarize.txt", "summarize_parts.txt", "summarize_plain.txt", "summarize_retry.txt",
                "plain.txt", "chat.txt")  # fmt: skip
EXTRACTED_STOP_REASON = "extracted"
PART_LABEL = re.compile(r"(?m)^Part \d+ of \d+: ")  # how `summarize` labels the joined summaries


@dataclass(frozen=True)
class Summary(Answer):
    """An `Answer` that says how it was made: `mode` (one of MODES) and `rejected` (the reasons
    each model output was rejected, in order: `rejection_reasons`). An extracted summary has no answer
    tokens (`n_answer_tokens` 0, `stop_reason` "extracted")."""

    mode: str = "abstractive"
    rejected: tuple[str, ...] = ()
    spans: Spans = field(default=(), repr=False, compare=False)


Spans = tuple[tuple[int, int, Citation], ...]
"""Where a summary came from: (start, end, citation) per traced piece, [start, end) the characters
of the summary's text (the whole text for a model-written one) and the citation's weight its
share of the summary (weights sum to 1; empty: nothing traced or no citations asked for)."""

SourceMap = Callable[[int, int], list[tuple[Citation, float]]]
"""Characters [a, b) of a text to the passages of the document they came from, each with its
share (shares sum to 1; empty: none known)."""


@cache
def prompt_texts() -> tuple[str, ...]:
    """The texts of every prompt a summary may echo (`PROMPT_FILES`)."""
    return tuple(read_prompt(name) for name in PROMPT_FILES)


def extractable(stored: CompressedKVCache | SegmentedKVCache) -> bool:
    """Whether sentences can be extracted from a cache: every part holds its token ids (a file
    written by an older rocketkv may not)."""
    parts = stored.segments if isinstance(stored, SegmentedKVCache) else [stored]
    return all(part.token_ids is not None for part in parts)


def part_text(engine: Engine, part: CompressedKVCache) -> str:
    """The document text of a stored part: its token ids after the framing, decoded.

    Raises:
        InputError: a cache without token ids (an old file).
    """
    if part.token_ids is None:
        raise InputError("this cache holds no token ids, so no sentences can be extracted from it",
                         "rebuild it: rocketkv ingest DOC -o FILE.kv")  # fmt: skip
    frame = len(engine.document_ids(Document("", "", "")))
    return engine.tokenizer.decode(part.token_ids[frame:].tolist(), skip_special_tokens=True)


class PartTokens:
    """A stored part's document tokens and its decoded text (`part_text`), to trace characters of
    that text back to the tokens they were decoded from.

    Raises:
        InputError: a cache without token offsets (`citations.check_citable`).
    """

    def __init__(self, engine: Engine, part: CompressedKVCache):
        check_cite(part, 1)
        assert part.token_ids is not None and part.token_offsets is not None and part.token_lines is not None
        self.tokenizer = engine.tokenizer
        self.ids: list[int] = part.token_ids.tolist()
        self.offsets: list[int] = part.token_offsets.tolist()
        self.lines: list[int] = part.token_lines.tolist()
        self.frame = len(engine.document_ids(Document("", "", "")))
        self.text = part_text(engine, part)

    def token_at(self, pos: int) -> int:
        """The position of the token whose decoded text holds character `pos` of `self.text`
        (binary search over decoded prefixes: a token may decode to several characters)."""
        lo, hi = self.frame, len(self.ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(self.ids[self.frame : mid + 1], skip_special_tokens=True)) > pos:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def document_range(self, a: int, b: int) -> tuple[int, int] | None:
        """(first, last) positions of the document tokens (offset ≥ 0) that characters [a, b) of
        `self.text` were decoded from; None when none are."""
        first, last = self.token_at(a), self.token_at(max(a, b - 1))
        doc = [i for i in range(first, last + 1) if self.offsets[i] >= 0]
        return (doc[0], doc[-1]) if doc else None

    def end_of(self, last: int) -> int:
        """The source character after token `last` (the next document token's offset)."""
        after = next((self.offsets[j] for j in range(last + 1, len(self.ids)) if self.offsets[j] >= 0), None)
        return after if after is not None else self.offsets[last] + len(self.tokenizer.decode([self.ids[last]]))

    def passage(self, first: int, last: int) -> Citation:
        """Tokens first … last as a passage of the source (weight 1), as `citations.cite` makes them."""
        text = " ".join(self.tokenizer.decode(self.ids[first : last + 1], skip_special_tokens=True).split())
        start = source_start(self.tokenizer, self.ids, self.offsets, first, last)
        end = source_end(self.tokenizer, self.ids, self.offsets, first, last)
        return Citation(start=start, end=end, first_line=self.lines[first],
                        last_line=self.lines[last], weight=1.0, text=text)  # fmt: skip

    def source_map(self, origin: SourceMap | None) -> SourceMap:
        """Characters of `self.text` to passages of the document: the tokens' own passage when
        their offsets are the document's (`origin` None), else `origin` of the characters
        [first offset, end) they hold in the text the part was ingested from (joined summaries)."""

        def trace(a: int, b: int) -> list[tuple[Citation, float]]:
            span = self.document_range(a, b)
            if span is None:
                return []
            if origin is None:
                return [(self.passage(*span), 1.0)]
            return origin(self.offsets[span[0]], self.end_of(span[1]))

        return trace

    def whole(self) -> tuple[int, int]:
        """Characters [start, end) of the source that the part's document tokens cover."""
        doc = [i for i, off in enumerate(self.offsets) if off >= 0]
        return (self.offsets[doc[0]], self.end_of(doc[-1])) if doc else (0, 0)


def joined_map(parts: Sequence[tuple[str, Spans]], labeled: bool) -> SourceMap:
    """Characters of the part summaries' joined text to the passages they came from: the text
    `summarize` ingests ("Part j of n: " labels, `labeled`) or extracts from (no labels), parts
    separated by a blank line. A range over part j's text [lo, hi) takes each traced piece of that
    summary it overlaps, weighted by the piece's weight times the share of the piece it overlaps."""
    starts, pos = [], 0
    for j, (text, _) in enumerate(parts):
        pos += (2 if j else 0) + (len(f"Part {j + 1} of {len(parts)}: ") if labeled else 0)
        starts.append(pos)
        pos += len(text)

    def trace(a: int, b: int) -> list[tuple[Citation, float]]:
        hits: list[tuple[Citation, float]] = []
        for start, (text, spans) in zip(starts, parts):
            lo, hi = max(a - start, 0), min(b - start, len(text))
            if lo >= hi:
                continue
            for s, e, c in spans:
                overlap = min(e, hi) - max(s, lo)
                if overlap > 0:
                    hits.append((c, c.weight * overlap / max(e - s, 1)))
        total = sum(w for _, w in hits) or 1.0
        return [(c, w / total) for c, w in hits]

    return trace


PartTexts = Sequence[tuple[str, SourceMap | None]]
"""A segmented document's parts in order: each part's text and, for citations, the map of its
characters to the document's passages (None: no citations)."""


def outline(partials: Sequence[tuple[str, Spans]], names: tuple[str, ...] | None, texts: PartTexts,
            cite: bool) -> tuple[list[str], str, Spans | None]:  # fmt: skip
    """The extracted final summary of a segmented document (`summary_check.outline_placed` over
    its parts' summaries `partials`, covering `names`, default the summaries' own, with the parts'
    `texts`, aligned with `partials`, as the reserve for coverage); the text a summary written from
    those sentences is checked against (the summaries joined, then the sentences taken from the
    parts' texts) and, with `cite`, the sentences' traced pieces: each found in the piece it was
    taken from (part j's summary, traced by its own pieces, or part j's text, by that part's map).

    Raises:
        InputError: summaries without a sentence.
    """
    summaries = [PART_LABEL.sub("", text) for text, _ in partials]
    wanted = names if names is not None else tuple(document_names("\n\n".join(summaries)))
    placed = outline_placed(summaries, wanted, [text for text, _ in texts])
    if not placed:
        raise no_sentence("\n\n".join(text for text, _ in texts))
    sentences = [sentence for sentence, _, _ in placed]
    checked = "\n\n".join([*summaries, *(sentence for sentence, _, rank in placed if rank == 1)])
    if not cite:
        return sentences, checked, None
    total = sum(len(sentence) for sentence in sentences) or 1
    spans: list[tuple[int, int, Citation]] = []
    at = 0
    for sentence, j, rank in placed:
        text, source = (summaries[j], joined_map([partials[j]], labeled=False)) if rank == 0 else texts[j]
        found = _sentence_pattern(sentence).search(text)
        if found is not None and source is not None:
            for c, w in source(found.start(), found.end()):
                spans.append((at, at + len(sentence), dataclasses.replace(c, weight=w * len(sentence) / total)))
        at += len(sentence) + 1
    return sentences, checked, tuple(spans)


def _sentence_pattern(sentence: str) -> re.Pattern[str]:
    """A sentence as `summary_check.split_sentences` gives it (its lines joined by single spaces;
    cut ones end with " …") matched in the text it came from, whatever whitespace is there."""
    return re.compile(r"\s+".join(re.escape(w) for w in sentence.removesuffix(" …").split()))


def trace_sentences(sentences: Sequence[str], text: str, source: SourceMap) -> Spans:
    """The traced pieces of an extracted summary (`" ".join(sentences)`): each sentence found in
    `text` (in order, as extracted), mapped to its passages by `source`, weighted by its share of
    the summary's characters. A sentence not found in `text` is not traced."""
    out, at, cursor = [], 0, 0
    total = sum(len(s) for s in sentences) or 1
    for sentence in sentences:
        pattern = _sentence_pattern(sentence)
        found = pattern.search(text, cursor) or pattern.search(text)
        if found is not None:
            cursor = found.end()
            for c, w in source(found.start(), found.end()):
                out.append((at, at + len(sentence), dataclasses.replace(c, weight=w * len(sentence) / total)))
        at += len(sentence) + 1
    return tuple(out)


def citations_of(spans: Spans, normalise: bool = True) -> tuple[Citation, ...]:
    """A summary's citations from its traced pieces: one per passage (the same characters of
    the source), weights summed (and normalised to 1 unless `normalise` is False: attention shares
    are kept as `ask --cite` shows them), sorted by line (then character)."""
    merged: dict[tuple[int, int], Citation] = {}
    for _, _, c in spans:
        key = (c.start, c.end)
        had = merged.get(key)
        merged[key] = c if had is None else dataclasses.replace(had, weight=had.weight + c.weight)
    total = (sum(c.weight for c in merged.values()) or 1.0) if normalise else 1.0
    return tuple(sorted((dataclasses.replace(c, weight=c.weight / total) for c in merged.values()),
                        key=lambda c: (c.first_line, c.start, c.end)))  # fmt: skip


def with_citations(summary: Summary, spans: Spans, normalise: bool = True) -> Summary:
    """`summary` with its traced pieces and its citations (`citations_of`)."""
    return dataclasses.replace(summary, spans=spans, citations=citations_of(spans, normalise))


def extracted(
    text: str, question: str, rejected: tuple[str, ...] = (), names: tuple[str, ...] | None = None
) -> Summary:
    """The extractive summary of `text`: its central sentences joined by spaces (the "Part j of
    n: " labels of joined summaries, `PART_LABEL`, are not part of any sentence), covering `names`
    (default: the text's own most frequent names; `summary_check.extract_sentences`).

    Raises:
        InputError: a text without a word (nothing the summary could be made of).
    """
    return extracted_summary(extracted_sentences(text, names), question, rejected)


def extracted_sentences(text: str, names: tuple[str, ...] | None = None) -> list[str]:
    """The sentences of `extracted`'s summary of `text`, in order.

    Raises:
        InputError: a text without a word.
    """
    plain = PART_LABEL.sub("", text)
    sentences = extract_sentences(plain, names=names)
    if not sentences:
        raise no_sentence(plain)
    return sentences


def no_sentence(text: str) -> InputError:
    """The error for a document no summary sentence could be taken from: it holds no words, or
    its words are in no sentence a summary may take (no . ! ? ends them, or each repeats a run of
    words around it: a log, a list, the same line many times), which "holds no words" misnamed."""
    if not split_sentences(text):
        return InputError("the document has no sentence to extract a summary from (it holds no words)",
                          "summarize a text document")  # fmt: skip
    return InputError("the document has no sentence to extract a summary from: no . ! ? ends its text, or each "
                      "part repeats the words around it (a log, a list, one line many times)",
                      "summarize prose; for a log or a list, ask a question about it instead")  # fmt: skip


def extracted_summary(sentences: list[str], question: str, rejected: tuple[str, ...] = ()) -> Summary:
    """The `Summary` of extracted `sentences` (joined by spaces; mode "extractive")."""
    return Summary(question=question, text=" ".join(sentences), n_question_tokens=0, n_answer_tokens=0,
                   stop_reason=EXTRACTED_STOP_REASON, token_ids=(), prefill_s=0.0, decode_s=0.0, mode="extractive",
                   rejected=rejected)  # fmt: skip


def _write(engine: Engine, part: CompressedKVCache, prompt: str, max_new_tokens: int, sparse: bool,
           retry: bool, cite: int = 0) -> Answer:  # fmt: skip
    """The model's summary of `part` in the first framing (retry False) or the retry framing;
    cite: the number of passages its attention picks (`Answer.citations`, as `ask --cite`)."""
    decode = decode_config_for(part, sparse)
    citing = citer(engine.tokenizer, part, cite)
    if retry:
        question = read_prompt("summarize_retry.txt")
        return next(answer(engine, part, [question], max_new_tokens, decode, cite=citing))  # the framing's stops
    after = engine.prompt.summary_after
    if after is not None:
        ids = tokenize(engine.tokenizer, after, False)
        answerer = Answerer(engine, part, max_new_tokens, decode, engine.prompt.summary_stops,
                            question_tokens=len(ids), cite=citing)  # fmt: skip
        return answerer.ask(prompt, ids)
    stops = SUMMARY_STOP_STRINGS if engine.prompt.stop_strings else ()
    return next(answer(engine, part, [prompt], max_new_tokens, decode, stop_strings=stops, cite=citing))


def write_from_sentences(engine: Engine, sentences: Sequence[str], prompt: str, max_new_tokens: int,
                         retry: bool) -> Answer:  # fmt: skip
    """The model's summary written from `sentences` alone: joined one per line into a short
    document, ingested in memory with every token stored (`STORE_ALL`), and asked for as `_write`
    asks a stored part (the first framing, or the retry framing when `retry`), attending it exactly.

    Raises:
        BudgetError: sentences that do not fit one segment (never for `extract_sentences`' at most
        ten sentences, or an outline's at most 17, of at most 60 words).
    """
    cfg = PrefillConfig(max_new_tokens=max_new_tokens, store_budget=STORE_ALL)
    short = ingest_stream(engine, TextPieces("\n".join(sentences), "key sentences"), cfg)
    if not isinstance(short, CompressedKVCache):
        raise BudgetError(f"the {len(sentences)} key sentences do not fit one segment", "use --extractive")
    return _write(engine, short, prompt, max_new_tokens, sparse=False, retry=retry)


def summarize_text(engine: Engine, text: str, prompt: str, max_new_tokens: int, names: tuple[str, ...] | None = None,
                   trace: SourceMap | None = None, sentences: list[str] | None = None,
                   spans: Spans | None = None) -> Summary:  # fmt: skip
    """Extract, then write: the summary of `text` the model writes from its key sentences
    (`extracted_sentences(text, names)`, `write_from_sentences`) in the first framing ("written"),
    else the retry framing ("written-retry"), else those sentences themselves ("extractive"): the
    first that `rejection_reasons` does not reject against `text` and `names`.

    trace: characters of `text` to the document's passages (`SourceMap`), or None for no
    citations; a written summary cites the passages of the sentences it was written from (each
    weighted by its sentence's share of their characters), an extracted one each sentence's own.
    sentences: the key sentences, already extracted (default: `extracted_sentences` of `text`);
    spans: their traced pieces, already traced (default: traced in `text` by `trace`).
    Raises:
        InputError: a text without a word.
    """
    sentences = sentences if sentences is not None else extracted_sentences(text, names)
    if spans is None and trace is not None:
        spans = trace_sentences(sentences, text, trace)
    rejected: list[str] = []
    for mode, retry in (("written", False), ("written-retry", True)):
        written = write_from_sentences(engine, sentences, prompt, max_new_tokens, retry)
        reasons = rejection_reasons(written.text, text, names)
        if not reasons:
            fields = {f.name: getattr(written, f.name) for f in dataclasses.fields(written)}
            summary = Summary(**fields, mode=mode, rejected=tuple(rejected))
            return summary if spans is None else with_citations(summary, tuple((0, len(summary.text), c)
                                                                               for _, _, c in spans))  # fmt: skip
        rejected.append(f"{mode}: {', '.join(reasons)}")
    summary = extracted_summary(sentences, prompt, tuple(rejected))
    return summary if spans is None else with_citations(summary, spans)


def rejection_reasons(summary: str, source: str | None, names: tuple[str, ...] | None = None) -> list[str]:
    """Why a model-written summary of `source` is not printed: the degenerate rules
    (`summary_check.degenerate_reasons`), then, when the source text is known, grounding (a share
    of its content words, or a proper name, not in the source: words the model made up) and
    coverage (fewer of the source's most frequent proper names than `summary_check.coverage`
    requires; `names`: the document's, when `source` is the joined summaries of its parts) — the
    rules of the summary check (docs/summaries.md). Empty: print it."""
    reasons = degenerate_reasons(summary, prompt_texts())
    if reasons or source is None:
        return reasons
    g, c = grounding(summary, source), coverage(summary, source, names)
    if not g.passed:
        missing = f"; names not in it: {', '.join(g.missing_names)}" if g.missing_names else ""
        reasons.append(f"not grounded ({g.share:.2f} of its content words in the text{missing})")
    if not c.passed:
        reasons.append(f"names {len(c.named)} of the text's {c.required} most frequent names it must")
    return reasons


def summarize_part(
    engine: Engine,
    part: CompressedKVCache,
    prompt: str,
    max_new_tokens: int,
    sparse: bool = True,
    extractive: bool = False,
    source: str | None = None,
    names: tuple[str, ...] | None = None,
    cite: int = 0,
    below: Sequence[tuple[str, Spans]] | None = None,
    write_from: str = DEFAULT_WRITE_FROM,
    texts: PartTexts = (),
) -> Summary:
    """The summary of one stored part in the first mode of MODES whose output is not rejected
    (`rejection_reasons`; extraction is never rejected). write_from: "sentences" (the model writes
    from the part's key sentences: `summarize_text`) or "document" (from the stored part; a part
    without token ids, an old file, is always written from the document).

    prompt: the request (`summarize.txt` for a document or segment, `summarize_parts.txt` for the
    joined summaries). extractive: extract without asking the model. source: the text to extract
    from (default: `part_text`). cite: 0, or the passages cited by a model-written summary of the
    document (`Summary.citations`, module docstring; extracted summaries cite every sentence).
    below: None when `part` holds the document itself; else the summaries (text, traced pieces)
    whose "Part j of n: " joined text `part` was ingested from, and that `source` joins unlabelled;
    then the extracted summary is their outline (`outline`, with the document's parts' `texts`).
    Raises:
        InputError: extraction from a cache without token ids; `cite` for one without token offsets.
    """
    tokens = PartTokens(engine, part) if cite else None
    origin = None if below is None else joined_map(below, labeled=True)
    traced: SourceMap | None = None  # characters of the part's text to the document's passages
    if tokens is not None:
        traced = joined_map(below or (), labeled=False) if source is not None else tokens.source_map(origin)

    def own_text() -> str:
        return source if source is not None else tokens.text if tokens is not None else part_text(engine, part)

    def extract(rejected: tuple[str, ...] = ()) -> Summary:
        if below is not None and source is not None:  # the final summary: an outline of the parts'
            sentences, _, spans = outline(below, names, texts, tokens is not None)
            final = extracted_summary(sentences, prompt, rejected)
            return final if spans is None else with_citations(final, spans)
        text = own_text()
        sentences = extracted_sentences(text, names)
        summary = extracted_summary(sentences, prompt, rejected)
        return summary if traced is None else with_citations(summary, trace_sentences(sentences, text, traced))

    if extractive:
        return extract()
    try:
        text: str | None = own_text()
    except InputError:
        text = None  # an old file without token ids: only the degenerate rules can be applied
    if write_from == "sentences" and text is not None:
        return summarize_text(engine, text, prompt, max_new_tokens, names, traced)
    rejected: list[str] = []
    for mode, retry in (("abstractive", False), ("abstractive-retry", True)):
        written = _write(engine, part, prompt, max_new_tokens, sparse, retry, cite if origin is None else 0)
        reasons = rejection_reasons(written.text, text, names)
        if not reasons:
            fields = {f.name: getattr(written, f.name) for f in dataclasses.fields(written)}
            summary = Summary(**fields, mode=mode, rejected=tuple(rejected))
            if tokens is None:
                return summary
            if origin is None:  # written from the document: the passages its attention picked
                return with_citations(summary, tuple((0, len(summary.text), c) for c in summary.citations or ()),
                                      normalise=False)  # fmt: skip
            else:  # written from joined summaries: the passages of those its part holds
                cited = tuple((0, len(summary.text), dataclasses.replace(c, weight=w))
                              for c, w in origin(*tokens.whole()))  # fmt: skip
            return with_citations(summary, cited)
        rejected.append(f"{mode}: {', '.join(reasons)}")
    return extract(tuple(rejected))


@dataclass(frozen=True)
class PartialSummary:
    """Progress event of a hierarchical summary: the summary of segment `index` of `total` at
    `level`, made in `mode` (see `summaries.MODES`); `citations`: the passages of the document it
    came from, sorted by line (`Summary.citations`; None unless `summarize(cite=...)`)."""

    level: int
    index: int
    total: int
    text: str
    mode: str = "abstractive"
    citations: tuple[Citation, ...] | None = None


def condense(engine: Engine, partials: Sequence[tuple[str, Spans]], names: tuple[str, ...] | None,
             max_new_tokens: int, extractive: bool, cite: bool, texts: PartTexts = ()) -> Summary:  # fmt: skip
    """The final summary of a document from its parts' summaries (text, traced pieces), in order:
    their outline (`outline`: key sentences of each stretch of parts, covering `names`, the
    document's, from the parts' `texts` where the summaries cannot), written up by the model from
    those sentences (`summarize_text`) unless `extractive`; with `cite`, traced back through the
    parts' own citations (`joined_map`) or the parts' own maps.

    Raises:
        InputError: summaries without a sentence.
    """
    request = read_prompt("summarize_parts.txt")
    sentences, checked, spans = outline(partials, names, texts, cite)
    if not extractive:
        return summarize_text(engine, checked, request, max_new_tokens, names, sentences=sentences, spans=spans)
    final = extracted_summary(sentences, request)
    return final if spans is None else with_citations(final, spans)


def summarize(
    engine: Engine,
    stored: CompressedKVCache | SegmentedKVCache,
    cfg: PrefillConfig,
    max_new_tokens: int,
    sparse: bool = True,
    on_partial: Callable[[PartialSummary], None] = lambda event: None,
    prompt: str | None = None,
    level: int = 0,
    on_text: TextCallback | None = None,
    extractive: bool = False,
    source: str | None = None,
    names: tuple[str, ...] | None = None,
    cite: int = 0,
    below: Sequence[tuple[str, Spans]] | None = None,
    write_from: str = DEFAULT_WRITE_FROM,
    texts: PartTexts = (),
) -> Summary:
    """Summary of a stored document; hierarchical when it is segmented. Never a degenerate one.

    A one-segment cache is summarized in the framing chosen by docs/framings.md: a base model (plain
    framing) continues the document with `prompts/summarize_plain.txt`; a chat model is asked the
    summary prompt (`prompts/summarize.txt`, or `prompt`) as a question (stop strings
    `summaries.SUMMARY_STOP_STRINGS`). A rejected result (`rejection_reasons`) is asked for once
    more in another framing, then replaced by extracted sentences (`summaries.summarize_part`;
    `extractive`: extract at once, no model writing). A segmented one: each segment is summarized
    (reported through `on_partial`), the summaries are joined in order into a new text, which is
    ingested in memory with `cfg` and summarized with `summarize_parts.txt`, recursively while it is
    still longer than the context (`extractive`: the sentences are extracted from the joined
    summaries, with nothing ingested). `names`: the names the final summary must cover (default: the
    whole document's most frequent, `summary_check.document_names`). `source`: the text an
    extractive fallback picks from (default: the cache's own). `on_text` is given the final summary
    once it has passed the checks (one piece). `cite`: 0, or the number of passages a summary the
    model wrote from the document cites; every summary, each part's (`PartialSummary.citations`)
    and the final one (`Summary.citations`), then lists the passages of the document it came from
    (module docstring). `below`, `texts`: for the recursion (`summarize_part`; `texts`: the
    document's parts, read from `stored` at the top). An extracted final summary (`--extractive`,
    or the fallback) is an outline of the parts' summaries in order (`outline`). `write_from`: "document" as
    above; "sentences": extract, then write (module docstring) for every part, and the final
    summary is written from the outline of the parts' summaries (`outline`), with nothing
    ingested but those sentences (`summarize_text`).
    Returns the final summary (`Summary.mode` says how it was made).
    Raises:
        BudgetError: summaries that do not shrink (the recursion would never end).
        InputError: extraction from a cache without token ids; `cite` for a cache without token
        offsets (before anything is summarized; `citations.check_citable`). UsageError: a negative `cite`,
        an unknown `write_from`.
    """
    if below is None:
        check_cite(stored, cite)
        if write_from not in WRITE_FROM:
            raise UsageError(f"write_from must be one of {', '.join(WRITE_FROM)}, got {write_from!r}")
    if isinstance(stored, CompressedKVCache):
        final = summarize_part(engine, stored, prompt or read_prompt("summarize.txt"), max_new_tokens, sparse,
                               extractive, source, names, cite, below, write_from, texts)  # fmt: skip
        if on_text is not None:
            on_text(final.text)
        return final
    n = len(stored.segments)
    if below is None:  # the document's parts: the final summary covers their main names, not only the summaries'
        try:
            if cite:
                tokens = [PartTokens(engine, part) for part in stored.segments]
                texts = [(t.text, t.source_map(None)) for t in tokens]
            else:
                texts = [(part_text(engine, part), None) for part in stored.segments]
        except InputError:
            texts = ()  # an old file without token ids
        if names is None and texts:
            names = tuple(document_names("\n".join(text for text, _ in texts)))
    partials, traced = [], []
    for j, part in enumerate(stored.segments):
        written = summarize_part(engine, part, read_prompt("summarize.txt"), max_new_tokens, sparse, extractive,
                                 cite=cite, below=below, write_from=write_from)  # fmt: skip
        partials.append(written.text)
        traced.append((written.text, written.spans))
        on_partial(PartialSummary(level=level, index=j, total=n, text=written.text, mode=written.mode,
                                  citations=written.citations))  # fmt: skip
    if extractive or write_from == "sentences":  # the final summary from the parts' summaries' own sentences
        final = condense(engine, traced, names, max_new_tokens, extractive, bool(cite), texts)
        if on_text is not None:
            on_text(final.text)
        return final
    joined = "\n\n".join(f"Part {j + 1} of {n}: {text}" for j, text in enumerate(partials))
    combined = ingest_stream(engine, TextPieces(joined, f"summaries (level {level + 1})"), cfg)
    if isinstance(combined, SegmentedKVCache) and len(combined.segments) >= n:
        raise BudgetError(
            f"the summaries of {n} parts do not fit in fewer parts; the summary would never finish",
            "lower --max-new-tokens",
        )
    return summarize(engine, combined, cfg, max_new_tokens, sparse, on_partial, read_prompt("summarize_parts.txt"),
                     level + 1, on_text, source="\n\n".join(partials), names=names, cite=cite,
                     below=traced, write_from=write_from, texts=texts if level == 0 else ())  # fmt: skip


def text_map(text: str, start: int = 0, line: int = 1) -> SourceMap:
    """Characters [a, b) of `text`, a part of a document that starts at its character `start` on
    its line `line` (1-based), as the one passage they are (characters, lines, the text with its
    whitespace runs joined by single spaces), share 1."""

    def trace(a: int, b: int) -> list[tuple[Citation, float]]:
        if b <= a:
            return []
        first = line + text.count("\n", 0, a)
        last = first + text.count("\n", a, b - 1)
        passage = Citation(start=start + a, end=start + b, first_line=first, last_line=last, weight=1.0,
                           text=" ".join(text[a:b].split()))  # fmt: skip
        return [(passage, 1.0)]

    return trace


def summarize_document(
    engine: Engine,
    text: str,
    cfg: PrefillConfig,
    max_new_tokens: int,
    segment_tokens: int | None = None,
    on_partial: Callable[[PartialSummary], None] = lambda event: None,
    on_text: TextCallback | None = None,
    extractive: bool = False,
    cite: bool = False,
) -> Summary:
    """Summary of a document's `text` that is not stored (nothing of it is prefilled): extract,
    then write (`write_from` "sentences"), or extract only (`extractive`).

    The document is cut into the parts `ingest` would store (`segment_texts` at `segment_limit`
    of `cfg` and `segment_tokens`, less the framing); a one-part document is summarized as
    `summarize_text` does; a longer one part by part (`on_partial`), then the final summary from
    the outline of the parts' summaries (`condense`, `outline`), as `summarize` does for a segmented
    cache with `write_from` "sentences". `cite`: every summary lists the passages of `text` it came
    from (characters and 1-based lines of `text`; `text_map`). `on_text`: the final summary's text.
    Raises:
        InputError: a text without a word. BudgetError: `segment_tokens` beyond the context.
    """
    limit = segment_limit(engine, cfg, segment_tokens) - frame_tokens(engine) - SEGMENT_SLACK_TOKENS
    parts = list(segment_texts(engine.tokenizer, TextPieces(text, "document"), limit))
    if not any(part.strip() for part in parts):
        raise InputError("the document has no sentence to summarize (it holds no words)", "summarize a text document")

    def one(part: str, start: int, line: int, request: str, names: tuple[str, ...] | None) -> Summary:
        trace = text_map(part, start, line) if cite else None
        if not extractive:
            return summarize_text(engine, part, request, max_new_tokens, names, trace)
        sentences = extracted_sentences(part, names)
        summary = extracted_summary(sentences, request)
        return summary if trace is None else with_citations(summary, trace_sentences(sentences, part, trace))

    if len(parts) == 1:
        final = one(text, 0, 1, read_prompt("summarize.txt"), None)
    else:
        names = tuple(document_names(text))
        traced: list[tuple[str, Spans]] = []
        texts: list[tuple[str, SourceMap | None]] = []
        start, line = 0, 1
        for j, part in enumerate(parts):
            written = one(part, start, line, read_prompt("summarize.txt"), None)
            texts.append((part, text_map(part, start, line) if cite else None))
            start, line = start + len(part), line + part.count("\n")
            traced.append((written.text, written.spans))
            on_partial(PartialSummary(level=0, index=j, total=len(parts), text=written.text, mode=written.mode,
                                      citations=written.citations if cite else None))  # fmt: skip
        final = condense(engine, traced, names, max_new_tokens, extractive, cite, texts)
    if on_text is not None:
        on_text(final.text)
    return final
