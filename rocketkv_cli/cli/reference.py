"""docs/cli.md, the command reference, rendered from the Typer app so that it cannot drift.

`python -m rocketkv_cli.cli.reference > docs/cli.md` regenerates it; tests/test_cli_reference.py
fails when the committed page differs. The page reads each command's click parameters (names,
types, defaults, help) directly, never click's help formatter, so it does not depend on the
terminal's width ($COLUMNS) or on environment variables that change a value at run time
($ROCKETKV_THREADS and the like are read when a command runs, not when the app is built).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, TypeGuard

import typer
import typer.core

REGENERATE = "python -m rocketkv_cli.cli.reference > docs/cli.md"
_TYPES = {bool: "flag", int: "integer", float: "number", str: "text", Path: "path"}
_RICH_TAG = re.compile(r"\[/?(?:bold|dim|italic|underline|strike|reverse|code|link(?:=[^\]]*)?|"
                       r"(?:bright_)?(?:red|green|yellow|blue|magenta|cyan|white|black))\]")  # fmt: skip


def _plain(text: str | None) -> str:
    """Help text without Rich markup, click's `\\b` no-rewrap markers, or what follows `\\f`."""
    text = _RICH_TAG.sub("", (text or "").split("\f")[0])
    return "\n".join(line for line in text.strip().splitlines() if line.strip() != "\b")


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped, no accidental HTML tag."""
    return re.sub(r"<(?=[A-Za-z/!])", "&lt;", " ".join(_plain(text).split())).replace("|", "\\|")


def _type(param: Any) -> str:
    """The parameter's type in words: `integer`, `path, repeatable`, `text, one or more`, ..."""
    annotation: Any = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    inner: Any = getattr(annotation, "__args__", (annotation,))[0]  # list[str] -> str
    name = _TYPES.get(inner) or _TYPES.get(annotation) or str(getattr(getattr(param, "type", None), "name", "value"))
    if param.multiple:
        return f"{name}, repeatable"
    if param.nargs == -1:
        return f"{name}, {'one' if param.required else 'zero'} or more"
    return name


def _default(param: Any) -> str:
    """The declared default (not one read from the environment), `—` when there is none."""
    value = param.default
    if getattr(param, "is_flag", False) and param.secondary_opts:
        return "—" if value is None else f"`{(param.opts if value else param.secondary_opts)[0]}`"
    if getattr(param, "is_flag", False):
        return "on" if value else "off"
    if value is None or callable(value) or value == ():
        return "—"
    shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
    return f"`{shown}`" if shown else '`""`'


def _argument_name(param: Any) -> str:
    """An argument as the usage line shows it: `DOC`, `QUESTION...`, `[DOC]` when optional."""
    name = param.metavar or (param.name or "").upper()
    if param.nargs != 1 and not name.endswith("..."):
        name += "..."
    return name if param.required or name.startswith("[") else f"[{name}]"


def _option_row(param: Any) -> str:
    names = " / ".join(", ".join(f"`{o}`" for o in opts) for opts in (param.opts, param.secondary_opts) if opts)
    if param.metavar and not getattr(param, "is_flag", False):
        names += f" `{param.metavar}`".replace("|", "\\|")
    help_text = _plain(getattr(param, "help", None))
    if getattr(param, "envvar", None) and getattr(param, "show_envvar", False):
        help_text += f" (environment: `${param.envvar}`)"
    return f"| {names} | {_type(param)} | {_default(param)} | {_cell(help_text)} |"


def _section(ctx: typer.Context) -> list[str]:
    """A command's section: heading, usage, help, then its argument and option tables."""
    cmd = ctx.command
    params = [p for p in cmd.params if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    usage = ["[OPTIONS]", *map(_argument_name, arguments)] + (["COMMAND [ARGS]..."] if _is_group(cmd) else [])
    lines = [f"## {ctx.command_path}", "", f"Usage: `{ctx.command_path} {' '.join(usage)}`"]
    lines += ["", _plain(cmd.help)] if cmd.help else []
    if arguments:
        lines += ["", "| Argument | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for p in arguments:
            name = f"`{_argument_name(p)}`".replace("|", "\\|")
            required = "required" if p.required else _default(p)
            lines.append(f"| {name} | {_type(p)} | {required} | {_cell(getattr(p, 'help', None) or '')} |")
    options = [_option_row(p) for p in params if p.param_type_name == "option"]
    if options:
        lines += ["", "| Option | Type | Default | Description |", "| --- | --- | --- | --- |", *options]
    return [*lines, ""]


def _is_group(command: Any) -> TypeGuard[typer.core.TyperGroup]:
    return isinstance(command, typer.core.TyperGroup)


def _contexts(ctx: typer.Context) -> list[typer.Context]:
    """`ctx` and the contexts of its visible subcommands, depth first, in their declared order."""
    found, group = [ctx], ctx.command
    if _is_group(group):
        for name in group.list_commands(ctx):
            sub = group.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                found += _contexts(typer.Context(sub, info_name=name, parent=ctx))
    return found


def render(app: typer.Typer | None = None, prog: str = "rocketkv") -> str:
    """The Markdown reference of `app` (default: the `rocketkv` app), ending in one newline.

    Deterministic: the same app gives the same text whatever the terminal width or environment."""
    if app is None:
        from . import app as rocketkv_app

        app = rocketkv_app
    contexts = _contexts(typer.Context(typer.main.get_command(app), info_name=prog))
    lines = ["# Command reference", "",
             f"<!-- Generated from the Typer app (rocketkv_cli/cli) by `{REGENERATE}`; do not edit by hand:",
             "     tests/test_cli_reference.py fails when this page is stale. -->", "",
             "Every command, its arguments and options with their types, defaults and help, as",
             "`rocketkv COMMAND --help` prints them. How the commands behave, with examples: [usage.md](usage.md).",
             ""]  # fmt: skip
    for ctx in contexts[1:]:
        anchor = ctx.command_path.replace(" ", "-")
        lines.append(f"- [`{ctx.command_path}`](#{anchor}): {_cell(ctx.command.get_short_help_str(limit=1000))}")
    lines.append("")
    for ctx in contexts:
        lines += _section(ctx)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.buffer.write(render().encode("utf-8"))
