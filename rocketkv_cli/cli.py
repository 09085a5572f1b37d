"""The `rocketkv` command line: parses, prints and maps errors; the work happens in `pipeline`.

stdout carries results only (`--json`: one JSON object per line); stderr carries progress, logs and
hints. Exit codes: 0 ok, 1 known failure (one line), 2 usage error, 130 interrupted (143 SIGTERM).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import __version__
from .cli_bench import bench
from .cli_common import (
    BudgetOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    EncodingOpt,
    JsonOpt,
    ModelOpt,
    PageSizeOpt,
    QuietOpt,
    ScoreDimsOpt,
    SegmentOpt,
    SegmentsOpt,
    SegmentTokensOpt,
    TopkOpt,
    TrustOpt,
    command,
    err,
    load_engine,
    log,
    open_stream,
    prefill,
    prefill_config,
    setup,
)  # fmt: skip
from .cli_eval import eval_command
from .errors import InputError, OutputError

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


@app.command()
@command
def ingest(
    document: Annotated[str, typer.Argument(help="Text file to read, or - for stdin.")],
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Cache file to write (default: DOC with .kv).")
    ] = None,
    budget: BudgetOpt = 512,
    max_new_tokens: Annotated[int, typer.Option(help="Answer length the budget plans for, in tokens.")] = 128,
    window_size: Annotated[int, typer.Option(help="Observation window W in tokens.")] = 32,
    pool_kernel_size: Annotated[str, typer.Option(help="Odd max-pool kernel in tokens, or 'auto'.")] = "63",
    observation: Annotated[
        str, typer.Option(help="'tail' (document end) or 'probe' (+ a generic probe text).")
    ] = "tail",
    prompt_budget: Annotated[Optional[int], typer.Option(help="Override: tokens kept per KV head per layer.")] = None,
    topk: TopkOpt = None,
    page_size: PageSizeOpt = None,
    n_score_dims: ScoreDimsOpt = None,
    chunk_tokens: Annotated[int, typer.Option(help="Prefill chunk length in tokens.")] = 1024,
    segment_tokens: SegmentTokensOpt = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace an existing output file.")] = False,
    encoding: EncodingOpt = "utf-8",
    errors: Annotated[str, typer.Option(help="Decoding errors: strict, replace or ignore.")] = "strict",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Prefill a document once, prune its KV cache with SnapKV++, and save it to a .kv file.

    A document longer than the model's context is ingested in segments, each checkpointed beside
    the output: an interrupted ingest continues where it stopped when the same command is rerun.
    """
    from .cache_io import SegmentedKVCache, check_target, load_cache, save_cache, save_segmented
    from .models import DEFAULT_MODEL
    from .segments import Checkpoints

    setup(quiet)
    cfg = prefill_config(
        token_budget=budget, max_new_tokens=max_new_tokens, window_size=window_size, pool_kernel_size=pool_kernel_size,
        observation=observation, prompt_budget=prompt_budget, topk=topk, page_size=page_size,
        n_score_dims=n_score_dims, chunk_tokens=chunk_tokens,
    )  # fmt: skip
    stream = open_stream(document, encoding, errors)
    stream.validate()  # bad documents fail before anything else is touched
    if output is None:
        if document == "-":
            raise OutputError("reading from stdin needs an output file", "pass -o FILE.kv")
        output = Path(document).with_suffix(".kv")
    check_target(output, force)  # fail now, not after a long prefill
    if document != "-" and output.exists() and os.path.samefile(document, output):
        raise OutputError(f"-o {output} is the document itself", "choose another output file")
    engine = load_engine(model or DEFAULT_MODEL, device, dtype or "auto", trust_remote_code)
    checkpoints = Checkpoints(output)
    if checkpoints.count():
        log(f"resuming: found {checkpoints.count()} checkpointed segments in {checkpoints.dir} (reused if they match)")
    stored, elapsed = prefill(engine, stream, cfg, segment_tokens, checkpoints)
    if isinstance(stored, SegmentedKVCache):
        save_segmented(stored.segments, stored.metadata, output, force=force)
        load_cache(output)  # the checkpoints go only once the file reads back whole
    else:
        save_cache(stored, output, force=force)
    checkpoints.remove()
    log(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB)")
    if json_out:
        n_segments = len(stored.segments) if isinstance(stored, SegmentedKVCache) else 1
        row = {"cache": str(output), "n_context_tokens": stored.n_context_tokens, "n_segments": n_segments,
               "file_bytes": output.stat().st_size, "ingest_s": round(elapsed, 3),
               "budgets": json.loads(stored.metadata["budgets"])}  # fmt: skip
        typer.echo(json.dumps(row))
    else:
        typer.echo(str(output))


def _questions(positional: list[str], questions_file: Optional[str], doc_is_stdin: bool) -> list[str]:
    questions = list(positional)
    if questions_file is not None:
        if questions_file == "-":
            if doc_is_stdin:
                raise InputError("the document and the questions cannot both come from stdin")
            text = sys.stdin.buffer.read().decode("utf-8-sig", errors="replace")
        else:
            try:
                text = Path(questions_file).read_text(encoding="utf-8-sig")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"cannot read questions file {questions_file}: {exc}") from None
        questions += [line.strip() for line in text.split("\n") if line.strip()]  # only \n ends a question
    if any(not q.strip() for q in questions):
        raise InputError("empty question", "give each question some text")
    for q in questions:
        try:
            q.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError("a question is not valid UTF-8 text", "check the question's encoding") from None
    if not questions:
        raise InputError("no question given", "pass questions as arguments or with --questions-file")
    return questions


def _answer_and_print(engine, stored, source: str, questions, max_new_tokens, dense, overrides, json_out,
                      n_segments: int = 1, segment: Optional[int] = None) -> None:  # fmt: skip
    from .cache_io import SegmentedKVCache
    from .pipeline import answer, decode_config_for, prepare_questions
    from .segments import iter_segment_answers

    planned = json.loads(stored.metadata["config"]).get("max_new_tokens", 128)
    max_new = max_new_tokens or planned

    def decode_for(part):
        try:
            return decode_config_for(part, sparse=not dense, **overrides)
        except ValueError as exc:
            raise InputError(f"invalid option: {exc}") from None

    if isinstance(stored, SegmentedKVCache):
        jobs = list(iter_segment_answers(engine, stored, questions, n_segments, segment))  # route every question
        for question, _, part in jobs:  # then check every question before any is answered
            prepare_questions(engine, part, [question], max_new)
        decodes = [decode_for(part) for _, _, part in jobs]

        def answers():
            for i, ((question, chosen, part), decode) in enumerate(zip(jobs, decodes)):
                log(f"question {i + 1}: answering from segment{'s' * (len(chosen) > 1)} {', '.join(map(str, chosen))}")
                yield next(answer(engine, part, [question], max_new, decode)), chosen

        results = answers()
    elif segment not in (None, 0):
        raise InputError(f"--segment {segment}: this cache has one segment (0)")
    else:
        results = ((ans, None) for ans in answer(engine, stored, questions, max_new, decode_for(stored)))
    for i, (ans, chosen) in enumerate(results):
        if json_out:
            row = {"question": ans.question, "answer": ans.text, "cache": source,
                   "n_question_tokens": ans.n_question_tokens, "n_answer_tokens": ans.n_answer_tokens,
                   "stop_reason": ans.stop_reason, "prefill_s": round(ans.prefill_s, 4),
                   "decode_s": round(ans.decode_s, 4)}  # fmt: skip
            if chosen is not None:
                row["segments"] = chosen
            typer.echo(json.dumps(row, ensure_ascii=False))
        else:
            if len(questions) > 1 and i:
                typer.echo("")
            typer.echo(ans.text)
        sys.stdout.flush()
        log(f"answered in {ans.prefill_s + ans.decode_s:.2f}s ({ans.n_answer_tokens} tokens, stop: {ans.stop_reason})")


def _load_stored(cache: Path, model: Optional[str], device: str, dtype: Optional[str], trust_remote_code: bool):
    from .cache_io import load_cache
    from .pipeline import open_cache

    stored = load_cache(cache)
    engine = load_engine(
        model or stored.metadata["model_id"], device, dtype or stored.metadata["dtype"], trust_remote_code
    )
    open_cache(engine, stored, str(cache))
    return engine, stored


DenseOpt = Annotated[bool, typer.Option("--dense", help="Exact attention over the stored cache (no stage-2 sparsity).")]
MaxNewOpt = Annotated[
    Optional[int], typer.Option(min=1, help="Answer length limit in tokens (default: the cache's plan).")
]


@app.command()
@command
def ask(
    args: Annotated[Optional[list[str]], typer.Argument(help="QUESTION... with --cache; else DOC QUESTION...")] = None,
    cache: CacheOpt = None,
    questions_file: Annotated[
        Optional[str], typer.Option(help="File with one question per line, or - for stdin.")
    ] = None,
    max_new_tokens: MaxNewOpt = None,
    budget: Annotated[
        int, typer.Option("--budget", "-b", help="Token budget when DOC is ingested in memory (a cache keeps its own).")
    ] = 512,
    dense: DenseOpt = False,
    topk: TopkOpt = None,
    page_size: PageSizeOpt = None,
    n_score_dims: ScoreDimsOpt = None,
    segments: SegmentsOpt = 1,
    segment: SegmentOpt = None,
    segment_tokens: SegmentTokensOpt = None,
    encoding: EncodingOpt = "utf-8",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Answer questions from a saved cache (or from DOC, ingested in memory first)."""
    from .models import DEFAULT_MODEL

    setup(quiet)
    args = list(args or [])
    overrides = {"topk": topk, "page_size": page_size, "n_score_dims": n_score_dims}
    if cache is not None:
        questions = _questions(args, questions_file, False)
        engine, stored = _load_stored(cache, model, device, dtype, trust_remote_code)
        source = str(cache)
    else:
        if not args:
            raise InputError(
                "no document or cache given", "use: rocketkv ask --cache FILE.kv QUESTION, or ask DOC QUESTION"
            )
        doc, rest = args[0], args[1:]
        questions = _questions(rest, questions_file, doc == "-")
        cfg = prefill_config(token_budget=budget, max_new_tokens=max_new_tokens or 128, pool_kernel_size="63")
        stream = open_stream(doc, encoding)
        stream.validate()
        engine = load_engine(model or DEFAULT_MODEL, device, dtype or "auto", trust_remote_code)
        stored, _ = prefill(engine, stream, cfg, segment_tokens, scratch_checkpoints())
        source = doc
    _answer_and_print(engine, stored, source, questions, max_new_tokens, dense, overrides, json_out, segments, segment)


@app.command()
@command
def summarize(
    document: Annotated[Optional[str], typer.Argument(help="Text file, or - for stdin (or use --cache).")] = None,
    cache: CacheOpt = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Summary length limit in tokens.")] = 256,
    budget: BudgetOpt = 512,
    dense: DenseOpt = False,
    segment_tokens: SegmentTokensOpt = None,
    encoding: EncodingOpt = "utf-8",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document (or a saved cache's document).

    A document longer than the context is summarized segment by segment (each partial summary is
    shown on stderr), then the summaries are summarized as one text.
    """
    from .models import DEFAULT_MODEL
    from .pipeline import answer, decode_config_for
    from .segments import summarize as summarize_stored

    setup(quiet)
    if (document is None) == (cache is None):
        raise InputError("give either DOC or --cache FILE.kv", "e.g. rocketkv summarize book.txt")
    cfg = prefill_config(token_budget=budget, max_new_tokens=max_new_tokens, pool_kernel_size="63")
    if cache is not None:
        engine, stored = _load_stored(cache, model, device, dtype, trust_remote_code)
        source = str(cache)
    else:
        stream = open_stream(document, encoding)
        stream.validate()
        engine = load_engine(model or DEFAULT_MODEL, device, dtype or "auto", trust_remote_code)
        stored, _ = prefill(engine, stream, cfg, segment_tokens, scratch_checkpoints())
        source = document
    engine.prompt = _without_stop_strings(engine.prompt)
    partials = []

    def summarize_one(part, prompt: str):
        return next(answer(engine, part, [prompt], max_new_tokens, decode_config_for(part, sparse=not dense)))

    def on_partial(event) -> None:
        partials.append({"level": event.level, "segment": event.index, "summary": event.text})
        log(f"summary of part {event.index + 1}/{event.total} (level {event.level}): {event.text}")

    t0 = time.perf_counter()
    final = summarize_stored(engine, stored, cfg, summarize_one, on_partial)
    elapsed = time.perf_counter() - t0
    if json_out:
        row = {"summary": final.text, "source": source, "n_answer_tokens": final.n_answer_tokens,
               "stop_reason": final.stop_reason, "summarize_s": round(elapsed, 3)}  # fmt: skip
        if partials:
            row["partial_summaries"] = partials
        typer.echo(json.dumps(row, ensure_ascii=False))
    else:
        typer.echo(final.text)
    log(f"summarized in {elapsed:.1f}s ({final.n_answer_tokens} tokens, stop: {final.stop_reason})")


def scratch_checkpoints():
    """Checkpoints in a temporary folder (removed at exit), so that a long document ingested in
    memory for `ask DOC` / `summarize DOC` keeps its finished segments on disk, not in RAM."""
    import atexit
    import shutil
    import tempfile

    from .segments import Checkpoints

    folder = tempfile.mkdtemp(prefix="rocketkv-")
    atexit.register(shutil.rmtree, folder, True)
    return Checkpoints(Path(folder) / "memory.kv")


def _without_stop_strings(fmt):
    import dataclasses

    return dataclasses.replace(fmt, stop_strings=("\n\n\n",) if fmt.stop_strings else ())


@app.command()
@command
def inspect(
    cache: Annotated[Path, typer.Argument(help="A .kv file.")],
    json_out: JsonOpt = False,
) -> None:
    """Show what a .kv cache holds (validates the file; does not load the model)."""
    from .cache_io import SegmentedKVCache, full_kv_bytes, load_cache

    stored = load_cache(cache)
    meta = stored.metadata
    parts = stored.segments if isinstance(stored, SegmentedKVCache) else [stored]
    n_ctx = stored.n_context_tokens
    windows = json.loads(meta["layer_windows"])
    elem = parts[0].layers[0][0].element_size()
    n_kv, d = int(meta["n_kv_heads"]), int(meta["head_dim"])
    full_bytes = sum(full_kv_bytes(p.n_context_tokens, windows, n_kv, d, elem) for p in parts)
    kept = [sum(p.layers[i][0].shape[2] for p in parts) for i in range(len(windows))]
    info = {
        "cache": str(cache),
        "file_bytes": cache.stat().st_size,
        "full_kv_bytes": full_bytes,
        "kv_bytes": sum(2 * n_kv * k * d * elem for k in kept),
        "kept_tokens_per_layer": kept,
        "n_full_attention_layers": sum(1 for w in windows if not w),
        "n_segments": len(parts),
        **{k: v for k, v in meta.items() if k not in ("config", "budgets", "layer_windows", "segments")},
        "config": json.loads(meta["config"]),
        "budgets": json.loads(meta["budgets"]),
        "layer_windows": windows,
    }
    if len(parts) > 1:
        info["segments"] = json.loads(meta["segments"])
    for key in ("format_version", "n_layers", "n_kv_heads", "head_dim", "n_context_tokens"):
        info[key] = int(info[key])
    if json_out:
        typer.echo(json.dumps(info))
        return
    full_kept = sorted({k for k, w in zip(kept, windows) if not w})
    n_full = info["n_full_attention_layers"]
    sliding = f"; {len(windows) - n_full} sliding-window layers keep their last {max(w or 0 for w in windows)}"
    per = " (all segments)" if len(parts) > 1 else ""
    lines = [
        ("cache", info["cache"]),
        ("format", f"{meta['format']} v{meta['format_version']} (rocketkv {meta['rocketkv_version']})"),
        ("model", f"{meta['model_id']} (digest {meta['model_digest'][:12]})"),
        ("dtype", meta["dtype"]),
        ("document", f"{meta.get('document_source', '?')} (sha256 {meta['document_sha256'][:12]})"),
        ("context tokens", str(n_ctx)),
    ]
    if len(parts) > 1:
        sizes = [p.n_context_tokens for p in parts]
        lines.append(("segments", f"{len(parts)} (0-{len(parts) - 1}), {min(sizes)}-{max(sizes)} tokens each"))
    lines += [
        ("kept per KV head", f"{', '.join(map(str, full_kept)) or '-'} of {n_ctx} tokens{per} in "
         f"{n_full} full-attention layers" + (sliding if n_full < len(windows) else "")),
        ("budgets", ", ".join(f"{k}={v}" for k, v in info["budgets"].items())),
        ("config", ", ".join(f"{k}={v}" for k, v in info["config"].items() if v is not None)),
        ("size", f"file {info['file_bytes'] / 1e6:.2f} MB; KV {info['kv_bytes'] / 1e6:.2f} MB = "
                 f"{info['kv_bytes'] / max(full_bytes, 1):.1%} of the full KV ({full_bytes / 1e6:.2f} MB)"),
        ("prompt template", meta["prompt_template_id"]),
        ("created", meta["created_at"]),
    ]  # fmt: skip
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        typer.echo(f"{k:<{width}}  {v}")


app.command()(command(bench))
app.command(name="eval")(command(eval_command))


def run() -> None:
    """Console-script entry point. Ctrl-C inside a command exits 130 (see `cli_common.command`);
    this guard only covers the moments before Typer takes over (imports)."""
    try:
        app()
    except KeyboardInterrupt:
        err.print("[bold red]Error:[/bold red] interrupted")
        sys.exit(130)


if __name__ == "__main__":
    run()
