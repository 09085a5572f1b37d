"""One summary of one stored part, never a degenerate one: the model writes it, is asked once more
in another framing when the result is degenerate (`summary_check.degenerate_reasons`), and the
part's most central sentences are extracted when that is degenerate too.

Modes (`Summary.mode`): "abstractive" (the first framing's text, unchanged), "abstractive-retry"
(`prompts/summarize_retry.txt` asked as a question in the cache's question framing: for the base
model, which is first asked to continue the document after "Summary:", this is the question
framing; for a chat model, a reworded request) and "extractive" (`summary_check.extract_sentences`
over the part's text, decoded from its stored token ids). `segments.summarize` runs it for every
part and for the final condensation. No printing here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cache

from ..core.cache import CompressedKVCache
from ..engine.answer import Answer, Answerer, answer, decode_config_for
from ..engine.documents import Document, tokenize
from ..engine.engine import Engine
from ..errors import InputError
from ..model.templates import read_prompt
from .summary_check import degenerate_reasons, extract_sentences

SUMMARY_STOP_STRINGS = ("\n\n\n",)  # summaries are paragraphs: only a long gap ends one early
MODES = ("abstractive", "abstractive-retry", "extractive")
PROMPT_FILES = ("summarize.txt", "summarize_parts.txt", "summarize_plain.txt", "summarize_retry.txt",
                "plain.txt", "chat.txt")  # fmt: skip
EXTRACTED_STOP_REASON = "extracted"
PART_LABEL = re.compile(r"(?m)^Part \d+ of \d+: ")  # how `segments.summarize` labels the joined summaries


@dataclass(frozen=True)
class Summary(Answer):
    """An `Answer` that says how it was made: `mode` (one of MODES) and `rejected` (the reasons
    each rejected model output was degenerate, in order). An extracted summary has no answer
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


def extracted(text: str, question: str, rejected: tuple[str, ...] = ()) -> Summary:
    """The extractive summary of `text`: its central sentences joined by spaces (the "Part j of
    n: " labels of joined summaries, `PART_LABEL`, are not part of any sentence).

    Raises:
        InputError: a text without a word (nothing the summary could be made of).
    """
    sentences = extract_sentences(PART_LABEL.sub("", text))
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


def summarize_part(
    engine: Engine,
    part: CompressedKVCache,
    prompt: str,
    max_new_tokens: int,
    sparse: bool = True,
    extractive: bool = False,
    source: str | None = None,
) -> Summary:
    """The summary of one stored part in the first mode of MODES that is not degenerate.

    prompt: the request (`summarize.txt` for a document or segment, `summarize_parts.txt` for the
    joined summaries). extractive: extract without asking the model. source: the text to extract
    from (default: `part_text`).
    Raises:
        InputError: extraction from a cache without token ids.
    """
    if extractive:
        return extracted(source if source is not None else part_text(engine, part), prompt)
    rejected: list[str] = []
    for mode, retry in (("abstractive", False), ("abstractive-retry", True)):
        written = _write(engine, part, prompt, max_new_tokens, sparse, retry)
        reasons = degenerate_reasons(written.text, prompt_texts())
        if not reasons:
            fields = {f.name: getattr(written, f.name) for f in dataclasses.fields(written)}
            return Summary(**fields, mode=mode, rejected=tuple(rejected))
        rejected.append(f"{mode}: {', '.join(reasons)}")
    return extracted(source if source is not None else part_text(engine, part), prompt, tuple(rejected))
