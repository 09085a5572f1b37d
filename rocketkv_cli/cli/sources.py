"""Where `ask`, `chat` and `summarize` answer from: a saved `.kv` file (validated, with the options
that depend on it, before the model it names loads) or a document ingested in memory first.

The option-to-request translation shared by those commands lives here (`ModelChoice`,
`open_source`); the checks themselves are the Python API's (`api.checks`, `core.config`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ..core.config import DEFAULT_TOKEN_BUDGET
from .common import Timings, cache_budget_note, ingest, load_engine, log, open_stream, prefill_config, starting

DECODE_OPTIONS = ("dense", "hsa", "topk", "page_size", "n_score_dims")  # checked against a file's budgets


@dataclass(frozen=True)
class ModelChoice:
    """The model options of a command (`--model`, `--device`, `--dtype`, `--weights`,
    `--trust-remote-code`): None = the cache's own (its model, dtype and integer weights)."""

    model: Optional[str]
    device: str
    dtype: Optional[str]
    weights: Optional[str]
    trust_remote_code: bool

    def for_server(self) -> dict:
        """The fields of a server request (`serve.jobs.AskRequest`; `remote.model_for_server` makes
        a model path absolute)."""
        return asdict(self)


@dataclass(frozen=True)
class DocumentReading:
    """How a DOC ingested in memory is read and split (`--encoding`, `--errors`, `--segment-tokens`)."""

    encoding: str = "utf-8"
    errors: str = "strict"
    segment_tokens: Optional[int] = None


def open_cache(cache: Path, choice: ModelChoice, timings: Timings | None = None, cite: int = 0, segments: int = 1,
               decode_options: dict | None = None, command: str = "ask", segment: int | None = None):  # fmt: skip
    """Validate the file (and that it can give `cite` citations, and that `decode_options`, the
    stage-2 overrides, suit its budgets), load the model it was built with (or `choice.model`),
    check they match. Returns (RocketKV, cache). Raises CacheFormatError, InputError, UsageError,
    ModelLoadError. `command`: the rocketkv command it is opened for (`preflight.check_cache_file`)."""
    from ..api.preflight import check_cache_file

    check_cache_file(cache, command)  # a missing or unreadable path fails before torch is imported
    timings = timings or Timings()
    with timings.span("imports (torch, transformers)"), starting():
        from ..api.rocketkv import (
            check_cite,
            check_decode_options,
            check_model_choice,
            check_segment,
            decode_weights_for,
            read_cache,
        )

    with timings.span("cache read + verify"):
        stored = read_cache(cache)
    check_model_choice(stored, choice.model, cache)
    check_segment(stored, segment)
    check_cite(stored, cite, segments)
    check_decode_options(stored, **(decode_options or {}))
    ident = stored.info.identity
    with timings.span("model load"):
        rk = load_engine(choice.model or ident.model_id, choice.device, choice.dtype or stored.info.dtype,
                         choice.trust_remote_code, choice.weights or decode_weights_for(stored))  # fmt: skip
    with timings.span("model identity check"):
        rk.check(stored, str(cache))
    return rk, stored


def memory_config(budget: Optional[int], max_new_tokens: Optional[int]):
    """The `PrefillConfig` of a DOC that `ask` or `chat` ingests in memory: `ingest`'s budget
    (`DEFAULT_TOKEN_BUDGET`, the model's own where measured) and answers planned at 128 tokens
    unless given. Raises UsageError for a bad value."""
    return prefill_config(
        token_budget=DEFAULT_TOKEN_BUDGET if budget is None else budget,
        max_new_tokens=128 if max_new_tokens is None else max_new_tokens,
    )


def ingest_in_memory(document: str, choice: ModelChoice, cfg, reading: DocumentReading,
                     explicit: tuple[str, ...] = ("token_budget", "max_new_tokens"),
                     command: str | None = None):  # fmt: skip
    """DOC (`-`: stdin) ingested in memory with `cfg` (a `PrefillConfig`; the loaded model's
    measured defaults fill the fields not in `explicit`) by the model loaded here; `command`: the
    command whose large DOC gets `in_memory_note` once the document is known to be text.
    Returns (RocketKV, cache). Raises InputError for a bad document (before the model loads)."""
    stream = open_stream(document, reading.encoding, reading.errors, command or "ask")
    if command is not None:
        in_memory_note(document, command)  # after the checks: a cache given as DOC is refused without it
    rk = load_engine(choice.model, choice.device, choice.dtype or "auto", choice.trust_remote_code, choice.weights)
    return rk, ingest(rk, stream, cfg, segment_tokens=reading.segment_tokens, explicit=explicit).cache


IN_MEMORY_NOTE_BYTES = 256 * 1024  # about 64K tokens: minutes of prefill on a CPU


def in_memory_note(document: str, command: str) -> None:
    """Say, before a long prefill, that a large DOC is read in memory and kept nowhere, and how
    to keep it (an ingest, resumable, then --cache): the KJV asked this way read for 76 minutes
    with nothing saved, and Ctrl-C lost it all."""
    try:
        size = os.path.getsize(document) if document != "-" and os.path.isfile(document) else 0
    except OSError:
        return
    if size > IN_MEMORY_NOTE_BYTES:
        name, kept = shlex.quote(document), shlex.quote(os.path.basename(document) + ".kv")  # here, not in its folder
        log(f"note: {document} ({size / 1e6:.1f} MB) is read in memory for this command and not saved; to ask it "
            f"again in seconds, keep its cache once: rocketkv ingest {name} -o {kept} "
            f"(resumable), then rocketkv {command} --cache {kept}")  # fmt: skip


def open_source(document: Optional[str], cache: Optional[Path], choice: ModelChoice, budget: Optional[int],
                options: dict, reading: DocumentReading, timings: Timings | None = None,
                command: str = "ask"):  # fmt: skip
    """The cache to answer from: `cache` opened (`--budget` only noted) or `document` ingested in
    memory. `options`: `RocketKV.ask`'s keyword options (those a file must suit are checked
    before the model loads). Returns (RocketKV, cache, source name for the `--json` records)."""
    if document is None:
        if cache is None:
            raise ValueError("open_source needs a document or a cache")  # the commands check it first
        cache_budget_note(budget, cache)
        decode = {k: options[k] for k in DECODE_OPTIONS if k in options}
        rk, stored = open_cache(cache, choice, timings, cite=options.get("cite", 0),
                                segments=options.get("segments", 1), decode_options=decode,
                                command=command, segment=options.get("segment"))  # fmt: skip
        return rk, stored, str(cache)
    given = ("max_new_tokens",) + (("token_budget",) if budget is not None else ())  # else the model's own budget
    rk, stored = ingest_in_memory(document, choice, memory_config(budget, options.get("max_new_tokens")), reading,
                                  given, command)  # fmt: skip
    return rk, stored, document
