"""`rocketkv inspect`: validate a `.kv` file and show what it holds (no model is loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .common import report_abandoned
from .options import JsonOpt, path_value


def inspect_command(
    cache: Annotated[
        Path, typer.Argument(metavar="CACHE", help="A .kv file.", parser=path_value)
    ],  # unreadable: rocketkv's error
    json_out: JsonOpt = False,
) -> None:
    """Show what a .kv cache holds (validates the file; does not load the model).

    Checkpoint folders of unfinished ingests beside it are reported on stderr, with how to
    resume or remove them."""
    from ..api.preflight import check_cache_file

    check_cache_file(cache, "inspect")  # a missing or unreadable path fails before torch is imported
    from ..api.files import describe

    report_abandoned(cache.parent)
    info = describe(cache)
    if json_out:
        typer.echo(json.dumps(info))
        return
    for key, value in _lines(info):
        typer.echo(f"{key:<16}  {_printable(str(value))}")


def _printable(text: str) -> str:
    """`text` with control characters (a newline or an escape sequence in a file's recorded source
    name) shown escaped, so that each field stays one line and cannot drive the terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _sinks(info: dict) -> str:
    storage = info.get("kv_storage", {})
    kinds = " or ".join(storage.get("sink_dtypes") or ["float16"])
    notes = [f"each head's first {storage['sink_tokens']} tokens in {kinds}"] if storage.get("sink_tokens") else []
    notes += {"rope": ["keys quantized before RoPE"], "hadamard": ["keys Hadamard-rotated"]}.get(
        storage.get("rotation", "none"), []
    )
    if storage.get("key_bits") == "allocated":
        notes.append("key bits allocated per channel, 4 on average")
    return f" ({'; '.join(notes)})" if notes else ""


def _lines(info: dict) -> list[tuple[str, str]]:
    windows, kept = info["layer_windows"], info["kept_tokens_per_layer"]
    n_parts, n_ctx, n_full = info["n_segments"], info["n_context_tokens"], info["n_full_attention_layers"]
    full_kept = sorted({k for k, w in zip(kept, windows) if not w})
    counts = [k for k, w in zip(kept, windows) if not w]
    kept_text = ", ".join(f"{k:,}" for k in full_kept) or "-"
    if info["layer_budgets"] != "uniform" and len(full_kept) > 1:
        mean = sum(counts) / len(counts)
        kept_text = f"{full_kept[0]:,}-{full_kept[-1]:,} (mean {mean:,.0f}; adaptive layer budgets)"
    sliding = f"; {len(windows) - n_full} sliding-window layers keep their last {max(w or 0 for w in windows)}"
    per = " (all segments)" if n_parts > 1 else ""
    full_bytes = info["full_kv_bytes"]
    lines = [
        ("cache", info["cache"]),
        ("format", f"{info['format']} v{info['format_version']} (rocketkv {info['rocketkv_version']})"),
        ("model", f"{info['model_id']} (digest {info['model_digest'][:12]})"),
        # the model's dtype at prefill, not the stored keys' (the next row): "dtype" alone was read as theirs
        (
            "model dtype",
            info["dtype"] + (f", {weights} weights" if (weights := info.get("weights", "float")) != "float" else ""),
        ),
        (
            "storage",
            f"{info['kv_dtype']} keys/values{_sinks(info)}, {info['kv_bytes_per_token']:,.0f} bytes per document token",
        ),
        ("document", f"{info.get('document_source', '?')} (sha256 {info['document_sha256'][:12]})"),
        ("context tokens", f"{n_ctx:,}"),
    ]
    if n_parts > 1:
        sizes = [s["n_context_tokens"] for s in info["segments"]]
        lines.append(("segments", f"{n_parts} (0-{n_parts - 1}), {min(sizes):,}-{max(sizes):,} tokens each"))
    lines += [
        ("kept per KV head", f"{kept_text} of {n_ctx:,} tokens{per} in "
         f"{n_full} full-attention layers" + (sliding if n_full < len(windows) else "")),
    ]  # fmt: skip
    if info["config"].get("store_budget") is not None and max(full_kept, default=0) > info["budgets"]["prompt_budget"]:
        everything = info["config"]["store_budget"] == "all"
        why = "store budget all: nothing pruned before the question, docs/frontier.md" if everything else "store budget"
        lines.append(("per question", f"re-selects {info['budgets']['prompt_budget']:,} of the kept tokens per KV head "
                                      f"with its own queries ({why})"))  # fmt: skip
    lines += [
        ("budgets", ", ".join(f"{k}={v}" for k, v in info["budgets"].items())),
        ("config", ", ".join(f"{k}={v}" for k, v in info["config"].items() if v is not None)),
        ("size", f"file {info['file_bytes'] / 1e6:.2f} MB; KV {info['kv_bytes'] / 1e6:.2f} MB = "
                 f"{info['kv_bytes'] / max(full_bytes, 1):.1%} of the full KV ({full_bytes / 1e6:.2f} MB)"),
        ("prompt template", info["prompt_template_id"]),
        ("created", info["created_at"]),
    ]  # fmt: skip
    return lines
