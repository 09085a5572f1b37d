"""`rocketkv bench`: the command (the measurements are in `bench.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..errors import InputError, UsageError
from .common import (
    StderrConsole,
    default_kjv,
    err,
    load_engine,
    log,
    prefill_config,
    print_row,
    setup,
    steps_bar,
    storage,
)
from .eval import check_report_path, write_report
from .options import DeviceOpt, DtypeOpt, KvDtypeOpt, ModelOpt, QuietOpt, ThreadsOpt, WeightsOpt, path_value

if TYPE_CHECKING:
    from ..core.config import PrefillConfig


def bench(
    context_tokens: Annotated[
        Optional[str],
        typer.Option(
            help="Comma-separated document lengths in tokens (default 4096,8192, at most what the model fits).",
            show_default=False,
        ),
    ] = None,
    budget: Annotated[
        Optional[int],
        typer.Option(
            "--budget",
            "-b",
            min=1,
            help="Token budget t per KV head per layer (tokens; default: the "
            "model's measured default, as `ingest` uses it: 1024 on the presets, else 512).",
        ),
    ] = None,
    source: Annotated[
        Optional[Path],
        typer.Option(
            parser=path_value,
            help="Real text to cut documents from (default: shared/data/kjv.txt above the current directory).",
        ),
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="Decode steps timed (median), after 4 warm-up steps.")] = 24,
    kv_dtypes: Annotated[
        str,
        typer.Option(help="Also compare these storage types (comma-separated, e.g. int8,int4,int4+hadamard)."),
    ] = "",
    memory: Annotated[
        bool, typer.Option(help="Measure peak memory of ask vs full attention in child processes.")
    ] = True,
    fresh_ask: Annotated[
        bool, typer.Option(help="Time a fresh `rocketkv ask` process (load + question + 32 tokens).")
    ] = True,
    crossover: Annotated[
        str, typer.Option(help="Kept-token sizes at which to time one layer's HSA vs exact attention ('' = skip).")
    ] = "1024,2048,4096,8192,16384,32768",
    llama_cpp: Annotated[
        Optional[str],
        typer.Option(help="A Python with llama-cpp-python: run llama.cpp's state-file path side by side."),
    ] = None,
    kv_dtype: KvDtypeOpt = None,
    json_path: Annotated[
        Optional[Path],
        typer.Option("--json", parser=path_value, help="Write all results, configuration and versions here."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace an existing --json file.")] = False,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    quiet: QuietOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Measure ingest, file size, time to first token, decode latency and memory vs full attention."""
    from ..api.rocketkv import DEFAULT_MODEL
    from ..core.config import default_kv_dtype
    from ..eval.bench import crossover_tokens, machine_info

    setup(quiet, threads)
    check_report_path(json_path, force)  # before minutes of measurement
    if context_tokens is not None and not context_tokens.strip(" ,"):  # `"$UNSET"`: not the defaults, uncapped
        raise UsageError(
            "--context-tokens is empty", "give lengths such as 4096,8192, or leave it out for the defaults"
        )
    plan = bench_plan(context_tokens or DEFAULT_LENGTHS, source, budget, kv_dtypes, kv_dtype, crossover, steps, memory,
                      fresh_ask, llama_cpp)  # fmt: skip
    src, text, cfg = plan.source, plan.text, plan.cfg
    kv_dtype = kv_dtype or default_kv_dtype(model or DEFAULT_MODEL)
    rk = load_engine(model or DEFAULT_MODEL, device, dtype or "auto", False, weights)
    cfg, engine = bench_config(cfg, rk.model_id, budget is not None), rk.engine
    budget = cfg.token_budget
    room = rk.engine.context_limit(128)  # the answer plan and a question
    if context_tokens is None and max(plan.lengths) > room:  # the default lengths: the longest the model fits
        plan = replace(plan, lengths=sorted({min(n, room) for n in plan.lengths}))
        log(f"{rk.model_id} fits {room:,} tokens: timing {', '.join(f'{n:,}' for n in plan.lengths)}")
    if max(plan.lengths) > room:
        raise InputError(f"--context-tokens {max(plan.lengths)} exceeds what {rk.model_id} fits ({room})")
    rows, cross = measure(engine, text, cfg, plan, storage(kv_dtype), budget)
    if not quiet:
        show_tables(rows, cross, f"rocketkv bench: {engine.loaded.model_id}, budget {budget}, "
                    f"{machine_info()['threads']} threads", bool(plan.storages))  # fmt: skip
    if json_path is not None:
        report = {"machine": machine_info(), "model": engine.loaded.model_id, "device": str(engine.loaded.device),
                  "dtype": str(engine.loaded.dtype).removeprefix("torch."), "config": cfg.to_dict(),
                  "source": str(src), "head_dim": engine.shape.head_dim, "n_kv_heads": engine.shape.n_kv_heads,
                  "layer_windows": [spec.sliding_window for spec in engine.shape.layers], "rows": rows,
                  "attention_crossover": cross, "hsa_crossover_tokens": crossover_tokens(cross) if cross else None,
                  "weights": engine.loaded.weights, "kv_dtype": kv_dtype}  # fmt: skip
        write_report(json_path, force, json.dumps(report, indent=2))


DEFAULT_LENGTHS = "4096,8192"


@dataclass(frozen=True)
class BenchPlan:
    """What `bench` measures: document lengths (tokens), the source text, the stage-1 settings
    (before the model's measured defaults are filled in: `bench_config`), extra storage types,
    kept-token sizes of the attention crossover, decode steps timed, the optional phases."""

    lengths: list[int]
    source: Path
    text: str
    cfg: PrefillConfig
    storages: list[str]
    sizes: list[int]
    steps: int
    memory: bool
    fresh_ask: bool
    llama_cpp: Optional[str]


def bench_plan(context_tokens: str, source: Optional[Path], budget: Optional[int], kv_dtypes: str,
               kv_dtype: Optional[str], crossover: str, steps: int, memory: bool, fresh_ask: bool,
               llama_cpp: Optional[str]) -> BenchPlan:  # fmt: skip
    """The options as a `BenchPlan` (with the source text read), checked before the model loads.
    Raises UsageError (a length list that is not integers ≥ 64, an unknown storage type, a
    malformed --crossover), InputError (no source text, or an unreadable one)."""
    from ..api.documents import read_document

    try:
        lengths = [int(x) for x in context_tokens.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--context-tokens must be comma-separated integers, got {context_tokens!r}") from None
    if not lengths or min(lengths) < 64:
        raise UsageError(f"--context-tokens must be at least 64 tokens each, got {context_tokens!r}")
    src = source or default_kjv()
    if src is None:
        raise InputError("no source text found", "pass --source FILE (e.g. ../shared/data/kjv.txt)")
    text = read_document(str(src)).text
    cfg = prefill_config() if budget is None else prefill_config(token_budget=budget)
    storages = [x.strip() for x in kv_dtypes.split(",") if x.strip()]
    for name in [*storages, kv_dtype or "auto"]:
        storage(name)  # an unknown name fails before the model loads
    sizes = _ints("crossover", crossover)
    return BenchPlan(lengths, src, text, cfg, storages, sizes, steps, memory, fresh_ask, llama_cpp)


def measure(engine, text: str, cfg: PrefillConfig, plan: BenchPlan, kv_storage, budget: int):
    """Run `plan` on `engine` over documents cut from `text`: one JSON line on stdout per length as
    it is done, a bar on stderr. Returns (rows, crossover rows)."""
    import tempfile

    from ..eval.bench import QUESTION, attention_crossover, bench_one, build_document, llama_cpp_row
    from ..eval.storage import Probe, storage_rows

    rows: list[dict] = []
    cross: list[dict] = []
    phases = 3 + plan.memory + plan.fresh_ask + bool(plan.llama_cpp)  # bench_one's logged phases per length
    with tempfile.TemporaryDirectory(prefix="rocketkv-bench-") as tmp, steps_bar() as bar:
        task = bar.add_task("bench", total=len(plan.lengths) * phases + bool(plan.sizes))

        def on_phase(message: str) -> None:
            log(message)
            bar.update(task, description=message)
            bar.advance(task)

        for n in plan.lengths:
            row = bench_one(engine, text, n, cfg, Path(tmp), steps=plan.steps, measure_memory=plan.memory,
                            log=on_phase, fresh_ask=plan.fresh_ask, storage=kv_storage)  # fmt: skip
            if plan.llama_cpp:
                on_phase(f"{n} tokens: llama.cpp's state-file path ({plan.llama_cpp})")
                row.update(llama_cpp_row(engine, build_document(engine, text, n), QUESTION, plan.llama_cpp, Path(tmp)))
            if plan.storages:
                row["storage"] = storage_rows(engine, build_document(engine, text, n), cfg, plan.storages,
                                              [Probe(QUESTION)], Path(tmp), log=log)  # fmt: skip
            rows.append(row)
            print_row(bar, json.dumps({"model": engine.loaded.model_id, **row}))
        if plan.sizes:
            on_phase(f"one layer's HSA vs exact attention at {', '.join(map(str, plan.sizes))} kept tokens")
            cross = attention_crossover(engine, tuple(plan.sizes), budget)
    return rows, cross


def show_tables(rows: list[dict], cross: list[dict], title: str, storages: bool) -> None:
    """The results as tables on stderr (wider than the terminal if need be, so that no column is cut)."""
    StderrConsole(width=max(err.width, 170)).print(_main_table(rows, title))
    for r in rows:
        if "llama_cpp_error" in r:
            err.print(f"rocketkv: llama.cpp at {r['context_tokens']} tokens did not run: {r['llama_cpp_error']}",
                      markup=False, soft_wrap=True)  # fmt: skip
    if storages:
        StderrConsole(width=max(err.width, 120)).print(_storage_table(rows))
    if cross:
        StderrConsole(width=max(err.width, 100)).print(_crossover_table(cross))


def _main_table(rows: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("context", "ingest s", "file/full KV", "TTFT file s", "TTFT full s", "decode ms HSA",
                "decode ms exact", "step ×forward", "ms whole store", "ms captured", "decode ms full", "HSA ×exact",
                "HSA ×full", "of ideal", "fresh ask s", "llama.cpp ms", "llama.cpp fresh s",
                "peak RSS ask/full"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        ms = lambda k: f"{r[k] * 1e3:.1f}" if k in r else "-"  # noqa: E731
        table.add_row(
            str(r["context_tokens"]), f"{r['ingest_s']:.1f}", f"{r['file_vs_full_kv']:.3f}",
            f"{r['ttft_from_file_s']:.2f}", f"{r['ttft_full_reprefill_s']:.1f}", ms("decode_step_hsa_s"),
            ms("decode_step_exact_pruned_s"),
            f"{r['direct_step_vs_forward']:.2f}" if "direct_step_vs_forward" in r else "-",
            ms("decode_step_whole_store_s"), ms("decode_step_captured_s"), ms("decode_step_full_s"),
            f"{r['hsa_vs_exact_pruned']:.2f}",
            f"{r['decode_speedup']:.2f}", f"{r['decode_speedup_fraction_of_ideal']:.0%}",
            f"{r['fresh_ask_wall_s']:.2f}" if "fresh_ask_wall_s" in r else "-", ms("llama_cpp_decode_step_s"),
            f"{r['llama_cpp_fresh_wall_s']:.2f}" if "llama_cpp_fresh_wall_s" in r else "-",
            f"{r['peak_rss_ratio']:.2f}" if "peak_rss_ratio" in r else "-",
        )  # fmt: skip
    return table


def _storage_table(rows: list[dict]):
    from rich.table import Table

    table = Table(title="storage types: file size and fidelity vs the float32 cache of the same budget")
    for col in ("context", "storage", "bytes/token", "file/bf16 full KV", "top-1 vs float32", "greedy vs float32"):
        table.add_column(col, justify="right")
    for r in rows:
        for s in r.get("storage", []):
            table.add_row(str(r["context_tokens"]), s["kv_dtype"], f"{s['bytes_per_token']:,.0f}",
                          f"1/{1 / s['file_vs_bf16_full_kv']:.1f}", f"{s['top1_agreement']:.3f}",
                          f"{s['greedy_agreement']:.3f}")  # fmt: skip
    return table


def _crossover_table(rows: list[dict]):
    from rich.table import Table

    table = Table(title="one full-attention layer's decode attention: HSA vs exact (SDPA)")
    for col in ("kept tokens", "topk", "page", "dims", "HSA ms", "exact ms", "HSA speed-up"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["kept_tokens"]), str(r["topk"]), str(r["page_size"]), str(r["n_score_dims"]),
                      f"{r['hsa_s'] * 1e3:.3f}", f"{r['exact_s'] * 1e3:.3f}", f"{r['hsa_speedup']:.2f}")  # fmt: skip
    return table


def _ints(name: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{name} must be comma-separated integers, got {text!r}") from None


def bench_config(cfg: PrefillConfig, model_id: str, budget_given: bool = True) -> PrefillConfig:
    """The stage-1 settings `bench` measures: `cfg` with model `model_id`'s measured defaults filled
    in, as `ingest` would run them (SmolLM2: context reconstruction, pool kernel 7; the presets'
    token budget 1024 unless `--budget` was given, `budget_given`)."""
    from ..core.config import with_preset_defaults

    return with_preset_defaults(cfg, model_id, ["token_budget"] if budget_given else [])
