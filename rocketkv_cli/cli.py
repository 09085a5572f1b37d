"""The `rocketkv` command line: parses, prints and maps errors; the work happens in `pipeline`.

stdout carries results only (`--json`: one JSON object per line); stderr carries progress, logs and
hints. Exit codes: 0 ok, 1 known failure (one line), 2 usage error, 130 interrupted (143 SIGTERM).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from . import __version__
from .errors import InputError, OutputError, RocketKVError

app = typer.Typer(
    name="rocketkv",
    help="Ask questions of very long documents with a local LLM and a compressed (RocketKV) KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False)
_quiet = False


class _Terminated(BaseException):
    """Raised by the SIGTERM handler so that cleanup (`finally`) runs before exit 143."""


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through subprocess tests
    raise _Terminated()


def _log(message: str) -> None:
    if not _quiet:
        err.print(f"[dim]rocketkv:[/dim] {message}")


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]Error:[/bold red] {message}", soft_wrap=True)
    return typer.Exit(code)


def command(fn):
    """Wrap a command body: known errors → one line + exit 1; Ctrl-C → 130; SIGTERM → 143."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return fn(*args, **kwargs)
        except RocketKVError as exc:
            raise _fail(str(exc)) from None
        except KeyboardInterrupt:
            raise _fail("interrupted", 130) from None
        except _Terminated:
            raise _fail("terminated", 143) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except MemoryError:
            raise _fail("out of memory — try a smaller --chunk-tokens or --budget, or a shorter document") from None
        except Exception as exc:  # unexpected: still one line unless debugging
            if os.environ.get("ROCKETKV_DEBUG") == "1":
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise _fail(f"unexpected {type(exc).__name__}: {first} — rerun with ROCKETKV_DEBUG=1 for a traceback") from None

    return wrapper


ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="Preset (gemma-3-270m, smollm2-135m), model dir, .gguf file, or cached hub id."),
]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16 (ask: default = the cache's).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs on stderr.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")]
TrustOpt = Annotated[bool, typer.Option(help="Allow model code from the model directory (off by default).")]


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)


def _setup(quiet: bool) -> None:
    global _quiet
    _quiet = quiet
    if quiet:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if quiet or not err.is_terminal:
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _engine(model: str, device: str, dtype: str, trust_remote_code: bool):
    from .models import load_model
    from .pipeline import Engine

    t0 = time.perf_counter()
    with err.status(f"loading {model}", spinner="dots") if err.is_terminal and not _quiet else contextlib.nullcontext():
        loaded = load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=_log)
    _log(f"loaded {loaded.model_id} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}) in {time.perf_counter() - t0:.1f}s")
    return Engine(loaded)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tokens"),
        TimeRemainingColumn(),
        console=err,
        disable=_quiet or not err.is_terminal,
        transient=True,
    )


def _read(doc_path: str, encoding: str, errors: str = "strict"):
    from .ingest import read_document

    return read_document(doc_path, encoding=encoding, errors=errors)


def _prefill(engine, document, prefill_cfg):
    from .pipeline import prefill_document

    t0 = time.perf_counter()
    with _progress() as bar:
        task = bar.add_task("prefill", total=None)
        stored = prefill_document(
            engine, document, prefill_cfg, progress=lambda done, total: bar.update(task, completed=done, total=total)
        )
    elapsed = time.perf_counter() - t0
    kept = max(layer[0].shape[2] for layer in stored.layers)
    _log(f"prefilled {stored.n_context_tokens} tokens in {elapsed:.1f}s; keeping up to {kept} tokens per KV head per layer")
    return stored, elapsed


def _prefill_config(**kw):
    from .config import PrefillConfig

    pool = kw.pop("pool_kernel_size")
    if pool == "auto":
        kw["pool_kernel_size"] = 0
    else:
        try:
            kw["pool_kernel_size"] = int(pool)
        except ValueError:
            raise InputError(f"--pool-kernel-size must be an odd integer or 'auto', got {pool!r}") from None
    try:
        return PrefillConfig(**{k: v for k, v in kw.items() if v is not None})
    except ValueError as exc:
        raise InputError(f"invalid option: {exc}") from None


BudgetOpt = Annotated[int, typer.Option("--budget", "-b", help="Token budget t per KV head per layer (SPEC §3.1).")]


@app.command()
@command
def ingest(
    document: Annotated[str, typer.Argument(help="Text file to read, or - for stdin.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Cache file to write (default: DOC with .kv).")] = None,
    budget: BudgetOpt = 512,
    max_new_tokens: Annotated[int, typer.Option(help="Answer length the budget plans for, in tokens.")] = 128,
    window_size: Annotated[int, typer.Option(help="Observation window W in tokens.")] = 32,
    pool_kernel_size: Annotated[str, typer.Option(help="Odd max-pool kernel in tokens, or 'auto'.")] = "63",
    observation: Annotated[str, typer.Option(help="'tail' (document end) or 'probe' (+ a generic probe text).")] = "tail",
    prompt_budget: Annotated[Optional[int], typer.Option(help="Override: tokens kept per KV head per layer.")] = None,
    topk: Annotated[Optional[int], typer.Option(help="Override: tokens attended per decode step.")] = None,
    page_size: Annotated[Optional[int], typer.Option(help="Override: tokens per min/max page.")] = None,
    n_score_dims: Annotated[Optional[int], typer.Option(help="Override: head dims used for page scores.")] = None,
    chunk_tokens: Annotated[int, typer.Option(help="Prefill chunk length in tokens.")] = 1024,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace an existing output file.")] = False,
    encoding: Annotated[str, typer.Option(help="Text encoding of the document.")] = "utf-8",
    errors: Annotated[str, typer.Option(help="Decoding errors: strict, replace or ignore.")] = "strict",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Prefill a document once, prune its KV cache with SnapKV++, and save it to a .kv file."""
    from .cache_io import save_cache
    from .models import DEFAULT_MODEL

    _setup(quiet)
    cfg = _prefill_config(
        token_budget=budget, max_new_tokens=max_new_tokens, window_size=window_size, pool_kernel_size=pool_kernel_size,
        observation=observation, prompt_budget=prompt_budget, topk=topk, page_size=page_size,
        n_score_dims=n_score_dims, chunk_tokens=chunk_tokens,
    )  # fmt: skip
    if output is None:
        if document == "-":
            raise OutputError("reading from stdin needs an output file", "pass -o FILE.kv")
        output = Path(document).with_suffix(".kv")
    if (output.exists() or output.is_symlink()) and not force:
        raise OutputError(f"{output} already exists", "pass --force to replace it")
    if not output.parent.is_dir():
        raise OutputError(f"output directory {output.parent} does not exist", f"create it first: mkdir -p {output.parent}")
    doc = _read(document, encoding, errors)
    engine = _engine(model or DEFAULT_MODEL, device, dtype or "auto", trust_remote_code)
    stored, elapsed = _prefill(engine, doc, cfg)
    save_cache(stored, output, force=force)
    _log(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB)")
    if json_out:
        row = {"cache": str(output), "n_context_tokens": stored.n_context_tokens, "file_bytes": output.stat().st_size,
               "ingest_s": round(elapsed, 3), "budgets": json.loads(stored.metadata["budgets"])}  # fmt: skip
        typer.echo(json.dumps(row))
    else:
        typer.echo(str(output))


def _questions(positional: list[str], questions_file: Optional[str], doc_is_stdin: bool) -> list[str]:
    questions = list(positional)
    if questions_file is not None:
        if questions_file == "-":
            if doc_is_stdin:
                raise InputError("the document and the questions cannot both come from stdin")
            text = sys.stdin.read()
        else:
            try:
                text = Path(questions_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"cannot read questions file {questions_file}: {exc}") from None
        questions += [line.strip() for line in text.splitlines() if line.strip()]
    if any(not q.strip() for q in questions):
        raise InputError("empty question", "give each question some text")
    if not questions:
        raise InputError("no question given", "pass questions as arguments or with --questions-file")
    return questions


def _answer_and_print(engine, stored, source: str, questions, max_new_tokens, dense, overrides, json_out) -> None:
    from .pipeline import answer, decode_config_for

    planned = json.loads(stored.metadata["config"]).get("max_new_tokens", 128)
    max_new = max_new_tokens or planned
    decode = decode_config_for(stored, sparse=not dense, **overrides)
    for i, ans in enumerate(answer(engine, stored, questions, max_new, decode)):
        if json_out:
            row = {"question": ans.question, "answer": ans.text, "cache": source,
                   "n_question_tokens": ans.n_question_tokens, "n_answer_tokens": ans.n_answer_tokens,
                   "stop_reason": ans.stop_reason, "prefill_s": round(ans.prefill_s, 4),
                   "decode_s": round(ans.decode_s, 4)}  # fmt: skip
            typer.echo(json.dumps(row, ensure_ascii=False))
        else:
            if len(questions) > 1 and i:
                typer.echo("")
            typer.echo(ans.text)
        sys.stdout.flush()
        _log(f"answered in {ans.prefill_s + ans.decode_s:.2f}s ({ans.n_answer_tokens} tokens, stop: {ans.stop_reason})")


def _load_stored(cache: Path, model: Optional[str], device: str, dtype: Optional[str], trust_remote_code: bool):
    from .cache_io import load_cache
    from .pipeline import open_cache

    stored = load_cache(cache)
    engine = _engine(model or stored.metadata["model_id"], device, dtype or stored.metadata["dtype"], trust_remote_code)
    open_cache(engine, stored, str(cache))
    return engine, stored


DenseOpt = Annotated[bool, typer.Option("--dense", help="Exact attention over the stored cache (no stage-2 sparsity).")]
MaxNewOpt = Annotated[Optional[int], typer.Option(help="Answer length limit in tokens (default: the cache's plan).")]


@app.command()
@command
def ask(
    args: Annotated[Optional[list[str]], typer.Argument(help="QUESTION... with --cache; else DOC QUESTION...")] = None,
    cache: Annotated[Optional[Path], typer.Option("--cache", "-c", help="A .kv file from `rocketkv ingest`.")] = None,
    questions_file: Annotated[Optional[str], typer.Option(help="File with one question per line, or - for stdin.")] = None,
    max_new_tokens: MaxNewOpt = None,
    budget: BudgetOpt = 512,
    dense: DenseOpt = False,
    topk: Annotated[Optional[int], typer.Option(help="Override: tokens attended per decode step.")] = None,
    page_size: Annotated[Optional[int], typer.Option(help="Override: tokens per page.")] = None,
    n_score_dims: Annotated[Optional[int], typer.Option(help="Override: head dims for page scores.")] = None,
    encoding: Annotated[str, typer.Option(help="Text encoding of DOC.")] = "utf-8",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Answer questions from a saved cache (or from DOC, ingested in memory first)."""
    from .models import DEFAULT_MODEL

    _setup(quiet)
    args = list(args or [])
    overrides = {"topk": topk, "page_size": page_size, "n_score_dims": n_score_dims}
    if cache is not None:
        questions = _questions(args, questions_file, False)
        engine, stored = _load_stored(cache, model, device, dtype, trust_remote_code)
        source = str(cache)
    else:
        if not args:
            raise InputError("no document or cache given", "use: rocketkv ask --cache FILE.kv QUESTION, or ask DOC QUESTION")
        doc, rest = args[0], args[1:]
        questions = _questions(rest, questions_file, doc == "-")
        cfg = _prefill_config(token_budget=budget, max_new_tokens=max_new_tokens or 128, pool_kernel_size="63")
        document = _read(doc, encoding)
        engine = _engine(model or DEFAULT_MODEL, device, dtype or "auto", trust_remote_code)
        stored, _ = _prefill(engine, document, cfg)
        source = doc
    _answer_and_print(engine, stored, source, questions, max_new_tokens, dense, overrides, json_out)


@app.command()
@command
def summarize(
    document: Annotated[Optional[str], typer.Argument(help="Text file, or - for stdin (or use --cache).")] = None,
    cache: Annotated[Optional[Path], typer.Option("--cache", "-c", help="A .kv file from `rocketkv ingest`.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Summary length limit in tokens.")] = 256,
    budget: BudgetOpt = 512,
    dense: DenseOpt = False,
    encoding: Annotated[str, typer.Option(help="Text encoding of DOC.")] = "utf-8",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document (or a saved cache's document)."""
    from .models import DEFAULT_MODEL
    from .templates import read_prompt

    _setup(quiet)
    if (document is None) == (cache is None):
        raise InputError("give either DOC or --cache FILE.kv", "e.g. rocketkv summarize book.txt")
    if cache is not None:
        engine, stored = _load_stored(cache, model, device, dtype, trust_remote_code)
        source = str(cache)
    else:
        cfg = _prefill_config(token_budget=budget, max_new_tokens=max_new_tokens, pool_kernel_size="63")
        doc = _read(document, encoding)
        engine = _engine(model or DEFAULT_MODEL, device, dtype or "auto", trust_remote_code)
        stored, _ = _prefill(engine, doc, cfg)
        source = document
    engine.prompt = _without_stop_strings(engine.prompt)
    _answer_and_print(engine, stored, source, [read_prompt("summarize.txt")], max_new_tokens, dense, {}, json_out)


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
    from .cache_io import load_cache

    stored = load_cache(cache)
    meta = stored.metadata
    n_ctx = stored.n_context_tokens
    kept = [layer[0].shape[2] for layer in stored.layers]
    windows = json.loads(meta["layer_windows"])
    elem = stored.layers[0][0].element_size()
    n_kv, d = int(meta["n_kv_heads"]), int(meta["head_dim"])
    full_bytes = sum(2 * n_kv * (min(n_ctx, w) if w else n_ctx) * d * elem for w in windows)
    info = {
        "cache": str(cache),
        "file_bytes": cache.stat().st_size,
        "full_kv_bytes": full_bytes,
        "kv_bytes": sum(2 * n_kv * k * d * elem for k in kept),
        "kept_tokens_per_layer": kept,
        "n_full_attention_layers": sum(1 for w in windows if not w),
        **{k: v for k, v in meta.items() if k not in ("config", "budgets", "layer_windows")},
        "config": json.loads(meta["config"]),
        "budgets": json.loads(meta["budgets"]),
        "layer_windows": windows,
    }
    if json_out:
        typer.echo(json.dumps(info))
        return
    full_kept = sorted({k for k, w in zip(kept, windows) if not w})
    lines = [
        ("cache", info["cache"]),
        ("format", f"{meta['format']} v{meta['format_version']} (rocketkv {meta['rocketkv_version']})"),
        ("model", f"{meta['model_id']} (digest {meta['model_digest'][:12]})"),
        ("dtype", meta["dtype"]),
        ("document", f"{meta.get('document_source', '?')} (sha256 {meta['document_sha256'][:12]})"),
        ("context tokens", str(n_ctx)),
        ("kept per KV head", f"{', '.join(map(str, full_kept)) or '-'} in {info['n_full_attention_layers']} full-attention layers; "
                             f"{len(windows) - info['n_full_attention_layers']} sliding-window layers keep their window"),
        ("budgets", ", ".join(f"{k}={v}" for k, v in info["budgets"].items())),
        ("config", ", ".join(f"{k}={v}" for k, v in info["config"].items())),
        ("size", f"file {info['file_bytes'] / 1e6:.2f} MB; KV {info['kv_bytes'] / 1e6:.2f} MB vs full KV {full_bytes / 1e6:.2f} MB "
                 f"({info['kv_bytes'] / max(full_bytes, 1):.1%})"),
        ("prompt template", meta["prompt_template_id"]),
        ("created", meta["created_at"]),
    ]  # fmt: skip
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        typer.echo(f"{k:<{width}}  {v}")


def _default_source() -> Optional[Path]:
    for base in (Path.cwd(), *Path.cwd().parents):
        candidate = base / "shared" / "data" / "kjv.txt"
        if candidate.is_file():
            return candidate
    return None


@app.command()
@command
def bench(
    context_tokens: Annotated[str, typer.Option(help="Comma-separated document lengths in tokens.")] = "4096,8192",
    budget: BudgetOpt = 512,
    source: Annotated[Optional[Path], typer.Option(help="Real text to cut documents from (default: shared/data/kjv.txt above the current directory).")] = None,
    steps: Annotated[int, typer.Option(help="Decode steps timed (median), after 4 warm-up steps.")] = 24,
    memory: Annotated[bool, typer.Option(help="Measure peak memory of ask vs full attention in child processes.")] = True,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write all results, configuration and versions here.")] = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Measure ingest, file size, time to first token, decode latency and memory vs full attention."""
    import tempfile

    from rich.table import Table

    from .bench import bench_one, machine_info
    from .config import PrefillConfig
    from .models import DEFAULT_MODEL

    _setup(quiet)
    try:
        lengths = [int(x) for x in context_tokens.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--context-tokens must be comma-separated integers, got {context_tokens!r}") from None
    if not lengths or min(lengths) < 64:
        raise InputError(f"--context-tokens must be at least 64 tokens each, got {context_tokens!r}")
    src = source or _default_source()
    if src is None:
        raise InputError("no source text found", "pass --source FILE (e.g. ../shared/data/kjv.txt)")
    text = _read(str(src), "utf-8").text
    cfg = _prefill_config(token_budget=budget, pool_kernel_size="63")
    engine = _engine(model or DEFAULT_MODEL, device, dtype or "auto", False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rocketkv-bench-") as tmp:
        for n in lengths:
            row = bench_one(engine, text, n, cfg, Path(tmp), steps=steps, measure_memory=memory, log=_log)
            rows.append(row)
            typer.echo(json.dumps({"model": engine.loaded.model_id, **row}))
    table = Table(title=f"rocketkv bench: {engine.loaded.model_id}, budget {budget}, {machine_info()['threads']} threads")
    for col in ("context", "ingest s", "tok/s", "file/full KV", "TTFT file s", "TTFT full s", "TTFT ×",
                "decode ms HSA", "decode ms full", "decode ×", "of ideal", "peak RSS ask/full"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["context_tokens"]), f"{r['ingest_s']:.1f}", f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['file_vs_full_kv']:.2f}", f"{r['ttft_from_file_s']:.2f}", f"{r['ttft_full_reprefill_s']:.1f}",
            f"{r['ttft_speedup']:.1f}", f"{r['decode_step_hsa_s'] * 1e3:.1f}", f"{r['decode_step_full_s'] * 1e3:.1f}",
            f"{r['decode_speedup']:.2f}", f"{r['decode_speedup_fraction_of_ideal']:.0%}",
            f"{r['peak_rss_ratio']:.2f}" if "peak_rss_ratio" in r else "-",
        )  # fmt: skip
    if not quiet:
        Console(stderr=True, width=max(err.width, 170), highlight=False).print(table)
    if json_path is not None:
        report = {"machine": machine_info(), "model": engine.loaded.model_id, "device": str(engine.loaded.device),
                  "dtype": str(engine.loaded.dtype).removeprefix("torch."), "config": cfg.to_dict(),
                  "source": str(src), "rows": rows}  # fmt: skip
        json_path.write_text(json.dumps(report, indent=2))
        _log(f"wrote {json_path}")


def run() -> None:
    """Console-script entry point (Ctrl-C outside a command body still exits 130, quietly)."""
    try:
        app()
    except KeyboardInterrupt:
        err.print("[bold red]Error:[/bold red] interrupted")
        sys.exit(130)


if __name__ == "__main__":
    run()
