"""`rocketkv models`: the converted models and downloaded GGUFs kept under $ROCKETKV_HOME, and
their removal (the disk rocketkv uses besides its virtualenv)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from .common import log, setup
from .options import JsonOpt


def human_bytes(n: int) -> str:
    """1,234,567 → "1.2 MB" (powers of 1000, as `du --si` and the README)."""
    if n < 1000:
        return f"{n} B"
    size = n / 1000
    for unit in ("KB", "MB"):
        if size < 1000:
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def models_command(
    remove: Annotated[
        Optional[list[str]],
        typer.Option(
            "--remove",
            metavar="NAME",
            help="Remove a model: a preset (its converted copy and GGUF), a name from the list, or all. "
            "Repeatable. A removed preset is converted again on its next use.",
        ),
    ] = None,
    json_out: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No logs on stderr.")] = False,
) -> None:
    """List the models rocketkv converted or downloaded, with their size on disk, or remove some.

    They live in $ROCKETKV_HOME (default ~/.cache/rocketkv): models/ holds the safetensors copies
    loaded on every run, downloads/ the GGUF files they were made from, prepared/ the int4 LM
    heads that --weights head-int4 (Gemma's default) computes once per model and torch version.
    """
    from ..api.home import home, remove_models, stored_models  # torch-free: a listing answers at once

    setup(quiet)
    if remove:
        removed = remove_models(remove)
        for m in removed:
            if json_out:
                typer.echo(json.dumps({**m.to_dict(), "removed": True}))
            else:
                typer.echo(f"removed {m.path} ({human_bytes(m.n_bytes)})")
        log(f"freed {human_bytes(sum(m.n_bytes for m in removed))}")
        return
    stored = stored_models()
    if json_out:
        for m in stored:
            typer.echo(json.dumps(m.to_dict()))
        return
    if not stored:
        log(f"no converted models in {home()}")
        return
    width = max(4, *(len(m.name) for m in stored))
    typer.echo(f"{'NAME':<{width}}  {'KIND':<9}  {'PRESET':<12}  {'SIZE':>8}")
    for m in stored:
        typer.echo(f"{m.name:<{width}}  {m.kind:<9}  {m.preset or '-':<12}  {human_bytes(m.n_bytes):>8}")
    log(f"{human_bytes(sum(m.n_bytes for m in stored))} in {home()}; remove with: rocketkv models --remove NAME")
