"""`rocketkv summarize`: a summary of a document or a saved cache (hierarchical when segmented)."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from .answers import AnswerPrinter, StreamOpt, resolve_format
from .ask import open_cache
from .common import ingest, load_engine, log, open_stream, prefill_config, setup
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
    shown on stderr), then the summaries are summarized as one text. A degenerate summary (an echo
    of the prompt, a repeated sentence, under 15 words, a bare reference) is asked for once more
    in another framing, then replaced by the part's most central sentences, extracted verbatim;
    --json's `mode` says which ("abstractive", "abstractive-retry", "extractive") and `rejected`
    why each rejected output was degenerate. With --cache, a running `rocketkv serve` summarizes.
    """
    setup(quiet, threads)
    if (document is None) == (cache is None):
        raise UsageError("give either DOC or --cache FILE.kv", "e.g. rocketkv summarize book.txt")
    fmt, stream = resolve_format("auto", json_out, stream, 1)
    cfg = prefill_config(token_budget=budget, max_new_tokens=max_new_tokens)
    remote = server_for(server, no_server) if cache is not None else None
    if remote is not None:
        rk = stored = None
        source = str(cache)
    elif cache is not None:
        rk, stored = open_cache(cache, model, device, dtype, trust_remote_code, weights)
        source = str(cache)
    else:
        assert document is not None  # checked above: exactly one of DOC and --cache
        document_stream = open_stream(document, encoding, errors)
        rk = load_engine(model, device, dtype or "auto", trust_remote_code, weights)
        stored = ingest(rk, document_stream, cfg, segment_tokens=segment_tokens).cache
        source = document
    partials = []

    def on_partial(event) -> None:
        partials.append({"level": event.level, "segment": event.index, "summary": event.text, "mode": event.mode})
        note = "" if event.mode == "abstractive" else f" [{event.mode}]"
        log(f"summary of part {event.index + 1}/{event.total} (level {event.level}){note}: {event.text}")

    printer = AnswerPrinter(fmt, stream)
    t0 = time.perf_counter()
    if remote is not None:
        assert cache is not None  # a server only with --cache
        final = summarize_remote(remote, cache, {"max_new_tokens": max_new_tokens, "token_budget": budget,
                                                 "dense": dense, "extractive": extractive, "model": model,
                                                 "device": device, "dtype": dtype, "weights": weights,
                                                 "trust_remote_code": trust_remote_code}, on_partial)  # fmt: skip
    else:
        assert rk is not None  # loaded above when no server answers
        final = rk.summarize(stored, max_new_tokens=max_new_tokens, dense=dense, config=cfg, on_partial=on_partial,
                             extractive=extractive)  # fmt: skip
    elapsed = time.perf_counter() - t0
    mode = getattr(final, "mode", "abstractive")
    row = {"summary": final.text, "source": source, "n_answer_tokens": final.n_answer_tokens,
           "stop_reason": final.stop_reason, "summarize_s": round(elapsed, 3), "mode": mode,
           "rejected": list(getattr(final, "rejected", ()))}  # fmt: skip
    if partials:
        row["partial_summaries"] = partials
    for reason in getattr(final, "rejected", ()):
        log(f"summary: the model's output was degenerate ({reason})")
    if mode == "extractive":
        why = "--extractive" if extractive else "the model's output was degenerate"
        log(f"summary: extracted sentences ({why})")
    printer.piece(final.text)  # whole: a summary is shown only once it has passed the checks
    printer.finish(final.text, row)
    log(f"summarized in {elapsed:.1f}s ({final.n_answer_tokens} tokens, stop: {final.stop_reason})")
