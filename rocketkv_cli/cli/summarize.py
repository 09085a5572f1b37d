"""`rocketkv summarize`: a summary of a document or a saved cache (hierarchical when segmented)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from ..errors import UsageError
from .answers import AnswerPrinter, StreamOpt, resolve_format
from .common import log, prefill_config, setup
from .options import (
    BudgetOpt,
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
    ThreadsOpt,
    TrustOpt,
    WeightsOpt,
)
from .remote import server_for, summarize_remote
from .sources import DocumentReading, ModelChoice, ingest_in_memory, open_cache


def summarize_command(
    document: Annotated[
        Optional[str], typer.Argument(metavar="[DOC]", help="Text file, or - for stdin (or use --cache).")
    ] = None,
    cache: CacheOpt = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Summary length limit in tokens.")] = 256,
    budget: BudgetOpt = 512,
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
    threads: ThreadsOpt = None,
    server: ServerOpt = None,
    no_server: NoServerOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document (or a saved cache's document).

    A document longer than the context is summarized segment by segment (each partial summary is
    shown on stderr), then the summaries are summarized as one text. A summary that fails the
    summary check (degenerate: an echo of the prompt, a repeated sentence, under 15 words, a bare
    reference; or not grounded in the text, or naming too few of its main names) is asked for once
    more in another framing, then replaced by the part's most central sentences, extracted verbatim;
    --json's `mode` says which ("abstractive", "abstractive-retry", "extractive") and `rejected`
    why each output was rejected. With --cache, a running `rocketkv serve` summarizes.
    """
    setup(quiet, threads)
    if (document is None) == (cache is None):
        raise UsageError("give either DOC or --cache FILE.kv", "e.g. rocketkv summarize book.txt")
    fmt, stream = resolve_format("auto", json_out, stream, 1)
    cfg = prefill_config(token_budget=budget, max_new_tokens=max_new_tokens)
    choice = ModelChoice(model, device, dtype, weights, trust_remote_code)
    remote = server_for(server, no_server) if cache is not None else None
    partials: list[dict] = []
    on_partial = partial_logger(partials)
    if remote is not None and cache is not None:  # a server only with --cache
        source, t0 = str(cache), time.perf_counter()
        final = summarize_remote(remote, cache, {"max_new_tokens": max_new_tokens, "token_budget": budget,
                                                 "dense": dense, "extractive": extractive, **choice.for_server()},
                                 on_partial)  # fmt: skip
    else:
        if cache is not None:
            (rk, stored), source = open_cache(cache, choice), str(cache)
        else:
            assert document is not None  # checked above: exactly one of DOC and --cache
            reading = DocumentReading(encoding, errors, segment_tokens)
            (rk, stored), source = ingest_in_memory(document, choice, cfg, reading), document
        t0 = time.perf_counter()
        final = rk.summarize(stored, max_new_tokens=max_new_tokens, dense=dense, config=cfg, on_partial=on_partial,
                             extractive=extractive)  # fmt: skip
    print_summary(final, source, time.perf_counter() - t0, partials, extractive, AnswerPrinter(fmt, stream))


def partial_logger(partials: list[dict]) -> Callable[[Any], None]:
    """`on_partial` for `RocketKV.summarize`: each partial summary logged on stderr and kept in
    `partials` (for the `--json` record)."""

    def on_partial(event) -> None:
        partials.append({"level": event.level, "segment": event.index, "summary": event.text, "mode": event.mode})
        note = "" if event.mode == "abstractive" else f" [{event.mode}]"
        log(f"summary of part {event.index + 1}/{event.total} (level {event.level}){note}: {event.text}")

    return on_partial


def print_summary(final, source: str, elapsed: float, partials: list[dict], extractive: bool,
                  printer: AnswerPrinter) -> None:  # fmt: skip
    """The summary on stdout (whole: shown only once it has passed the checks; `--json`: its
    record), why the model's outputs were rejected and how long it took on stderr."""
    mode = getattr(final, "mode", "abstractive")
    row = {"summary": final.text, "source": source, "n_answer_tokens": final.n_answer_tokens,
           "stop_reason": final.stop_reason, "summarize_s": round(elapsed, 3), "mode": mode,
           "rejected": list(getattr(final, "rejected", ()))}  # fmt: skip
    if partials:
        row["partial_summaries"] = partials
    for reason in getattr(final, "rejected", ()):
        log(f"summary: the model's output was rejected ({reason})")
    if mode == "extractive":
        why = "--extractive" if extractive else "the model's output was rejected"
        log(f"summary: extracted sentences ({why})")
    printer.piece(final.text)
    printer.finish(final.text, row)
    log(f"summarized in {elapsed:.1f}s ({final.n_answer_tokens} tokens, stop: {final.stop_reason})")
