"""The `rocketkv` command line: one small module per command, each parsing its options, calling
the Python API (`rocketkv_cli.api.rocketkv`), printing, and mapping errors (`common.command`).

stdout carries results only (`--json`: one JSON object per line); stderr carries progress, logs and
hints. Exit codes: 0 ok, 1 known failure (one line), 2 usage error, 130 interrupted (143 SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from .. import __version__
from .ask import ask_command
from .batch import batch_command
from .batch import with_bare_ray as with_bare_ray  # used by the console script (entry.main)
from .bench import bench
from .chat import chat_command
from .common import command
from .eval import eval_command
from .ingest import ingest_command
from .inspect import inspect_command
from .models import models_command
from .serve import serve_command
from .summarize import summarize_command

# click's UsageError, whichever click Typer runs on (newer Typers vendor their own): the base of
# Typer's BadParameter
_UsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class OneLineUsageError(_UsageError):  # type: ignore[misc,valid-type]
    """A usage error (exit 2) shown as one line on stderr, `Error: <what>; try 'rocketkv CMD
    --help'`, instead of click's usage line, hint and error on four lines: a script's log keeps
    one line per failure, as for every other error (docs/usage.md, "Exit codes")."""

    def __init__(self, original, command_path: str | None = None, args: list[str] | None = None) -> None:
        param = getattr(original, "param", None)
        text = _with_value(" ".join(original.format_message().split()), param, args)
        if param is not None and type(original).__name__ == "MissingParameter" and param.param_type_name == "argument":
            # "Missing argument 'document'": the name as the usage line and --help spell it
            text = text.replace(f"'{param.name}'", f"'{param.metavar or param.name.upper()}'")
        if text.endswith(".") and not text.endswith(".."):  # "Missing argument 'document'." (not "QUESTION...")
            text = text[:-1]
        before_dashes = (args or [])[: (args or []).index("--")] if "--" in (args or []) else (args or [])
        if type(original).__name__ == "NoSuchOption" and any(_text_like(a) for a in before_dashes):
            text += " (text that starts with '-', such as a question, goes after --)"
        elif type(original).__name__ == "NoSuchOption" and (
            later := _command_after(original.ctx, before_dashes, original.option_name)
        ):
            text += f" (a command's options go after it: rocketkv {later} {original.option_name} …)"
        super().__init__(text, original.ctx)
        self.exit_code = original.exit_code
        ctx = original.ctx  # an option missing its value is raised before the command has a context
        self.command_path = ctx.command_path if ctx is not None else command_path

    def show(self, file=None) -> None:
        joint = " Try" if self.format_message().endswith("?") else "; try"  # "Did you mean 'ask'? Try …"
        hint = f"{joint} '{self.command_path} --help'" if self.command_path else ""
        typer.echo(f"Error: {self.format_message()}{hint}", file=file, err=file is None)


def _command_after(ctx, args: list[str], option: str) -> str | None:
    """The command named later in `args` when `ctx` is the `rocketkv` group itself and that
    command takes `option` (`rocketkv --threads 1 ask …`: an option given before its command),
    else None."""
    if ctx is None or ctx.parent is not None or not hasattr(ctx.command, "list_commands"):
        return None
    commands = set(ctx.command.list_commands(ctx))
    name = next((a for a in args if a in commands), None)
    command = ctx.command.get_command(ctx, name) if name is not None else None
    takes = command is not None and any(option in (*p.opts, *p.secondary_opts) for p in command.params)
    return name if takes else None


def _text_like(arg: str) -> bool:
    """Whether a command-line argument that starts with '-' reads as text, not an option: it holds
    whitespace ("- apples\n- pears", "-v is verbose?") or a digit follows the dash ("-3 °C?")."""
    return arg.startswith("-") and not arg.startswith("--") and (any(c.isspace() for c in arg) or arg[1:2].isdigit())


# Typer's messages for a value of the wrong type, which do not say the value
_NOT_A = {"Input should be a valid integer, unable to parse string as an integer": "an integer",
          "Input should be a valid number, unable to parse string as a number": "a number"}  # fmt: skip
# and for a value out of an option's range (`min=`, `max=`): "Input should be greater than or equal to 1"
_BOUND = re.compile(r"Input should be (greater|less) than( or equal to)? (\S+)")


def _with_value(text: str, param, args: list[str] | None) -> str:
    """`text` with Typer's "Input should be a valid integer, …" replaced by "'abc' is not an
    integer", and "Input should be greater than or equal to 1" by "must be at least 1, got '0'",
    the value read back from the command line `args` after the option's flag."""
    phrase = next((p for p in _NOT_A if p in text), None)
    bound = _BOUND.search(text)
    if (phrase is None and bound is None) or param is None or not args:
        return text
    flags = list(getattr(param, "opts", [])) + list(getattr(param, "secondary_opts", []))
    value = None
    for i, arg in enumerate(args):
        if arg in flags and i + 1 < len(args):
            value = args[i + 1]
        elif any(arg.startswith(f + "=") for f in flags if f.startswith("--")):
            value = arg.split("=", 1)[1]
    if value is None:
        return text
    if bound is None:
        return text.replace(str(phrase), f"{value!r} is not {_NOT_A[str(phrase)]}")
    side, inclusive, limit = bound.groups()
    words = {("greater", True): "at least", ("greater", False): "more than",
             ("less", True): "at most", ("less", False): "less than"}[(side, bool(inclusive))]  # fmt: skip
    return text.replace(bound.group(0), f"must be {words} {limit}, got {value!r}")


class _OneLineUsage:
    """Turns the usage errors of parsing (`make_context`) and of running (`invoke`: a command body's
    `typer.BadParameter`, an unknown command) into `OneLineUsageError`."""

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)  # parsing consumes `args`
        try:
            return super().make_context(info_name, args, parent=parent, **extra)  # type: ignore[misc]
        except _UsageError as exc:
            if isinstance(exc, OneLineUsageError) or type(exc).__name__ == "NoArgsIsHelpError":
                raise  # bare `rocketkv`: click shows the help, as it should
            path = f"{parent.command_path} {info_name}" if parent is not None else info_name
            raise OneLineUsageError(exc, path, given) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)  # type: ignore[misc]
        except _UsageError as exc:
            raise exc if isinstance(exc, OneLineUsageError) else OneLineUsageError(exc) from None


class Group(_OneLineUsage, TyperGroup):
    """The `rocketkv` group, its usage errors on one line (`OneLineUsageError`)."""


app = typer.Typer(
    name="rocketkv",
    cls=Group,
    help="Ask questions of very long documents with a local LLM and a compressed (RocketKV) KV cache.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, powershell)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps at 80 columns, cuts no option name
    context_settings={"help_option_names": ["-h", "--help"]},  # -h as most Unix tools take it
)
_PLACEHOLDERS = {int: "N", float: "X", Path: "PATH", str: "TEXT"}


class Command(_OneLineUsage, TyperCommand):
    """Help that reads well at 80 columns: usage lines name the arguments (`QUESTION...`, `DOC`,
    `[DOCUMENT]`), every option that takes a value shows a placeholder (`N`, `X`, `PATH`,
    `TEXT` unless it names its own), and arguments are listed without Python types. Usage errors
    are one line (`OneLineUsageError`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name == "option" and not getattr(param, "is_flag", False) and param.metavar is None:
                annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
                param.metavar = _PLACEHOLDERS.get(annotation, "VALUE")  # type: ignore[arg-type]

    @staticmethod
    def _usage_name(param) -> str:
        name = param.metavar or param.name.upper()
        if param.nargs != 1 and not name.endswith("..."):
            name += "..."
        return name if param.required or name.startswith("[") else f"[{name}]"

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [self._usage_name(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]

    def format_options(self, ctx, formatter) -> None:
        params = self.get_params(ctx)
        arguments = [
            (self._usage_name(p), getattr(p, "help", None) or "") for p in params if p.param_type_name == "argument"
        ]
        options = [rec for p in params if p.param_type_name == "option" and (rec := p.get_help_record(ctx))]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"rocketkv {__version__}")  # "NAME VERSION", as git, curl and pip print it
        raise typer.Exit(0)


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Ask questions of very long documents with a local LLM and a compressed (RocketKV) KV cache."""


COMMANDS = [
    ("ingest", ingest_command, "Prefill a document once, save its compressed KV cache to a .kv file."),
    ("ask", ask_command, "Answer questions from a .kv cache (or from a document)."),
    ("chat", chat_command, "Ask questions one after another; model and cache load once."),
    ("summarize", summarize_command, "Summarize a document or a .kv cache's document."),
    ("inspect", inspect_command, "Validate a .kv file and show what it holds."),
    ("models", models_command, "List or remove converted models (disk used)."),
    ("bench", bench, "Measure speed, file size and memory vs full attention."),
    ("eval", eval_command, "Score accuracy on generated long-context tasks."),
    ("serve", serve_command, "Keep models and caches loaded in a local server that ask uses."),
    ("batch", batch_command, "Answer a manifest of documents and questions (JSONL in, JSONL out)."),
]
for _name, _fn, _short in COMMANDS:
    app.command(name=_name, short_help=_short, cls=Command)(command(_fn))
