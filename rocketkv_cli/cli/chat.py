"""`rocketkv chat`: questions one after another from a prompt, the model and the cache loaded once.

On a terminal: a `> ` prompt with line editing and history (readline; kept in
$ROCKETKV_HOME/chat_history), answers printed as they are decoded, Ctrl-C cancels the answer
being decoded (or the line being typed), Ctrl-D quits. From a pipe: one question per line,
answered as each line arrives, printed as Q:/A: records (or `--json`, one object per answer);
a question that cannot be answered is one error line on stderr, the others are still answered,
and the exit code is 1.
"""

from __future__ import annotations

import os
import re
import select
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..api.preflight import check_cache_file, check_questions, open_document
from ..core.config import AttentionChoice
from ..errors import InputError, RocketKVError, UsageError
from ..serve.client import ServerError, health, home
from ..signals import handled
from .answers import (
    AnswerPrinter,
    CiteOpt,
    FocusOpt,
    PassagesOpt,
    SeedOpt,
    TemperatureOpt,
    TopPOpt,
    answer_log,
    check_focus,
    check_segments,
    focus_passages_note,
    sampling_note,
)
from .common import cache_budget_note, err, fail, is_question, log, question_bar, setup, utf8_text
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
    QuietOpt,
    SegmentOpt,
    SegmentsOpt,
    SegmentTokensOpt,
    ServerOpt,
    ThreadsOpt,
    TrustOpt,
    WeightsOpt,
    path_text,
)
from .remote import RemoteChat, Turn, check_server_flags, server_for, unused_threads_note
from .sources import DocumentReading, ModelChoice, open_source

PROMPT = "> "
HISTORY_MAX_CHARS = 2000
MAX_LINE_CHARS = 4 * 2**20  # a question read from a pipe longer than this ends the chat (InputError)


def _plain_or_missing(path: Path) -> bool:
    """Whether `path` is a regular file (links followed) or nothing: a history file readline can
    read and write without blocking (a FIFO or a device there would hang the prompt)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # missing (made on exit), a broken link, a loop, no permission: readline fails quietly
        return True


class Prompt:
    """Reads questions: `input()` with readline history when stdin and stdout are terminals;
    the prompt on stderr when only stdin is; plain lines from a pipe."""

    def __init__(self, history: Path):
        self.interactive = sys.stdin.isatty()
        self.history: Path | None = history
        if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes reach check_questions, not a traceback
            sys.stdin.reconfigure(errors="surrogateescape")
        self.readline = None
        self._pending: str | None = None  # the first question of a pipe, read before a model loads
        self._queued: list[str] = []  # whole lines typed or pasted ahead, asked one at a time
        self._partial = ""  # the unfinished line after them, given to readline to edit
        self._split: list[str] = []  # the lines after the first of a piped line that held CR line ends
        if self.interactive and sys.stdout.isatty():
            try:
                import readline
            except ImportError:  # pragma: no cover - platforms without readline
                readline = None  # type: ignore[assignment]
            self.readline = readline
        if self.readline is not None and not _plain_or_missing(history):  # a FIFO there would block: no history
            self.history = None
        if self.readline is not None:
            try:
                if self.history is not None:
                    self.readline.read_history_file(str(history))
            except OSError:
                pass
            self.readline.set_history_length(1000)

    def first_question(self) -> None:
        """From a pipe or a file, read ahead to the first question (a line neither blank nor a
        comment, `is_question`), so that an input without one ends the command before a model loads; `read`
        returns it first. Nothing is read at a terminal. Raises InputError: no question."""
        if self.interactive:
            return
        while True:
            try:
                line = self.read()
            except EOFError:
                raise InputError("no questions in stdin", "write one question per line") from None
            if is_question(line):
                self._pending = line
                return

    def read(self) -> str:
        """The next line. Raises EOFError at the end (Ctrl-D), KeyboardInterrupt on Ctrl-C."""
        if self._pending is not None:
            line, self._pending = self._pending, None
            return line
        if self.readline is not None:
            if not self._queued:
                ahead = self._typed_ahead()
                if ahead is None and not self._partial:
                    return input(PROMPT)
                if ahead == "" and not self._partial:  # Ctrl-D typed during the answer
                    sys.stdout.write(PROMPT + "\n")
                    raise EOFError
                # lines pasted at the prompt arrive with the terminal in readline's mode, ended by
                # "\r" (Enter), not "\n": each is a question, asked in turn
                ahead = (self._partial + (ahead or "")).replace("\r\n", "\n").replace("\r", "\n")
                *self._queued, self._partial = ahead.split("\n")
            if not self._queued:  # a part of a line (left from a paste): to be edited and ended at the prompt
                readline, partial, self._partial = self.readline, self._partial, ""
                readline.set_startup_hook(lambda: readline.insert_text(partial))
                try:
                    return input(PROMPT)
                finally:
                    readline.set_startup_hook(None)
            line = self._queued.pop(0)
            shown = line.encode("utf-8", "backslashreplace").decode("utf-8")  # an undecodable byte: shown escaped
            sys.stdout.write(PROMPT + shown + "\n")  # as readline would have shown it
            if line.strip():
                self.readline.add_history(line)
            return line
        if self._split:
            return self._split.pop(0)
        if self.interactive:
            sys.stderr.write(PROMPT)
            sys.stderr.flush()
        line = sys.stdin.readline(MAX_LINE_CHARS + 1)  # `< /dev/zero` is one endless line: never read whole
        if not line:
            raise EOFError
        if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
            raise InputError(f"a line of the input is over {MAX_LINE_CHARS:,} characters",
                             "give one question per line; a document is given as DOC or --cache")  # fmt: skip
        if line.endswith("\r\n"):  # a CRLF line end: the CR is no part of the question
            line = line[:-2] + "\n"
        elif "\r" in line and not line.endswith("\n"):  # CR line ends alone, as old Macs wrote: each a line, as
            # `ask -` reads a file without a line feed (one with line feeds keeps a CR inside a line, as here)
            line, *self._split = [part + "\n" for part in line.split("\r") if part] or [line]
        return line

    @staticmethod
    def _typed_ahead() -> str | None:
        """A whole line (or Ctrl-D: "") typed while an answer was printed, or None. The terminal
        holds it in its line discipline, where readline, switching the terminal to its own mode,
        would take a Ctrl-D for nothing (the prompt waited on); read in that mode, it is what it was
        typed as. A part of a line typed ahead is not ready to read, and readline takes it."""
        fd = sys.stdin.fileno()
        if not select.select([fd], [], [], 0)[0]:
            return None
        return os.read(fd, 1 << 16).decode(sys.stdin.encoding or "utf-8", "surrogateescape")

    def remember(self) -> None:
        """Save the history file; a question over `HISTORY_MAX_CHARS` (a pasted passage) is left
        out of it, so that Up does not bring back kilobytes."""
        if self.readline is not None and self.history is not None:
            n = self.readline.get_current_history_length()
            if n and len(self.readline.get_history_item(n) or "") > HISTORY_MAX_CHARS:
                self.readline.remove_history_item(n - 1)  # get is 1-based, remove 0-based
            try:
                self.history.parent.mkdir(parents=True, exist_ok=True)
                self.readline.write_history_file(str(self.history))
            except OSError:
                pass  # a read-only home only loses the history


def local_turns(stream_of: Callable[[str], Any], source: str) -> Callable[[str], Turn]:
    """`Turn`s of answers made in this process (what `RemoteChat.turn` gives for a server):
    `stream_of(question)` is an `AnswerStream` (`Session.stream`, `RocketKV.stream_focused`)."""

    def turn(question: str) -> Turn:
        with question_bar():  # a long question's reading, on a terminal
            stream = stream_of(question)
            yield from stream
        answer = stream.answer
        assert answer is not None  # set when the iteration ends
        return answer.text, answer.to_dict(cache=source), answer.citations, answer_log(answer)

    return turn


def chat_command(
    ctx: typer.Context,
    document: Annotated[
        Optional[str],
        typer.Argument(
            metavar="[DOC]",
            show_default=False,
            parser=path_text,
            help="A text file to ingest in memory first (or use --cache).",
        ),
    ] = None,
    cache: CacheOpt = None,
    max_new_tokens: MaxNewOpt = None,
    budget: DocBudgetOpt = None,
    dense: DenseOpt = False,
    hsa: HsaOpt = False,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    cite: CiteOpt = False,
    passages: PassagesOpt = 3,
    segments: SegmentsOpt = 1,
    segment: SegmentOpt = None,
    segment_tokens: SegmentTokensOpt = None,
    encoding: EncodingOpt = "utf-8",
    errors: ErrorsOpt = "strict",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    weights: WeightsOpt = None,
    threads: ThreadsOpt = None,
    server: ServerOpt = None,
    no_server: NoServerOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    focus: FocusOpt = None,
) -> None:
    """Ask questions one after another from a prompt; the model and cache load once.

    Each question is answered from the document on its own: an answer does not see the earlier
    questions or answers (ask a follow-up in full). Ctrl-C cancels the answer being printed,
    Ctrl-D quits. Questions can also come from a pipe, one per line (there Ctrl-C stops the
    command). With --cache, a running `rocketkv serve` answers (--no-server: this process).
    """
    check_server_flags(server, no_server)
    setup(quiet, threads)
    if (document is None) == (cache is None):
        raise UsageError("give either --cache FILE.kv or DOC", "e.g. rocketkv chat --cache book.kv")
    if document == "-":
        raise UsageError("chat reads its questions from stdin, so DOC cannot be -", "ingest it first: rocketkv ingest")
    AttentionChoice(dense=dense, hsa=hsa)  # the API's check (UsageError), before the model loads
    check_segments(segments, segment)
    if note := sampling_note(temperature, seed):
        log(note)
    options = {"max_new_tokens": max_new_tokens, "dense": dense, "hsa": hsa, "temperature": temperature,
               "top_p": top_p, "seed": seed, "segments": segments, "segment": segment,
               "cite": passages if cite else 0}  # fmt: skip
    if focus is not None:
        check_focus(options)
        focus_passages_note(ctx, focus)
    choice = ModelChoice(model, device, dtype, weights, trust_remote_code)
    prompt = Prompt(home() / "chat_history")
    if not prompt.interactive:  # `chat < /dev/null` ends before a model loads; a bad source is named first
        if cache is not None:
            check_cache_file(cache, "chat")
        elif os.path.isfile(str(document)):  # a pipe (`<(cat doc)`) is not read here: its first block would be lost
            open_document(str(document), encoding, errors, "chat")
        prompt.first_question()
    remote = server_for(server, no_server) if cache is not None else None

    def local() -> tuple[Callable[[str], Turn], str]:  # the model and the cache loaded in this process
        reading = DocumentReading(encoding, errors, segment_tokens)
        rk, stored, source = open_source(document, cache, choice, budget, options, reading, command="chat")
        if focus is not None:  # each question's passages named on stderr, then its answer

            def focused_stream(question: str) -> Any:
                return rk.stream_focused(stored, question, passages=focus, max_new_tokens=max_new_tokens, cite=cite,
                                         on_chosen=lambda picked: log(picked.note()))  # fmt: skip

            return local_turns(focused_stream, source), source
        return local_turns(rk.session(stored, log=log, **options).stream, source), source

    turn: Callable[[str], Turn]
    if remote is not None and cache is not None:  # a server only with --cache
        cache_budget_note(budget, cache)
        focused = {} if focus is None else {"focus": focus}
        chat = RemoteChat(remote, cache, {**options, **focused, **choice.for_server()})
        turn, source = ServerOrHere(chat, lambda: local()[0]).turn, str(cache)
        unused_threads_note(remote, threads)  # the server took the cache and options
    else:
        turn, source = local()
    if converse(prompt, turn, source, json_out):
        raise typer.Exit(1)


class ServerOrHere:
    """A chat's questions answered by a server while it answers, then in this process: a server
    that is gone (its idle timeout passed while the prompt waited, it was stopped or killed) made
    every later question an error until the chat was restarted. A question the server never began
    is asked here; one it broke off is an error line, and the next is asked here."""

    def __init__(self, chat: RemoteChat, here: Callable[[], Callable[[str], Turn]]):
        self.chat, self.here = chat, here
        self.local: Callable[[str], Turn] | None = None

    def turn(self, question: str) -> Turn:
        if self.local is None:
            pieces, begun = self.chat.turn(question), False
            try:
                while True:
                    piece = next(pieces)
                    begun = True
                    yield piece
            except StopIteration as end:
                return end.value
            except ServerError:
                if health(self.chat.server) is not None:  # it answers: this request's own failure
                    raise
                log(f"the rocketkv server at {self.chat.server.url} is gone (stopped, or its idle timeout passed): "
                    "answering in this process from now on")  # fmt: skip
                self.local = self.here()
                if begun:  # part of the answer was printed: this one failed, the next is asked here
                    raise
            finally:
                pieces.close()  # Ctrl-C here closes the request at once, which cancels the answer in the server
        assert self.local is not None
        return (yield from self.local(question))


QUIT_COMMANDS = ("/quit", "/exit", "/bye")
HELP = ("type a question and press Enter: it is answered from the document on its own (a follow-up needs "
        "its own full question); Ctrl-C cancels an answer or clears the line; Up brings back earlier questions; "
        "Ctrl-D or /quit (/exit, /bye) quits")  # fmt: skip
PIPED_HELP = ("one question per line, each answered from the document on its own; blank lines and lines "
              "starting '# ' are skipped; /quit (/exit, /bye) or the end of the input ends the chat")  # fmt: skip


def typed_command(line: str, interactive: bool) -> str | None:
    """What a line is when it is not a question: "quit" (/quit, /exit, /bye; on a terminal also a
    bare quit or exit), a message to print (/help, /?, or an unknown /word), or None (a question)."""
    word = line.lower()
    if word in QUIT_COMMANDS or (interactive and word in ("quit", "exit")):
        return "quit"
    if word in ("/help", "/?", "?") and (interactive or word != "?"):
        return HELP if interactive else PIPED_HELP  # no Up or Ctrl-C to offer a pipe
    if re.fullmatch(r"/[a-z]+", word):
        return f"unknown command {line}: /help lists what chat takes (a question is plain text)"
    return None


def converse(prompt: Prompt, turn: Callable[[str], Turn], source: str, json_out: bool) -> bool:
    """Read questions from `prompt` and answer each with `turn` until the end of the input (Ctrl-D).
    Returns True when a question piped in could not be answered (the exit code is then 1)."""
    interactive = prompt.interactive
    fmt = "json" if json_out else ("text" if interactive else "qa")
    printer = AnswerPrinter(fmt, stream=not json_out and (interactive or sys.stdout.isatty()),
                            show_question=not interactive)  # fmt: skip
    if interactive:
        log(f"chat with {source}: type a question and press Enter (each is answered from the document on its own, "
            "without the earlier ones); Ctrl-C cancels an answer, Ctrl-D or /quit quits, /help", wrap=True)  # fmt: skip
    failed = False
    while True:
        try:
            line = utf8_text(prompt.read())
        except EOFError:
            if interactive:
                err.print()
            break
        except KeyboardInterrupt:
            if not interactive:  # questions piped in: Ctrl-C stops the command (exit 130), as it stops `ask`
                raise
            handled()  # this Ctrl-C only cleared the line
            err.print()  # a new prompt on its own line, like a shell
            continue
        question = line.strip()
        if not question or (not interactive and not is_question(question)):  # a blank line, a comment in a pipe
            continue
        command = typed_command(question, interactive)
        if command == "quit":
            break
        if command is not None:
            unknown = command.startswith("unknown command")
            if unknown and not interactive:  # piped in: a question fewer, so an error line and exit 1
                fail(command)
            else:
                log(command, wrap=True)
            failed = failed or unknown
            continue
        prompt.remember()
        failed = not answer_turn(printer, turn, question, interactive) or failed
    return failed and not interactive


def answer_turn(printer: AnswerPrinter, turn: Callable[[str], Turn], question: str, interactive: bool = True) -> bool:
    """One question answered and printed as it is decoded. Returns False when it could not be
    answered (one error line on stderr); Ctrl-C cancels only this answer at a prompt (`interactive`),
    and stops the command when the questions are piped in (a script's answers would be missing)."""
    try:
        check_questions([question])  # the API's check (InputError: not UTF-8)
        printer.start(question)
        pieces = turn(question)
        while True:
            try:
                printer.piece(next(pieces))
            except StopIteration as end:
                text, record, citations, line = end.value
                break
        printer.finish(text, record, citations)
        log(line)
    except KeyboardInterrupt:
        printer.interrupted()
        if not interactive:
            raise
        handled()  # this Ctrl-C only cancelled the answer: the session goes on
        log("answer cancelled")
    except RocketKVError as exc:  # this question only: the session goes on
        printer.interrupted()
        fail(str(exc))
        return False
    return True
