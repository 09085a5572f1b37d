"""Summaries of a stored document, never a degenerate one; hierarchical over a segmented cache
(`summarize`: each segment, then the joined summaries, ingested in memory, recursively).

One summary of one stored part (`summarize_part`): the model writes it, is asked once more
in another framing when the result fails the summary check (`rejection_reasons`: degenerate,
not grounded in the part's text, or naming too few of its main names), and the part's most
central sentences are extracted when that fails too.

Modes (`Summary.mode`): "abstractive" (the first framing's text, unchanged), "abstractive-retry"
(`prompts/summarize_retry.txt` asked as a question in the cache's question framing: for the base
model, which is first asked to continue the document after "Summary:", this is the question
framing; for a chat model, a reworded request) and "extractive" (`summary_check.extract_sentences`
over the part's text, decoded from its stored token ids). `summarize` runs it for every
part and for the final condensation. No printing here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from ..core.cache import CompressedKVCache, SegmentedKVCache
from ..core.config import PrefillConfig
from ..engine.answer import Answer, Answerer, TextCallback, answer, decode_config_for
from ..engine.engine import Engine
from ..engine.inputs import Document, tokenize
from ..errors import BudgetError, InputError
from ..model.templates import read_prompt
from .documents import TextPieces
from .segments import ingest_stream
from .summary_check import coverage, degenerate_reasons, document_names, extract_sentences, grounding

SUMMARY_STOP_STRINGS = ("\n\n\n",)  # summaries are paragraphs: only a long gap ends one early
MODES = ("abstractive", "abstractive-retry", "extractive")
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


@cache
def prompt_texts() -> tuple[str, ...]:
    """The texts of every prompt a summary may echo (`PROMPT_FILES`)."""
    return tuple(read_prompt(name) for name in PROMPT_FILES)


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


def extracted(
    text: str, question: str, rejected: tuple[str, ...] = (), names: tuple[str, ...] | None = None
) -> Summary:
    """The extractive summary of `text`: its central sentences joined by spaces (the "Part j of
    n: " labels of joined summaries, `PART_LABEL`, are not part of any sentence), covering `names`
    (default: the text's own most frequent names; `summary_check.extract_sentences`).

    Raises:
        InputError: a text without a word (nothing the summary could be made of).
    """
    sentences = extract_sentences(PART_LABEL.sub("", text), names=names)
    if not sentences:
        raise InputError("the document has no sentence to extract a summary from (it holds no words)",
                         "summarize a text document")  # fmt: skip
    return Summary(question=question, text=" ".join(sentences), n_question_tokens=0, n_answer_tokens=0,
                   stop_reason=EXTRACTED_STOP_REASON, token_ids=(), prefill_s=0.0, decode_s=0.0, mode="extractive",
                   rejected=rejected)  # fmt: skip


def _write(engine: Engine, part: CompressedKVCache, prompt: str, max_new_tokens: int, sparse: bool,
           retry: bool) -> Answer:  # fmt: skip
    """The model's summary of `part` in the first framing (retry False) or the retry framing."""
    decode = decode_config_for(part, sparse)
    if retry:
        question = read_prompt("summarize_retry.txt")
        return next(answer(engine, part, [question], max_new_tokens, decode))  # the framing's own stop strings
    after = engine.prompt.summary_after
    if after is not None:
        ids = tokenize(engine.tokenizer, after, False)
        answerer = Answerer(engine, part, max_new_tokens, decode, engine.prompt.summary_stops,
                            question_tokens=len(ids))  # fmt: skip
        return answerer.ask(prompt, ids)
    stops = SUMMARY_STOP_STRINGS if engine.prompt.stop_strings else ()
    return next(answer(engine, part, [prompt], max_new_tokens, decode, stop_strings=stops))


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
) -> Summary:
    """The summary of one stored part in the first mode of MODES whose output is not rejected
    (`rejection_reasons`; extraction is never rejected).

    prompt: the request (`summarize.txt` for a document or segment, `summarize_parts.txt` for the
    joined summaries). extractive: extract without asking the model. source: the text to extract
    from (default: `part_text`).
    Raises:
        InputError: extraction from a cache without token ids.
    """
    if extractive:
        return extracted(source if source is not None else part_text(engine, part), prompt, names=names)
    try:
        text = source if source is not None else part_text(engine, part)
    except InputError:
        text = None  # an old file without token ids: only the degenerate rules can be applied
    rejected: list[str] = []
    for mode, retry in (("abstractive", False), ("abstractive-retry", True)):
        written = _write(engine, part, prompt, max_new_tokens, sparse, retry)
        reasons = rejection_reasons(written.text, text, names)
        if not reasons:
            fields = {f.name: getattr(written, f.name) for f in dataclasses.fields(written)}
            return Summary(**fields, mode=mode, rejected=tuple(rejected))
        rejected.append(f"{mode}: {', '.join(reasons)}")
    return extracted(source if source is not None else part_text(engine, part), prompt, tuple(rejected), names)


@dataclass(frozen=True)
class PartialSummary:
    """Progress event of a hierarchical summary: the summary of segment `index` of `total` at
    `level`, made in `mode` (see `summaries.MODES`)."""

    level: int
    index: int
    total: int
    text: str
    mode: str = "abstractive"


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
    once it has passed the checks (one piece).
    Returns the final summary (`Summary.mode` says how it was made).
    Raises:
        BudgetError: summaries that do not shrink (the recursion would never end).
        InputError: extraction from a cache without token ids.
    """
    if isinstance(stored, CompressedKVCache):
        final = summarize_part(engine, stored, prompt or read_prompt("summarize.txt"), max_new_tokens, sparse,
                               extractive, source, names)  # fmt: skip
        if on_text is not None:
            on_text(final.text)
        return final
    n = len(stored.segments)
    if names is None:  # the final summary covers the whole document's main names, not only the parts'
        try:
            names = tuple(document_names("\n".join(part_text(engine, part) for part in stored.segments)))
        except InputError:
            names = None  # an old file without token ids
    partials = []
    for j, part in enumerate(stored.segments):
        written = summarize_part(engine, part, read_prompt("summarize.txt"), max_new_tokens, sparse, extractive)
        partials.append(written.text)
        on_partial(PartialSummary(level=level, index=j, total=n, text=written.text, mode=written.mode))
    if extractive:
        final = extracted("\n\n".join(partials), read_prompt("summarize_parts.txt"), names=names)
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
                     level + 1, on_text, source="\n\n".join(partials), names=names)  # fmt: skip
