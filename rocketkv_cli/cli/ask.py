"""`rocketkv ask`: answer questions from a saved cache, or from a document ingested in memory."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..api.preflight import check_questions
from ..core.config import AttentionChoice
from ..errors import InputError, UsageError
from ..serve.client import MAX_QUESTIONS, fits
from .answers import (
    AnswerPrinter,
    CiteOpt,
    FocusOpt,
    FormatOpt,
    PassagesOpt,
    SeedOpt,
    StreamOpt,
    TemperatureOpt,
    TopPOpt,
    answer_log,
    check_focus,
    check_segments,
    decode_timing,
    focus_passages_note,
    missing_arguments,
    resolve_format,
    sampling_note,
    usage_error,
)
from .common import (
    Timings,
    cache_budget_note,
    is_question,
    log,
    question_bar,
    reading_terminal,
    setup,
    threads_note,
    utf8_text,
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
    path_text,
)
from .remote import ask_remote, check_server_flags, read_here_note, server_for, server_running, unused_threads_note
from .sources import DocumentReading, ModelChoice, open_source

MAX_QUESTIONS_BYTES = 16 * 2**20  # a questions file (or stdin) larger than this is refused, not read on


def read_questions(positional: list[str], questions_file: Optional[str], doc_is_stdin: bool) -> list[str]:
    """Questions from arguments and a file (`-` = stdin), one per line (blank lines and comment
    lines, `# …`, skipped: said on stderr); may be empty. Raises
    InputError (a file that cannot be read or decoded, or over `MAX_QUESTIONS_BYTES`: `/dev/zero`
    was read until the machine ran out of memory)."""
    questions = [utf8_text(q) for q in positional]
    if questions_file is not None:
        where = "questions from stdin" if questions_file == "-" else f"questions file {questions_file}"
        if questions_file == "-":
            if doc_is_stdin:
                raise UsageError("the document and the questions cannot both come from stdin")
            reading_terminal("questions, one per line,")
            data = sys.stdin.buffer.read(MAX_QUESTIONS_BYTES + 1)
        else:
            try:
                with open(questions_file, "rb") as f:
                    data = f.read(MAX_QUESTIONS_BYTES + 1)
            except FileNotFoundError:
                raise InputError(f"{where} not found", "check the path") from None
            except IsADirectoryError:
                raise InputError(f"{where} is a directory", "give a file of questions, one per line") from None
            except OSError as exc:
                raise InputError(f"cannot read {where}: {exc.strerror or exc}") from None
        if len(data) > MAX_QUESTIONS_BYTES:
            raise InputError(f"{where.replace('questions from stdin', 'stdin')} holds more than "
                             f"{MAX_QUESTIONS_BYTES // 2**20} MB of questions",
                             "give questions one per line; a document is given as DOC or --cache")  # fmt: skip
        text = _questions_text(data, where)
        ends = "\n" if "\n" in text or "\r" not in text else "\r"  # a file of CR line ends (old Macs): CR
        lines = [line.strip().strip("\x1a") for line in text.split(ends)]  # else only \n ends a question; ^Z: DOS's end
        asked = [line for line in lines if is_question(line)]
        if comments := sum(1 for line in lines if line and not is_question(line)):
            log(f"{where}: {comments} comment line{'s' * (comments != 1)} (starting '# ') not asked")
        questions += asked
    return check_questions(questions) if questions else questions  # none: `questions_of` says why


_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)  # fmt: skip  (UTF-32 LE's begins as UTF-16 LE's: checked first)


def _questions_text(data: bytes, where: str) -> str:
    """The questions' bytes as text: UTF-8 (a BOM allowed). Raises InputError naming what they
    are instead: UTF-16 or UTF-32 (their BOM), binary data or UTF-16 without a BOM (NUL bytes),
    or bytes that are no UTF-8 (the first one and its offset in the file)."""
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), None)
    if encoding is not None:
        path = where.removeprefix("questions file ")
        hint = (f"save it as UTF-8: iconv -f {encoding} -t UTF-8 {shlex.quote(path)} > "
                f"{shlex.quote(path + '.utf8.txt')}" if path != where else "send UTF-8")  # fmt: skip
        raise InputError(f"{where} is {encoding} text", hint)
    if b"\0" in data:
        raise InputError(f"{where} holds NUL bytes: binary data or UTF-16, not UTF-8 text",
                         "give questions as UTF-8 text, one per line")  # fmt: skip
    bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        raise InputError(f"{where} is not UTF-8 text (byte 0x{data[at]:02x} at offset {at})",
                         "save it as UTF-8") from None  # fmt: skip


def _is_file(text: str) -> bool:
    """Whether `text` names an existing file (a question too long for a file name does not)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # ENAMETOOLONG, a NUL byte
        return False


def server_note(remote) -> str:
    """ "answered by the server at URL (threads: 2, the server's)" for `--verbose`: the threads the
    server computes with now (`/health`)."""
    from ..serve.client import health

    threads = (health(remote) or {}).get("threads")
    return f"answered by the server at {remote.url}" + (f" (threads: {threads}, the server's)" if threads else "")


def split_question(args: list[str]) -> bool:
    """Whether the question arguments look like one question the shell split at its spaces
    (`ask --cache X.kv Who wrote it?`, unquoted): two or more single words, the last ending in "?",
    none of the others ending a sentence. Several real questions end in "?" each (`Who? When?`).
    Only words in ASCII letters: scripts without spaces between words (Chinese, Japanese) give
    whole questions as single arguments, and other punctuation ends their sentences."""
    words = [a for a in args if a]
    return (len(words) == len(args) >= 2 and words[-1].endswith("?") and all(w.isascii() for w in words)
            and not any(w.split() != [w] for w in words) and not any(w[-1] in "?!.:;" for w in words[:-1]))  # fmt: skip


def questions_of(args: Optional[list[str]], cache: Optional[Path], questions_file: Optional[str]):
    """(DOC or None, questions) from the arguments: the usage errors come first, before the engine
    (torch) is imported. Raises typer.BadParameter (exit 2), UsageError, InputError."""
    args = list(args or [])
    if cache is None and not args:
        raise missing_arguments("no question: give --cache FILE.kv QUESTION..., or DOC QUESTION...")
    if cache is None and len(args) == 1 and questions_file is None and args[0] != "-" and not _is_file(args[0]):
        # one argument, not a file: a question without --cache (not a document without its question)
        raise missing_arguments(f"no cache and no document for {args[0]!r}: give --cache FILE.kv QUESTION..., "
                                "or DOC QUESTION...")  # fmt: skip
    if cache is not None and len(args) > 1 and (args[0] == "-" or _is_file(args[0])):
        # with --cache every argument is a question: a document named too would be asked as one
        raise usage_error("DOC", f"{args[0]!r} is a document, and --cache {cache} names the cache to answer from: "
                                 "give one of them")  # fmt: skip
    doc, rest = (None, args) if cache is not None else (args[0], args[1:])
    if doc == "":  # `"$UNSET"`: not the current folder, nor a document named nothing
        raise usage_error("[DOC]", "is empty: give a path")
    if rest == ["-"] and questions_file is None:  # `echo QUESTION | rocketkv ask --cache F.kv -`
        rest, questions_file = [], "-"
    if split_question(rest):
        raise usage_error("QUESTION...", f"{len(rest)} words, each asked as a question of its own: quote a question "
                                         f"of several words, {shlex.quote(' '.join(rest))}")  # fmt: skip
    questions = read_questions(rest, questions_file, doc == "-")
    if not questions and questions_file is not None:  # given, but it holds no question
        where = "stdin" if questions_file == "-" else questions_file
        raise InputError(f"no questions in {where}", "write one question per line")
    if not questions:
        raise usage_error("QUESTION...", "missing: pass questions as arguments, or - to read them from stdin "
                                         "(one per line; --questions-file FILE reads a file)")  # fmt: skip
    return doc, questions


def check_attention(dense: bool, hsa: bool) -> None:
    """`--dense` with `--hsa`: the API's refusal (`AttentionChoice`) shown as a usage error of --hsa
    (exit 2), before the model loads."""
    try:
        AttentionChoice(dense=dense, hsa=hsa)
    except UsageError as exc:
        raise usage_error("--hsa", f"{exc.message}: {exc.hint}") from None


def focused_answers(rk, stored, questions: list[str], focus: int, max_new_tokens, cite: bool, printer):
    """`RocketKV.ask_focused` for each question, lazily (as `print_answers` takes them), with a line
    on stderr naming the passages each is answered from, before its answer is printed."""

    for q in questions:
        yield rk.ask_focused(stored, q, passages=focus, max_new_tokens=max_new_tokens, cite=cite,
                             on_text=printer.piece, on_chosen=lambda picked: log(picked.note())).answer  # fmt: skip


def print_answers(answers, questions: list[str], source: str, printer: AnswerPrinter,
                  timings: Timings | None = None) -> None:  # fmt: skip
    """Each answer on stdout as it is made (streamed when the printer streams), a line on stderr.

    `answers` is lazy: question i is answered when its `Answer` is taken, so its header is
    printed first and its pieces arrive through the printer (see `RocketKV.ask(on_text=...)`)."""
    it = iter(answers)
    for i, question in enumerate(questions):
        printer.start(question)
        with question_bar():  # a long question's reading, on a terminal
            ans = next(it)
        if timings is not None:
            timings.add(f"question {i + 1} prefill", ans.prefill_s)
            timings.add(*decode_timing(ans.to_dict(cache=source)))
        printer.finish(ans.text, ans.to_dict(cache=source), ans.citations)
        log(answer_log(ans))


def ask_command(
    ctx: typer.Context,
    args: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="[DOC] QUESTION...",
            show_default=False,
            help="The questions (with --cache), or a document then the questions; - reads them from stdin.",
        ),
    ] = None,
    cache: CacheOpt = None,
    questions_file: Annotated[
        Optional[str],
        typer.Option(
            metavar="FILE",
            parser=path_text,
            help='File with one question per line (a line starting "# " is a comment), or - for stdin.',
        ),
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
    focus: FocusOpt = None,
) -> None:
    """Answer questions from a saved cache (or from DOC, ingested in memory first).

    Each question is answered on its own. On a terminal the answers are printed as they are
    decoded; several questions are shown as Q:/A: records (see --format). With --cache, a running
    `rocketkv serve` answers (the model and cache stay loaded there); --no-server answers here.
    """
    check_server_flags(server, no_server)
    doc, questions = questions_of(args, cache, questions_file)  # usage errors first: before torch is imported
    fmt, stream = resolve_format(fmt, json_out, stream, len(questions), cite)
    check_attention(dense, hsa)
    check_segments(segments, segment)
    timings = Timings()
    setup(quiet, threads)
    if note := sampling_note(temperature, seed):
        log(note)
    options = {"max_new_tokens": max_new_tokens, "dense": dense, "hsa": hsa, "topk": topk, "page_size": page_size,
               "n_score_dims": n_score_dims, "segments": segments, "segment": segment, "temperature": temperature,
               "top_p": top_p, "seed": seed, "cite": passages if cite else 0}  # fmt: skip
    if focus is not None:
        check_focus(options)
        focus_passages_note(ctx, focus)
    choice = ModelChoice(model, device, dtype, weights, trust_remote_code)
    printer = AnswerPrinter(fmt, stream)
    local = no_server or len(questions) > MAX_QUESTIONS
    remote = server_for(server, local, timings) if doc is None else None
    if remote is not None and not fits(remote, {"questions": questions}):  # as past MAX_QUESTIONS: answered here
        log(f"the questions are over the request limit of the server at {remote.url}: answered in this process")
        remote = None
    server_hint = doc is not None and not local and server_running(server)  # said once answered, never before an error
    try:
        if remote is not None and cache is not None:  # doc is None: --cache was given
            cache_budget_note(budget, cache)
            focused = {} if focus is None else {"focus": focus}
            said = lambda: unused_threads_note(remote, threads)  # noqa: E731 (once the server took the request)
            ask_remote(remote, cache, questions, {**options, **focused, **choice.for_server()}, printer, timings, said)
        else:
            reading = DocumentReading(encoding, errors, segment_tokens)
            rk, stored, source = open_source(doc, cache, choice, budget, options, reading, timings)
            if focus is not None:
                answers = focused_answers(rk, stored, questions, focus, max_new_tokens, cite, printer)
            else:
                answers = rk.ask(stored, questions, on_text=printer.piece, log=log, **options)
            print_answers(answers, questions, source, printer, timings)
    except BaseException:  # Ctrl-C or an error mid-answer: its line ends before the error line
        printer.end_line()
        raise
    if server_hint:
        log(read_here_note("ask", str(doc)))
    if verbose:
        log(server_note(remote) if remote is not None else threads_note())
        log(timings.summary())
