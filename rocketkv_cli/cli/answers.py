"""Printing answers on stdout (shared by `ask`, `chat` and `summarize`), and their common options.

Formats (`--format`): `text` (the answer as it is), `qa` (`Q:`/`A:` records, continuation lines
indented by three spaces, a blank line between records: a line starting with `Q: ` always starts
a record), `lines` (one answer per line, `\\` and line breaks escaped as `\\\\` and `\\n`), `json`
(one object per answer, never streamed). `auto`: `text` for one question, `qa` for several.
Streaming writes each piece of an answer as it is decoded (on a terminal by default).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Annotated, Optional

import typer

from ..batch.manifest import utf8_stdout
from .common import shown

FORMATS = ("auto", "text", "qa", "lines", "json")
INDENT = "   "

FormatOpt = Annotated[
    str,
    typer.Option("--format", metavar="FORMAT",
                 help="auto, text, qa (Q:/A: records), lines (one answer per line) or json. auto: text for one "
                      "question, qa for several."),
]  # fmt: skip
StreamOpt = Annotated[
    Optional[bool],
    typer.Option("--stream/--no-stream", show_default=False,
                 help="Print answers as they are decoded (default: when stdout is a terminal; not with json)."),
]  # fmt: skip


def _check_temperature(value: float) -> float:
    """--temperature is checked as it is parsed (exit 2, before any model loads)."""
    if not math.isfinite(value) or value < 0:
        raise typer.BadParameter(f"{value} is not a finite number ≥ 0")
    return value


def _check_top_p(value: float) -> float:
    """--top-p is checked as it is parsed (exit 2, before any model loads)."""
    if not 0 < value <= 1:  # NaN fails both comparisons
        raise typer.BadParameter(f"{value} is not in (0, 1]")
    return value


TemperatureOpt = Annotated[
    float,
    typer.Option("--temperature", "-t", metavar="T", callback=_check_temperature,
                 help="Sampling temperature; 0 = greedy (exact)."),
]  # fmt: skip
TopPOpt = Annotated[
    float,
    typer.Option("--top-p", metavar="P", callback=_check_top_p,
                 help="Nucleus sampling: keep tokens up to mass P, 0 < P ≤ 1."),
]  # fmt: skip
CiteOpt = Annotated[
    bool, typer.Option("--cite", help="After each answer, the source passages it drew on most (lines, characters).")
]
PassagesOpt = Annotated[int, typer.Option("--passages", min=1, metavar="N", help="Passages shown by --cite.")]
FocusOpt = Annotated[
    Optional[int],
    typer.Option("--focus", min=1, metavar="N",
                 help="Answer each question from the N passages of the document that match it best (BM25), re-read "
                      "next to it, greedy (docs/prose-questions.md measures it)."),
]  # fmt: skip
SeedOpt = Annotated[
    Optional[int],
    typer.Option(
        "--seed", min=0, max=2**63 - 1, metavar="N", help="Seed of the sampler (default: random, shown on stderr)."
    ),
]


def check_focus(options: dict) -> None:
    """`--focus` re-reads passages with the model's defaults, greedy: the options that choose how the
    stored cache is attended or how tokens are sampled do not apply (usage error, exit 2)."""
    from ..core.config import focus_conflicts

    if given := ["--" + name.replace("_", "-") for name in focus_conflicts(options)]:
        raise usage_error("--focus", f"it answers from the passages it re-reads, greedy: drop {', '.join(given)}")


def focus_passages_note(ctx: typer.Context, focus: int | None) -> None:
    """A stderr line when --passages is given with --focus: --cite then lists the passages re-read."""
    from .common import log

    source = ctx.get_parameter_source("passages")
    if focus is not None and getattr(source, "name", "") == "COMMANDLINE":
        log(f"--passages does not apply with --focus: --cite lists the passages re-read (up to {focus})")


def usage_error(param: str, message: str) -> typer.BadParameter:
    """A usage error (exit 2, with the usage line) about `param`, raised from a command body."""
    return typer.BadParameter(message, param_hint=param)


def check_segments(segments: int, segment: int | None) -> None:
    """`--segment J` with `--segments N` (one of them would be ignored): the API's refusal, as a
    usage error (exit 2) before the model loads."""
    if segment is not None and segments != 1:
        raise usage_error("--segment", "give --segments N (the N best) or --segment J (that one), not both")


class _Missing(typer.BadParameter):
    def format_message(self) -> str:
        return self.message


def missing_arguments(message: str) -> typer.BadParameter:
    """A usage error (exit 2) for arguments not given at all: `message` alone, not click's "Invalid
    value for …" (nothing was given to be invalid)."""
    return _Missing(message)


def resolve_format(fmt: str, json_out: bool, stream: bool | None, n_questions: int | None, cite: bool = False):
    """(format, stream) from the options; `n_questions` None = not known in advance (chat).

    Usage errors (exit 2): an unknown format, `--json` with another format, `--stream` with
    json, `--format text` with several questions (their answers could not be told apart)."""
    if fmt not in FORMATS:
        raise usage_error("--format", f"use one of {', '.join(FORMATS)}, not {fmt!r}")
    if json_out:
        if fmt not in ("auto", "json"):
            raise usage_error("--json", f"--json is --format json, not --format {fmt}")
        fmt = "json"
    if fmt == "auto":
        fmt = "text" if n_questions == 1 else "qa"
    if fmt == "text" and (n_questions or 2) > 1:
        raise usage_error("--format", "text cannot show which answer is which: use qa, lines or json")
    if fmt == "lines" and cite:
        raise usage_error("--cite", "lines has one line per answer: use --format text, qa or json for citations")
    if fmt == "json" and stream:
        raise usage_error("--stream", "json prints one complete object per answer, never streamed")
    if stream is None:
        stream = fmt != "json" and sys.stdout.isatty()
    return fmt, stream


def escape_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


class AnswerPrinter:
    """Writes answers on stdout in one format, whole or streamed piece by piece.

    Per answer: `start(question)`, then `piece(text)` for each streamed piece (ignored when not
    streaming), then `finish(answer, record)` (`record`: the `--json` object).
    """

    def __init__(self, fmt: str, stream: bool, show_question: bool = True):
        self.fmt, self.stream, self.show_question = fmt, stream, show_question
        self.records = 0
        self.line_open = False  # stdout's last line is an answer still being printed
        # "A: ", written with the answer's first text: a note logged on stderr between the question
        # and its answer (`ask --focus` names the passages it reads) then sits on a line of its own
        self._prefix = ""

    def _write(self, text: str) -> None:
        text, self._prefix = self._prefix + text, ""
        sys.stdout.write(text)
        sys.stdout.flush()
        if text:
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        """End a line an answer left half-printed (before an error or an interrupt is reported)."""
        self._prefix = ""  # an answer that never began: nothing to end
        if self.line_open:
            try:
                self._write("\n")
            except OSError:  # stdout gone: the error being reported says more
                pass

    def _qa(self, text: str) -> str:
        return text.replace("\n", "\n" + INDENT)

    def start(self, question: str) -> None:
        if self.fmt == "qa" and self.show_question:
            # the question echoed as the user can read it: an ESC or a CR in it would drive their terminal
            self._write(("\n" if self.records else "") + "Q: " + self._qa(shown(question)) + "\n")
            self._prefix = "A: "
        self.records += 1

    def piece(self, text: str) -> None:
        if not self.stream or self.fmt == "json" or not text:
            return
        self._write(self._qa(text) if self.fmt == "qa" else escape_line(text) if self.fmt == "lines" else text)

    def finish(self, text: str, record: dict, citations=None) -> None:
        """End the answer; `citations` (`Citation`s, or None) are listed under it ("Sources:")."""
        if self.fmt == "json":
            line = json.dumps(
                record, ensure_ascii=not utf8_stdout()
            )  # a lone surrogate (a path's undecodable byte) as \udcff:
            self._write(line.encode("utf-8", "backslashreplace").decode("utf-8") + "\n")  # valid UTF-8 and JSON
            return
        if self.stream:
            self._write("\n")
        else:
            self._write((self._qa(text) if self.fmt == "qa" else escape_line(text) if self.fmt == "lines" else text)
                        + "\n")  # fmt: skip
        if citations is not None:
            indent = INDENT if self.fmt == "qa" else ""
            rows = [
                f"{indent}  [{i}] {where(c)} ({share(c.weight)}): {' '.join(c.text.split())}\n"
                for i, c in enumerate(citations, 1)
            ]  # one row each: a passage of several lines is joined
            self._write(f"{indent}Sources:\n" + "".join(rows) if rows else f"{indent}Sources: none\n")

    def interrupted(self) -> None:
        """The answer being printed was cancelled: end its line."""
        if self.stream and self.fmt != "json":
            self._write("\n")


def share(weight: float) -> str:
    """A citation's weight (its share of the answer's attention, 0-1) as a percentage: "12%", or
    "<1%" where it rounds to 0 (a cited passage never reads as none)."""
    shown = f"{100 * weight:.0f}"
    return "<1%" if shown == "0" else f"{shown}%"


def where(citation) -> str:
    """ "line 5, characters 539-719" (or "lines 5-6, …") of a `Citation`."""
    lines = (f"line {citation.first_line}" if citation.first_line == citation.last_line
             else f"lines {citation.first_line}-{citation.last_line}")  # fmt: skip
    return f"{lines}, characters {citation.start}-{citation.end}"


def sampling_note(temperature: float, seed: int | None) -> str | None:
    """A warning for options that do nothing (a seed without sampling), or None."""
    if seed is not None and temperature == 0:
        return "--seed has no effect without --temperature above 0 (decoding is greedy)"
    return None


def answer_log(ans) -> str:
    """The stderr line after an `Answer` (`answer_log_of` its record)."""
    return answer_log_of(ans.to_dict(cache=""))


def answer_log_of(record: dict) -> str:
    """The stderr line after an answer, from its `--json` record: time, tokens (and those decoded
    when some were cut: a loop's repeat), why it stopped, the seed when sampled."""
    seed = f", seed {record['sampling']['seed']}" if "sampling" in record else ""
    seconds = record["prefill_s"] + record["decode_s"]
    n = record["n_answer_tokens"]
    tokens = f"{n} tokens of {record['n_decoded_tokens']} decoded" if "n_decoded_tokens" in record else f"{n} tokens"
    return f"answered in {seconds:.2f}s ({tokens}, stop: {record['stop_reason']}{seed})"


def decode_timing(record: dict) -> tuple[str, float]:
    """(label, seconds) of an answer's decode for `--verbose`, per token over every token decoded."""
    n = record.get("n_decoded_tokens", record["n_answer_tokens"])
    per = f" ({1e3 * record['decode_s'] / (n - 1):.0f} ms/token)" if n > 1 else ""
    return f"decode {n} tokens{per}", record["decode_s"]
