"""The command line's documentation cannot drift from the command line: docs/cli.md is rendered
from the Typer app (`rocketkv_cli/cli/reference.py`) and must equal a fresh rendering, and every
`rocketkv ...` command line the README shows names commands and options that exist."""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
import typer

from rocketkv_cli.cli import app
from rocketkv_cli.cli.reference import REGENERATE, render

ROOT = Path(__file__).resolve().parents[1]
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
REDIRECTIONS = {">", ">>", "<", ">&", "<&"}
SHELL_WORDS = {"do", "then", "else", "time", "!"}


def test__docs_cli_md__equals_the_reference_rendered_from_the_app():
    committed = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    fresh = render()
    if fresh != committed:
        diff = difflib.unified_diff(committed.splitlines(), fresh.splitlines(), "docs/cli.md", "rendered", lineterm="")
        pytest.fail(f"docs/cli.md is stale: run {REGENERATE}\n" + "\n".join(list(diff)[:40]), pytrace=False)


def test__reference__does_not_depend_on_terminal_width_locale_or_rocketkv_variables(tmp_path):
    env = {**os.environ, "COLUMNS": "31", "LINES": "5", "TERM": "dumb", "LC_ALL": "C", "NO_COLOR": "1",
           "ROCKETKV_THREADS": "3", "ROCKETKV_API_KEY": "k", "ROCKETKV_SERVER": "unix:/nowhere",
           "ROCKETKV_HOME": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "rocketkv_cli.cli.reference"], capture_output=True, env=env,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode("utf-8") == render()


def test__reference__lists_every_command_with_types_defaults_and_plain_help():
    toy = typer.Typer(rich_markup_mode="rich")

    @toy.command()
    def greet(
        name: Annotated[str, typer.Argument(help="Who to greet.")],
        times: Annotated[int, typer.Option("--times", "-n", help="[bold]How[/bold] many times (a|b).")] = 2,
        loud: Annotated[bool, typer.Option("--loud/--quiet", help="Shout.")] = False,
    ) -> None:
        """Say hello.

        [italic]Twice[/italic] by default."""

    @toy.command()
    def part() -> None:
        """Say goodbye."""

    text = render(toy, prog="toy")
    assert (
        "Usage: `toy greet [OPTIONS] NAME`" in text
        and "## toy greet" in text
        and "## toy part" in text
        and "Twice by default." in text
    )
    assert "| `--times`, `-n` | integer | `2` | How many times (a\\|b). |" in text
    assert "| `--loud` / `--quiet` | flag | `--quiet` | Shout. |" in text
    assert "| `NAME` | text | required | Who to greet. |" in text
    assert "[bold]" not in text and "[italic]" not in text
    assert render(toy, prog="toy") == text


def readme_command_lines() -> list[list[str]]:
    """The `rocketkv ...` command lines of README.md's shell blocks and inline code, as words
    (comments, redirections and the shell's own words dropped; one list per command)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:sh|bash|console)\n(.*?)```", readme, re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    lines += re.findall(r"(?<!`)`(rocketkv [^`]+)`", re.sub(r"```.*?```", "", readme, flags=re.S))
    found = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in [*lexer, ";"]:
            if word not in SEPARATORS:
                words.append(word)
                continue
            words = [w for i, w in enumerate(words) if REDIRECTIONS.isdisjoint({w, words[i - 1] if i else ""})]
            while words and words[0] in SHELL_WORDS:
                words.pop(0)
            if words[:1] == ["rocketkv"]:
                found.append(words[1:])
            words = []
    return found


def parse(args: list[str]) -> None:
    """Parse one `rocketkv` command line with click's own parser (no values converted, nothing run).
    Raises click's UsageError subclasses: an unknown command or option, a missing option value."""
    root = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="rocketkv")
    _, rest, _ = root.make_parser(ctx).parse_args(list(args))
    if not rest:
        return
    command = root.get_command(ctx, rest[0])  # type: ignore[attr-defined]
    if command is None:
        raise typer.BadParameter(f"no command {rest[0]!r}")
    sub = typer.Context(command, info_name=rest[0], parent=ctx)
    _, extra, _ = command.make_parser(sub).parse_args(rest[1:])
    if extra:
        raise typer.BadParameter(f"rocketkv {rest[0]}: unexpected arguments {extra}")


def test__readme_command_lines__name_existing_commands_and_options():
    lines = readme_command_lines()
    named = {args[0] for args in lines if args}
    assert {"ingest", "ask", "chat", "summarize", "batch", "serve"} <= named, named
    for args in lines:
        try:
            parse(args)
        except Exception as exc:  # click's UsageError and its subclasses
            pytest.fail(f"README: `rocketkv {shlex.join(args)}`: {exc}", pytrace=False)


def test__readme_line_parser__catches_unknown_options_and_commands():
    with pytest.raises(Exception, match="No such option"):
        parse(["ask", "--cache", "a.kv", "q", "--no-such-option"])
    with pytest.raises(Exception, match="no command"):
        parse(["nosuchcommand"])
    parse(["ask", "--cache", "a.kv", "q", "--cite", "--json"])


def test__options_the_readme_names_in_its_text__exist():
    """Inline code such as `--questions-file F` or `--model` names an option of some command."""
    root = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="rocketkv")
    commands = [root, *(root.get_command(ctx, name) for name in root.list_commands(ctx))]  # type: ignore[attr-defined]
    known = {opt for cmd in commands for p in cmd.params for opt in [*p.opts, *p.secondary_opts]}
    readme = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    named = {span.split()[0] for span in re.findall(r"`(--[a-z][a-z0-9-]*[^`]*)`", readme)}
    assert named, "no option found in the README's text"
    assert named <= known, f"README names options no command has: {sorted(named - known)}"
