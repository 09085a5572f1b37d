"""`rocketkv ask`: answer questions from a saved cache, or from a document ingested in memory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..core.config import DEFAULT_TOKEN_BUDGET
from ..errors import InputError, UsageError
from ..serve.client import MAX_QUESTIONS
from .answers import (
    AnswerPrinter,
    CiteOpt,
    FormatOpt,
    PassagesOpt,
    SeedOpt,
    StreamOpt,
    TemperatureOpt,
    TopPOpt,
    answer_log,
    check_question_text,
    resolve_format,
    sampling_note,
    usage_error,
)
from .common import (
    Timings,
    cache_budget_note,
    ingest,
    load_engine,
    log,
    open_stream,
    prefill_config,
    setup,
    starting,
    threads_note,
)
from .options import (
    CacheOpt,
    DenseOpt,
    DeviceOpt,
    DocBudgetOpt,
    DtypeOpt,
    EncodingOpt,
    ErrorsOpt,
    HsaOpt,
    JsonOpt,
    MaxNewOpt,
    ModelOpt,
    NoServerOpt,
    PageSizeOpt,
    QuietOpt,
    ScoreDimsOpt,
    SegmentOpt,
    SegmentsOpt,
    SegmentTokensOpt,
    ServerOpt,
    ThreadsOpt,
    TopkOpt,
    TrustOpt,
    WeightsOpt,
)
from .remote import ask_remote, server_for


def read_questions(positional: list[str], questions_file: Optional[str], doc_is_stdin: bool) -> list[str]:
    """Questions from arguments and a file (`-` = stdin), one per line; may be empty. Raises InputError."""
    questions = list(positional)
    if questions_file is not None:
        if questions_file == "-":
            if doc_is_stdin:
                raise UsageError("the document and the questions cannot both come from stdin")
            try:
                text = sys.stdin.buffer.read().decode("utf-8-sig")
            except UnicodeDecodeError as exc:  # as a questions file given by path is refused
                raise InputError(f"cannot read questions from stdin: {exc}") from None
        else:
            try:
                text = Path(questions_file).read_text(encoding="utf-8-sig")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"cannot read questions file {questions_file}: {exc}") from None
        questions += [line.strip() for line in text.split("\n") if line.strip()]  # only \n ends a question
    if any(not q.strip() for q in questions):
        raise InputError("empty question", "give each question some text")
    for q in questions:
        check_question_text(q)
    return questions


def open_cache(cache: Path, model: Optional[str], device: str, dtype: Optional[str], trust_remote_code: bool,
               weights: Optional[str] = None, timings: Timings | None = None, cite: int = 0,
               segments: int = 1, decode_options: dict | None = None):  # fmt: skip
    """Validate the file (and that it can give `cite` citations, and that `decode_options`, the
    stage-2 overrides, suit its budgets), load the model it was built with (or `model`), check
    they match."""
    from ..engine.preflight import check_cache_file

    check_cache_file(cache)  # a missing or unreadable path fails before torch is imported
    timings = timings or Timings()
    with timings.span("imports (torch, transformers)"), starting():
        from ..api.rocketkv import check_cite, check_decode_options, check_model_choice, decode_weights_for, read_cache

    with timings.span("cache read + verify"):
        stored = read_cache(cache)
    check_model_choice(stored, model, cache)
    check_cite(stored, cite, segments)
    check_decode_options(stored, **(decode_options or {}))
    ident = stored.info.identity
    with timings.span("model load"):
        rk = load_engine(model or ident.model_id, device, dtype or stored.info.dtype, trust_remote_code,
                         weights or decode_weights_for(stored))  # fmt: skip
    with timings.span("model identity check"):
        rk.check(stored, str(cache))
    return rk, stored


def print_answers(answers, questions: list[str], source: str, printer: AnswerPrinter,
                  timings: Timings | None = None) -> None:  # fmt: skip
    """Each answer on stdout as it is made (streamed when the printer streams), a line on stderr.

    `answers` is lazy: question i is answered when its `Answer` is taken, so its header is
    printed first and its pieces arrive through the printer (see `RocketKV.ask(on_text=...)`)."""
    it = iter(answers)
    for i, question in enumerate(questions):
        printer.start(question)
        ans = next(it)
        if timings is not None:
            per = f" ({1e3 * ans.decode_s / (ans.n_answer_tokens - 1):.0f} ms/token)" if ans.n_answer_tokens > 1 else ""
            timings.add(f"question {i + 1} prefill", ans.prefill_s)
            timings.add(f"decode {ans.n_answer_tokens} tokens{per}", ans.decode_s)
        printer.finish(ans.text, ans.to_dict(cache=source), ans.citations)
        log(answer_log(ans))


def ask_command(
    args: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="[DOC] QUESTION...",
            show_default=False,
            help="The questions (with --cache), or a document then the questions.",
        ),
    ] = None,
    cache: CacheOpt = None,
    questions_file: Annotated[
        Optional[str], typer.Option(metavar="FILE", help="File with one question per line, or - for stdin.")
    ] = None,
    max_new_tokens: MaxNewOpt = None,
    budget: DocBudgetOpt = None,
    dense: DenseOpt = False,
    fmt: FormatOpt = "auto",
    stream: StreamOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    cite: CiteOpt = False,
    passages: PassagesOpt = 3,
    hsa: HsaOpt = False,
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
    threads: ThreadsOpt = None,
    server: ServerOpt = None,
    no_server: NoServerOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show a timing breakdown on stderr.")] = False,
) -> None:
    """Answer questions from a saved cache (or from DOC, ingested in memory first).

    Each question is answered on its own. On a terminal the answers are printed as they are
    decoded; several questions are shown as Q:/A: records (see --format). With --cache, a running
    `rocketkv serve` answers (the model and cache stay loaded there); --no-server answers here.
    """
    args = list(args or [])  # usage errors first: before the engine (torch) is imported
    if cache is None and not args:
        raise usage_error("QUESTION...", "missing: give --cache FILE.kv QUESTION..., or DOC QUESTION...")
    doc, rest = (None, args) if cache is not None else (args[0], args[1:])
    questions = read_questions(rest, questions_file, doc == "-")
    if not questions and questions_file is not None:  # given, but it holds no question
        where = "stdin" if questions_file == "-" else questions_file
        raise InputError(f"no questions in {where}", "write one question per line")
    if not questions:
        raise usage_error("QUESTION...", "missing: pass questions as arguments or with --questions-file")
    fmt, stream = resolve_format(fmt, json_out, stream, len(questions), cite)
    if dense and hsa:  # before the model loads (the API checks it too)
        raise usage_error("--hsa", "--dense and --hsa contradict each other: give one of them")
    timings = Timings()
    setup(quiet, threads)
    if note := sampling_note(temperature, seed):
        log(note)
    options = {"max_new_tokens": max_new_tokens, "dense": dense, "hsa": hsa, "topk": topk, "page_size": page_size,
               "n_score_dims": n_score_dims, "segments": segments, "segment": segment, "temperature": temperature,
               "top_p": top_p, "seed": seed, "cite": passages if cite else 0}  # fmt: skip
    remote = server_for(server, no_server or len(questions) > MAX_QUESTIONS) if doc is None else None
    if remote is not None:
        assert cache is not None  # doc is None: --cache was given
        cache_budget_note(budget, cache)
        ask_remote(remote, cache, questions, {**options, "model": model, "device": device, "dtype": dtype,
                                               "weights": weights, "trust_remote_code": trust_remote_code},
                   AnswerPrinter(fmt, stream), timings)  # fmt: skip
        if verbose:
            log(f"answered by the server at {remote.url}")
            log(timings.summary())
        return
    if doc is None:
        assert cache is not None  # one of the two, checked above
        cache_budget_note(budget, cache)
        rk, stored = open_cache(cache, model, device, dtype, trust_remote_code, weights, timings,
                                cite=passages if cite else 0, segments=segments,
                                decode_options={"dense": dense, "hsa": hsa, "topk": topk, "page_size": page_size,
                                                "n_score_dims": n_score_dims})  # fmt: skip
        source = str(cache)
    else:
        cfg = prefill_config(
            token_budget=DEFAULT_TOKEN_BUDGET if budget is None else budget,
            max_new_tokens=128 if max_new_tokens is None else max_new_tokens,
        )
        document = open_stream(doc, encoding, errors)
        rk = load_engine(model, device, dtype or "auto", trust_remote_code, weights)
        stored = ingest(rk, document, cfg, segment_tokens=segment_tokens).cache
        source = doc
    printer = AnswerPrinter(fmt, stream)
    answers = rk.ask(stored, questions, on_text=printer.piece, log=log, **options)
    print_answers(answers, questions, source, printer, timings)
    if verbose:
        log(threads_note())
        log(timings.summary())
