"""`rocketkv summarize`: a summary of a document or a saved cache (hierarchical when segmented)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Annotated, Any, Optional

import typer
from rich.cells import cell_len, set_cell_size

from ..errors import UsageError
from .answers import AnswerPrinter, StreamOpt, resolve_format, share, where
from .common import err, ingest, load_engine, log, open_stream, prefill_config, setup, spinners, spinning
from .options import (
    CacheOpt,
    DenseOpt,
    DeviceOpt,
    DtypeOpt,
    EncodingOpt,
    ErrorsOpt,
    JsonOpt,
    ModelOpt,
    NoServerOpt,
    QuietOpt,
    SegmentTokensOpt,
    ServerOpt,
    SummaryBudgetOpt,
    ThreadsOpt,
    TrustOpt,
    WeightsOpt,
    one_of,
    path_text,
)
from .remote import (
    check_server_flags,
    read_here_note,
    server_for,
    server_running,
    summarize_remote,
    unused_threads_note,
)
from .sources import ModelChoice, open_cache

LONG_DOCUMENT_BYTES = 1 << 20  # about 250K tokens of English: several segments, each prefilled in minutes on a CPU


def long_document_hint(document: str) -> None:
    """Before a long DOC is prefilled to be summarized from itself: say so, and name the modes that
    read its text without prefilling it (a stdin document's length is not known beforehand)."""
    import os

    if document != "-" and os.path.isfile(document) and (size := os.path.getsize(document)) > LONG_DOCUMENT_BYTES:
        log(f"{document} is {size / 1e6:.1f} MB: the model reads all of it before summarizing (minutes per "
            "32K tokens on a CPU); --extractive or --write-from sentences summarize it from its text "
            "without that, and `rocketkv ingest` once lets --cache summarize it again")  # fmt: skip


SummaryCiteOpt = Annotated[
    bool,
    typer.Option("--cite", help="After each part's summary and the final one, the source passages it came from "
                                "(lines, characters; sorted by line)."),
]  # fmt: skip


WriteFromOpt = Annotated[
    Optional[str],
    typer.Option("--write-from", callback=one_of("SUMMARY_WRITE_FROM"), metavar="sentences|document",
                 help="What the model writes each summary from: sentences (each part's most central sentences, "
                      "extracted first: a short context) or document (the stored part itself). Default: the "
                      "model's measured choice: the presets write nothing and extract (their own summaries "
                      "failed the summary check, docs/summaries.md); other models write from the document."),
]  # fmt: skip
SummaryPassagesOpt = Annotated[
    int,
    typer.Option("--passages", min=1, metavar="N",
                 help="Passages cited by --cite for a summary the model wrote from the document (extracted "
                      "sentences cite each sentence's lines)."),
]  # fmt: skip


def summarize_command(
    ctx: typer.Context,
    document: Annotated[
        Optional[str],
        typer.Argument(metavar="[DOC]", parser=path_text, help="Text file, or - for stdin (or use --cache)."),
    ] = None,
    cache: CacheOpt = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Summary length limit in tokens.")] = 256,
    budget: SummaryBudgetOpt = 512,
    dense: DenseOpt = False,
    stream: StreamOpt = None,
    segment_tokens: SegmentTokensOpt = None,
    encoding: EncodingOpt = "utf-8",
    errors: ErrorsOpt = "strict",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    trust_remote_code: TrustOpt = False,
    extractive: Annotated[
        bool, typer.Option("--extractive", help="Extract the most central sentences; the model writes nothing.")
    ] = False,
    write_from: WriteFromOpt = None,
    cite: SummaryCiteOpt = False,
    passages: SummaryPassagesOpt = 3,
    threads: ThreadsOpt = None,
    server: ServerOpt = None,
    no_server: NoServerOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document (or a saved cache's document).

    The built-in presets extract each summary's most central sentences by default (their own
    summaries failed the summary check on every document measured: docs/summaries.md); a DOC is
    then read from its text, not prefilled. --write-from has the model write.

    A document longer than the context is summarized segment by segment (each partial summary is
    shown on stderr), then the summaries are summarized as one text. A summary that fails the
    summary check (degenerate: an echo of the prompt, a repeated sentence, under 15 words, a bare
    reference; or not grounded in the text, or naming too few of its main names) is asked for once
    more in another framing, then replaced by the part's most central sentences, extracted verbatim;
    --json's `mode` says which ("written" or "written-retry": the model wrote from the key
    sentences; "abstractive" or "abstractive-retry": from the stored part; "extractive") and
    `rejected` why each output was rejected. --cite lists the source passages (line ranges) each summary came
    from (docs/summaries.md, "Citations"). With --cache, a running `rocketkv serve` summarizes.
    """
    check_server_flags(server, no_server)
    setup(quiet, threads)
    if (document is None) == (cache is None):
        raise UsageError("give either DOC or --cache FILE.kv", "e.g. rocketkv summarize book.txt")
    given = frozenset(n for n in ctx.params if getattr(ctx.get_parameter_source(n), "name", "") == "COMMANDLINE")
    for name, flag in (("encoding", "--encoding"), ("errors", "--errors"), ("segment_tokens", "--segment-tokens")):
        if cache is not None and name in given:
            log(f"{flag} applies to a DOC read here; {cache} holds the document as it was ingested")
    if extractive and write_from:
        raise UsageError("--extractive and --write-from contradict each other (with --extractive the model "
                         "writes nothing)", "give one of them")  # fmt: skip
    fmt, stream = resolve_format("auto", json_out, stream, 1, cite)
    n_cite = passages if cite else 0
    cfg = prefill_config(token_budget=budget, max_new_tokens=max_new_tokens)
    choice = ModelChoice(model, device, dtype, weights, trust_remote_code)
    remote = server_for(server, no_server) if cache is not None else None
    server_hint = document is not None and not no_server and server_running(server)  # said once summarized
    partials: list[dict] = []
    on_partial = partial_logger(partials, cite)
    final: Any  # a `Summary` here, its fields from a server
    if remote is not None and cache is not None:  # a server only with --cache; it applies the model's default
        source, t0 = str(cache), time.perf_counter()
        final = summarize_remote(remote, cache, {"max_new_tokens": max_new_tokens, "token_budget": budget,
                                                 "dense": dense, "extractive": extractive, "cite": n_cite,
                                                 **({"write_from": write_from} if write_from else {}),
                                                 **choice.for_server()},
                                 on_partial)  # fmt: skip
        unused_threads_note(remote, threads)
    else:
        from ..core.config import summary_writing

        if document is not None:
            pieces = open_stream(document, encoding, errors, "summarize")  # a bad document fails before the model loads
            rk = load_engine(choice.model, choice.device, choice.dtype or "auto", trust_remote_code, weights)
            writing, source = summary_writing(rk.model_id, extractive, write_from), document
            if writing != "document":  # nothing to prefill: extract, or extract then write
                from ..api.summaries import summarize_document

                t0 = time.perf_counter()
                final = summarize_document(rk.engine, "".join(pieces), cfg, max_new_tokens, segment_tokens,
                                           on_partial, extractive=writing is None, cite=cite)  # fmt: skip
                printer = AnswerPrinter(fmt, stream)
                print_summary(final, source, time.perf_counter() - t0, partials, extractive, printer, given)
                return  # from the text alone (seconds): a server, which answers from caches, would not be faster
            long_document_hint(document)
            stored = ingest(rk, pieces, cfg, segment_tokens=segment_tokens,
                            explicit=("token_budget", "max_new_tokens")).cache  # fmt: skip
        else:
            assert cache is not None  # checked above: exactly one of DOC and --cache
            # refused before loading
            (rk, stored), source = open_cache(cache, choice, cite=n_cite, command="summarize"), str(cache)
            from ..api.summaries import extractable

            writing = summary_writing(rk.model_id, extractive, write_from, extractable(stored))
        from ..api.summaries import summarize  # torch: only once the model is loaded

        t0 = time.perf_counter()
        with spinning("summarizing"):  # a model writing a summary takes seconds with nothing else shown
            final = summarize(rk.engine, stored, cfg, max_new_tokens, not dense, on_partial,
                              extractive=writing is None, cite=n_cite,
                              write_from=writing or "document")  # as `rk.summarize`  # fmt: skip
    print_summary(final, source, time.perf_counter() - t0, partials, extractive, AnswerPrinter(fmt, stream), given)
    if server_hint:
        log(read_here_note("summarize", str(document)))


def partial_logger(partials: list[dict], cite: bool = False) -> Callable[[Any], None]:
    """`on_partial` for `RocketKV.summarize`: each partial summary logged on stderr (with its
    "Sources:" when `cite`; on a terminal, of a document of several parts, cut to one line) and
    kept in `partials` (for the `--json` record, with `citations`)."""

    def on_partial(event) -> None:
        record = {"level": event.level, "segment": event.index, "summary": event.text, "mode": event.mode}
        citations = citations_of(event) if cite else None
        if citations is not None:
            record["citations"] = [citation_record(c) for c in citations]
        partials.append(record)
        note = "" if event.mode in ("abstractive", "written") else f" [{event.mode}]"
        line = f"summary of part {event.index + 1}/{event.total} (level {event.level}){note}: {event.text}"
        if spinners() and event.total > 1:  # a book's 37 parts were 150 wrapped lines before its summary
            line, width = " ".join(line.split()), max(40, err.width - len("rocketkv: "))
            line = line if cell_len(line) <= width else set_cell_size(line, width - 1) + "…"  # whole in --json, a log
        log(line)
        if citations is not None:
            log(sources_text(citations).rstrip("\n"))

    return on_partial


def citations_of(summary) -> list | None:
    """The citations of a summary or partial-summary event: `Citation`s in this process, records
    (dicts) from a server (as objects with the same fields); None when it has none."""
    found = getattr(summary, "citations", None)
    if found is None:
        return None
    return [SimpleNamespace(**c) if isinstance(c, dict) else c for c in found]


def citation_record(c) -> dict:
    """The `--json` record of a citation (`Citation.to_dict`'s keys: line numbers 1-based,
    characters [start, end) of the source, weight 0–1 rounded to 4 places)."""
    return {"start": c.start, "end": c.end, "line": c.first_line, "end_line": c.last_line,
            "weight": round(c.weight, 4), "text": c.text}  # fmt: skip


def sources_text(citations) -> str:
    """Citations as `ask --cite` prints them under an answer ("Sources:" and one row each)."""
    rows = [f"  [{i}] {where(c)} ({share(c.weight)}): {' '.join(c.text.split())}\n" for i, c in enumerate(citations, 1)]
    return "Sources:\n" + "".join(rows) if rows else "Sources: none\n"


def print_summary(final, source: str, elapsed: float, partials: list[dict], extractive: bool,
                  printer: AnswerPrinter, given: frozenset[str] = frozenset()) -> None:  # fmt: skip
    """The summary on stdout (whole: shown only once it has passed the checks; `--json`: its
    record), why the model's outputs were rejected and how long it took on stderr. `given`: the
    options given on the command line (a note when --max-new-tokens could not apply)."""
    mode = getattr(final, "mode", "abstractive")
    row = {"summary": final.text, "source": source, "n_answer_tokens": final.n_answer_tokens,
           "stop_reason": final.stop_reason, "summarize_s": round(elapsed, 3), "mode": mode,
           "rejected": list(getattr(final, "rejected", ()))}  # fmt: skip
    citations = citations_of(final)
    if citations is not None:
        row["citations"] = [citation_record(c) for c in citations]
    if partials:
        row["partial_summaries"] = partials
    for reason in getattr(final, "rejected", ()):
        log(f"summary: the model's output was rejected ({reason})")
    if mode == "extractive":
        why = ("--extractive" if extractive else "the model's output was rejected" if getattr(final, "rejected", ())
               else "this model's measured default, docs/summaries.md; for a summary the model writes: "
                    "--write-from document")  # fmt: skip
        log(f"summary: extracted sentences ({why})")
        if "max_new_tokens" in given:
            log("summary: --max-new-tokens limits what the model writes; extracted sentences are not limited by it")
    printer.piece(final.text)
    printer.finish(final.text, row, citations)
    if mode == "extractive":  # nothing decoded: no tokens or stop reason to tell
        n = len(citations) if citations is not None else None
        log(f"summarized in {elapsed:.1f}s" + (f" ({n} sentence{'s' * (n != 1)} extracted)" if n else ""))
    else:
        log(f"summarized in {elapsed:.1f}s ({final.n_answer_tokens} tokens, stop: {final.stop_reason})")
