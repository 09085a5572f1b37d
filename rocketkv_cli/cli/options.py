"""The command line's option types (`Annotated` Typer options shared by the commands) and the
checks made as they are parsed (exit 2, before any model loads). Standard library, Typer and
the torch-free `core.config` only."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..core.config import DEFAULT_WINDOW_SIZE
from ..errors import UsageError


def path_text(value: str) -> str:
    """A path given on the command line (`parser=` of its option), refused when empty (exit 2): an
    empty string would otherwise become the current folder (`Path("")` is `.`), as `"$UNSET"` does.
    Raises typer.BadParameter."""
    if not value:
        raise typer.BadParameter("is empty: give a path")
    return value


def path_value(value: str) -> Path:
    """`path_text` as a `Path` (`parser=` of a `Path` option). Raises typer.BadParameter."""
    return Path(path_text(value))


ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        "-m",
        metavar="MODEL",
        help="Preset (gemma-3-270m, smollm2-135m), model dir, .gguf file, or cached hub id.",
    ),  # fmt: skip
]
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")  # model.loading.DTYPES and auto (cli/ loads no torch)


def _check_device(value: str) -> str:
    """--device is checked as it is parsed (exit 2, before any model loads)."""
    if not re.fullmatch(r"cpu|auto|cuda(:[0-9]+)?", value):
        raise typer.BadParameter(f"{value!r} is not cpu, cuda, cuda:N or auto")
    return value


def _check_dtype(value: Optional[str]) -> Optional[str]:
    """--dtype is checked as it is parsed (exit 2, before any model loads)."""
    if value is not None and value not in MODEL_DTYPES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(MODEL_DTYPES)}")
    return value


DeviceOpt = Annotated[str, typer.Option(metavar="DEVICE", callback=_check_device, help="cpu, cuda, cuda:N or auto.")]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option(metavar="DTYPE", callback=_check_dtype,
                 help="auto, float32, bfloat16 or float16 (ask: default = the cache's)."),
]  # fmt: skip
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs on stderr.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")]
TrustOpt = Annotated[bool, typer.Option(help="Allow model code from the model directory (off by default).")]
ThreadsOpt = Annotated[
    Optional[int],
    typer.Option("--threads", min=1, metavar="N",
                 help="Threads to compute with (default: $ROCKETKV_THREADS, else the cores this process may use "
                      "less those other processes keep busy)."),
]  # fmt: skip
ServerOpt = Annotated[
    Optional[str],
    typer.Option("--server", metavar="URL",
                 help="Answer through this rocketkv server (unix:/path or http://host:port; default: "
                      "$ROCKETKV_SERVER, else the one on $ROCKETKV_HOME/serve.sock if it is running)."),
]  # fmt: skip
NoServerOpt = Annotated[bool, typer.Option("--no-server", help="Answer in this process even if a server is running.")]


def one_of(allowed: str) -> Callable[[Optional[str]], Optional[str]]:
    """A callback that checks an option's value as it is parsed (exit 2, before any model loads)
    against the tuple named `allowed` in `core.config` (read only then: no torch at parse time)."""

    def check(value: Optional[str]) -> Optional[str]:
        from ..core import config

        choices = getattr(config, allowed)
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check


WeightsOpt = Annotated[
    Optional[str],
    typer.Option(callback=one_of("WEIGHT_FORMATS"),
                 help="Weights for decode on CPU: float, head-bf16 (float layers, bfloat16 LM head ranking), "
                      "head-int4 (float layers, int4 LM head ranking, greedy tokens certified equal to float's), "
                      "mlp-bf16 (head-int4 with bfloat16 MLP linears), "
                      "bf16, int8 or int4 (int8/int4 also prefill). Default: the model's measured choice; "
                      "ask: the cache's int8/int4."),
]  # fmt: skip

KvDtypeOpt = Annotated[
    Optional[str],
    typer.Option(help="Stored keys/values: int8, int4, float32, bfloat16, float16, or auto (as the model "
                 "computes them); integers take +rope (keys quantized before RoPE) and +sinksN (N float16 sink "
                 "tokens, default 4); int4 takes +alloc (each key channel 2-8 bits, 4 on average, by the "
                 "document's queries). Default: int4 for smollm2-135m, int8 otherwise "
                 "(measured: docs/storage.md)."),
]  # fmt: skip
DocBudgetOpt = Annotated[  # ask/chat: applies to a DOC ingested in memory; a cache keeps its own budget
    Optional[int],
    typer.Option("--budget", "-b", metavar="T",
                 help="Token budget when DOC is ingested in memory (default as `ingest`'s; a cache keeps its own)."),
]  # fmt: skip
BudgetOpt = Annotated[
    Optional[int],
    typer.Option("--budget", "-b", metavar="T", help="Token budget t per KV head per layer (tokens; default: the "
                 "model's measured one, 1024 on both presets (docs/frontier.md); 512 for other models)."),
]  # fmt: skip
SummaryBudgetOpt = Annotated[  # at least the observation window, which stage 1 always keeps (no --window-size here)
    int,
    typer.Option("--budget", "-b", min=DEFAULT_WINDOW_SIZE, metavar="T",
                 help="Token budget t per KV head per layer (tokens) of what summarize ingests in memory: a DOC "
                      "the model writes from (--write-from document) and the part summaries it condenses. "
                      "Default 512, the budget docs/summaries.md measured (not ingest's preset default)."),
]  # fmt: skip
TopkOpt = Annotated[Optional[int], typer.Option(min=1, help="Override: tokens attended exactly per decode step.")]
PageSizeOpt = Annotated[Optional[int], typer.Option(min=1, help="Override: tokens per key min/max page.")]
ScoreDimsOpt = Annotated[Optional[int], typer.Option(min=1, help="Override: head dims used for page scores.")]
EncodingOpt = Annotated[str, typer.Option(help="Text encoding of the document.")]
CacheOpt = Annotated[  # parsed as text: an unreadable file gets rocketkv's one-line error, not a usage box
    Optional[Path],
    typer.Option("--cache", "-c", parser=path_value, metavar="FILE.kv", help="A .kv file from `rocketkv ingest`."),
]
ErrorsOpt = Annotated[
    str, typer.Option(help="Decoding errors in the document: strict, replace, ignore or backslashreplace.")
]
SegmentTokensOpt = Annotated[
    Optional[int],
    typer.Option(min=64, help="Tokens per segment for documents longer than the context (default: all that fit)."),
]
SegmentsOpt = Annotated[
    int, typer.Option("--segments", min=1, help="Segmented caches: answer from the N segments that best match.")
]
SegmentOpt = Annotated[
    Optional[int],
    typer.Option("--segment", min=0, help="Segmented caches: answer from segment N (numbered from 0; no routing)."),
]
DenseOpt = Annotated[
    bool,
    typer.Option(
        "--dense",
        help="Exact attention over the stored cache (no stage-2 sparsity; a --store-budget file: over the "
        "question's working set).",
    ),
]
HsaOpt = Annotated[bool, typer.Option("--hsa", help="Stage-2 HSA even where exact attention is faster here.")]
MaxNewOpt = Annotated[
    Optional[int], typer.Option(min=1, metavar="N", help="Answer length limit in tokens (default: the cache's plan).")
]


def method_options(pairs: Optional[list[str]]) -> dict[str, int | float | str]:
    """`--method-option NAME=VALUE` values as a dict, each value an int, a float or else the text.
    Raises UsageError for an item without `=` or a name given twice."""
    out: dict[str, int | float | str] = {}
    for item in pairs or ():
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--method-option must be NAME=VALUE, got {item!r}")
        if name.strip() in out:
            raise UsageError(f"--method-option {name.strip()} is given twice")
        value: int | float | str = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        out[name.strip()] = value
    return out
