"""The `rocketkv` command line: one small module per command, each parsing its options, calling
the Python API (`rocketkv_cli.engine.api`), printing, and mapping errors (`common.command`).

stdout carries results only (`--json`: one JSON object per line); stderr carries progress, logs and
hints. Exit codes: 0 ok, 1 known failure (one line), 2 usage error, 130 interrupted (143 SIGTERM).
"""

from __future__ import annotations

from typing import Annotated

import typer

from .. import __version__
from .ask import ask_command
from .batch import batch_command
from .batch import with_bare_ray as with_bare_ray  # used by the console script (entry.main)
from .bench import bench
from .common import command
from .eval import eval_command
from .ingest import ingest_command
from .inspect import inspect_command
from .summarize import summarize_command

app = typer.Typer(
    name="rocketkv",
    help="Ask questions of very long documents with a local LLM and a compressed (RocketKV) KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit(0)


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Ask questions of very long documents with a local LLM and a compressed (RocketKV) KV cache."""


app.command(name="ingest")(command(ingest_command))
app.command(name="ask")(command(ask_command))
app.command(name="summarize")(command(summarize_command))
app.command(name="inspect")(command(inspect_command))
app.command(name="bench")(command(bench))
app.command(name="eval")(command(eval_command))
app.command(name="batch")(command(batch_command))


def run() -> None:
    """The command line with rocketkv's signal handling (the console script itself is
    `rocketkv_cli.entry:main`, which installs that handling before this module is imported)."""
    from ..entry import main as entry_main

    entry_main()
