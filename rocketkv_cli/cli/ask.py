"""`rocketkv ask`: answer questions from a saved cache, or from a document ingested in memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import InputError
from .common import (
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    EncodingOpt,
    ErrorsOpt,
    JsonOpt,
    ModelOpt,
    PageSizeOpt,
    QuietOpt,
    ScoreDimsOpt,
    SegmentOpt,
    SegmentsOpt,
    SegmentTokensOpt,
    Timings,
    TopkOpt,
    TrustOpt,
    WeightsOpt,
    ingest,
    load_engine,
    log,
    open_stream,
    prefill_config,
    setup,
)  # fmt: skip

DenseOpt = Annotated[bool, typer.Option("--dense", help="Exact attention over the stored cache (no stage-2 sparsity).")]
MaxNewOpt = Annotated[
    Optional[int], typer.Option(min=1, help="Answer length limit in tokens (default: the cache's plan).")
]


def read_questions(positional: list[str], questions_file: Optional[str], doc_is_stdin: bool) -> list[str]:
    """Questions from arguments and a file (`-` = stdin), one per line. Raises InputError."""
    questions = list(positional)
    if questions_file is not None:
        if questions_file == "-":
            if doc_is_stdin:
                raise InputError("the document and the questions cannot both come from stdin")
            text = sys.stdin.buffer.read().decode("utf-8-sig", errors="replace")
        else:
            try:
                text = Path(questions_file).read_text(encoding="utf-8-sig")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"cannot read questions file {questions_file}: {exc}") from None
        questions += [line.strip() for line in text.split("\n") if line.strip()]  # only \n ends a question
    if any(not q.strip() for q in questions):
        raise InputError("empty question", "give each question some text")
    for q in questions:
        try:
            q.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError("a question is not valid UTF-8 text", "check the question's encoding") from None
    if not questions:
        raise InputError("no question given", "pass questions as arguments or with --questions-file")
    return questions


def open_cache(cache: Path, model: Optional[str], device: str, dtype: Optional[str], trust_remote_code: bool,
               weights: Optional[str] = None, timings: Timings | None = None):  # fmt: skip
    """Validate the file, load the model it was built with (or `model`), check they match."""
    from ..engine.api import read_cache

    timings = timings or Timings()
    with timings.span("cache read + verify"):
        stored = read_cache(cache)
    ident = stored.info.identity
    with timings.span("model load"):
        rk = load_engine(model or ident.model_id, device, dtype or stored.info.dtype, trust_remote_code,
                         weights or stored.info.weights)  # fmt: skip
    with timings.span("model identity check"):
        rk.check(stored, str(cache))
    return rk, stored


def print_answers(answers, n_questions: int, source: str, json_out: bool, timings: Timings | None = None) -> None:
    """Each answer on stdout as it is made (`--json`: one object per line), a timing line on stderr."""
    for i, ans in enumerate(answers):
        if timings is not None:
            per = (
                f" ({1e3 * ans.decode_s / max(1, ans.n_answer_tokens - 1):.0f} ms/token)"
                if ans.n_answer_tokens > 1
                else ""
            )
            timings.add(f"question {i + 1} prefill", ans.prefill_s)
            timings.add(f"decode {ans.n_answer_tokens} tokens{per}", ans.decode_s)
        if json_out:
            typer.echo(json.dumps(ans.to_dict(cache=source), ensure_ascii=False))
        else:
            if n_questions > 1 and i:
                typer.echo("")
            typer.echo(ans.text)
        sys.stdout.flush()
        log(f"answered in {ans.prefill_s + ans.decode_s:.2f}s ({ans.n_answer_tokens} tokens, stop: {ans.stop_reason})")


def ask_command(
    args: Annotated[Optional[list[str]], typer.Argument(help="QUESTION... with --cache; else DOC QUESTION...")] = None,
    cache: CacheOpt = None,
    questions_file: Annotated[
        Optional[str], typer.Option(help="File with one question per line, or - for stdin.")
    ] = None,
    max_new_tokens: MaxNewOpt = None,
    budget: Annotated[
        int, typer.Option("--budget", "-b", help="Token budget when DOC is ingested in memory (a cache keeps its own).")
    ] = 512,
    dense: DenseOpt = False,
    hsa: Annotated[bool, typer.Option("--hsa", help="Stage-2 HSA even where exact attention is faster here.")] = False,
    topk: TopkOpt = None,
    page_size: PageSizeOpt = None,
    n_score_dims: ScoreDimsOpt = None,
    segments: SegmentsOpt = 1,
    segment: SegmentOpt = None,
    segment_tokens: SegmentTokensOpt = None,
    encoding: EncodingOpt = "utf-8",
    errors: ErrorsOpt = "strict",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show a timing breakdown on stderr.")] = False,
) -> None:
    """Answer questions from a saved cache (or from DOC, ingested in memory first)."""
    from ..engine.api import DEFAULT_MODEL

    timings = Timings()
    setup(quiet)
    args = list(args or [])
    if cache is not None:
        questions = read_questions(args, questions_file, False)
        rk, stored = open_cache(cache, model, device, dtype, trust_remote_code, weights, timings)
        source = str(cache)
    else:
        if not args:
            raise InputError(
                "no document or cache given", "use: rocketkv ask --cache FILE.kv QUESTION, or ask DOC QUESTION"
            )
        doc, rest = args[0], args[1:]
        questions = read_questions(rest, questions_file, doc == "-")
        cfg = prefill_config(token_budget=budget, max_new_tokens=max_new_tokens or 128, pool_kernel_size="63")
        stream = open_stream(doc, encoding, errors)
        rk = load_engine(model or DEFAULT_MODEL, device, dtype or "auto", trust_remote_code, weights)
        stored = ingest(rk, stream, cfg, segment_tokens=segment_tokens).cache
        source = doc
    answers = rk.ask(stored, questions, max_new_tokens=max_new_tokens, dense=dense, hsa=hsa, topk=topk,
                     page_size=page_size, n_score_dims=n_score_dims, segments=segments, segment=segment,
                     log=log)  # fmt: skip
    print_answers(answers, len(questions), source, json_out, timings)
    if verbose:
        log(timings.summary())
