"""`rocketkv ingest`: prefill a document once, save its compressed KV cache to a `.kv` file."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from ..methods import registry
from ..signals import Terminated, note_done
from .common import (
    echo_path,
    ingest,
    load_engine,
    log,
    one_line,
    open_stream,
    prefill_config,
    report_abandoned,
    setup,
    storage,
)
from .options import (
    BudgetOpt,
    DeviceOpt,
    DtypeOpt,
    EncodingOpt,
    ErrorsOpt,
    JsonOpt,
    KvDtypeOpt,
    ModelOpt,
    PageSizeOpt,
    QuietOpt,
    ScoreDimsOpt,
    SegmentTokensOpt,
    ThreadsOpt,
    TopkOpt,
    TrustOpt,
    WeightsOpt,
    path_text,
)


def ingest_command(
    document: Annotated[
        str, typer.Argument(metavar="DOCUMENT", parser=path_text, help="Text file to read, or - for stdin.")
    ],
    output: Annotated[  # text, not a Path: a trailing / (a directory) must not be lost
        Optional[str],
        typer.Option("--output", "-o", parser=path_text, help="Cache file to write (default: DOC.kv, e.g. a.txt.kv)."),
    ] = None,
    budget: BudgetOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="Answer length the budget plans for, in tokens.")] = 128,
    window_size: Annotated[int, typer.Option(help="Observation window W in tokens.")] = 32,
    pool_kernel_size: Annotated[
        Optional[str],
        typer.Option(
            help="Odd max-pool kernel in tokens, or 'auto' (default: 63; the model's own, docs/stage1-methods.md)."
        ),  # fmt: skip
    ] = None,
    observation: Annotated[
        Optional[str],
        typer.Option(
            help="Stage-1 method: "
            + "; ".join(f"'{c.observation}': {c.summary}" for c in registry().values() if c.observation)
            + ". Default: tail; the model's own where measured (docs/stage1-methods.md)."
        ),  # fmt: skip
    ] = None,
    store_budget: Annotated[
        Optional[str],
        typer.Option(
            help="Token budget of what the file keeps (>= --budget), or 'all' (every token): each question then "
            "re-selects its --budget working set from it. Default: --budget; the model's own where measured "
            "(docs/frontier.md)."
        ),  # fmt: skip
    ] = None,
    layer_budgets: Annotated[
        Optional[str],
        typer.Option(
            help="'uniform' (every layer keeps the prompt budget) or 'adaptive' (the same total, split over the "
            "layers by where their attention mass is). Default: uniform."
        ),  # fmt: skip
    ] = None,
    method_option: Annotated[
        Optional[list[str]],
        typer.Option(
            metavar="NAME=VALUE",
            help='An option of the stage-1 method\'s own (docs/stage1-methods.md, "Adding a method"); repeatable.',
        ),
    ] = None,
    prompt_budget: Annotated[Optional[int], typer.Option(help="Override: tokens kept per KV head per layer.")] = None,
    topk: TopkOpt = None,
    page_size: PageSizeOpt = None,
    n_score_dims: ScoreDimsOpt = None,
    chunk_tokens: Annotated[int, typer.Option(help="Prefill chunk length in tokens.")] = 1024,
    kv_dtype: KvDtypeOpt = None,
    segment_tokens: SegmentTokensOpt = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace an existing output file.")] = False,
    encoding: EncodingOpt = "utf-8",
    errors: ErrorsOpt = "strict",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Prefill a document once and save its KV cache to a .kv file: 8- or 4-bit, pruned with
    SnapKV++ to --store-budget (the presets keep every token; each question then picks its own
    working set).

    A document longer than the model's context is ingested in segments, each checkpointed beside
    the output: an interrupted ingest continues where it stopped when the same command is rerun.
    """
    from ..api.preflight import check_output, default_output  # no torch: these answer at once
    from ..core.config import DEFAULT_MODEL
    from .options import method_options

    setup(quiet, threads)
    options = dict(
        token_budget=budget, max_new_tokens=max_new_tokens, window_size=window_size, pool_kernel_size=pool_kernel_size,
        observation=observation, prompt_budget=prompt_budget, topk=topk, page_size=page_size,
        n_score_dims=n_score_dims, chunk_tokens=chunk_tokens, store_budget=store_budget, layer_budgets=layer_budgets,
        method_options=method_options(method_option) or None,
    )  # fmt: skip
    explicit = [k for k, v in options.items() if v is not None]  # the preset's measured defaults fill the rest
    cfg = prefill_config(preset=model or DEFAULT_MODEL, **options)  # checked with the preset's defaults
    if kv_dtype is not None:
        storage(kv_dtype)  # an unknown storage fails before the model loads
    stream = open_stream(document, encoding, errors, "ingest")  # bad documents fail before anything else is touched
    # the output is checked (name, directory, permission to write) before the model loads, not after a long prefill
    target = check_output(output if output is not None else default_output(document), force, document)
    report_abandoned(target.parent, skip=target)
    rk = load_engine(model, device, dtype or "auto", trust_remote_code, weights)
    from ..api.files import pending_checkpoints

    count, folder = pending_checkpoints(target)
    if count:
        log(f"resuming: found {count} checkpointed segment{'s' * (count != 1)} in {folder} (reused if they match)")
    try:
        done = ingest(rk, stream, cfg, target, force, segment_tokens, kv_dtype, explicit, count)
    except (KeyboardInterrupt, Terminated):
        try:
            kept, folder = pending_checkpoints(target)
        except Exception:  # noqa: BLE001  (a hint only: the interrupt is what gets reported)
            kept = 0
        if kept:  # the work is not lost: say how to get it back
            log(f"{kept} segment{'s' * (kept != 1)} checkpointed in {folder}: rerun the same command to resume")
        raise
    note_done(f"{target} was written")  # an interrupt from here on says the file is complete
    size = target.stat().st_size
    log(f"wrote {one_line(str(target))} ({size / 1e6:.1f} MB)")
    if json_out:
        from ..api.rocketkv import kept_tokens_per_layer

        cache = done.cache
        row = {"cache": str(target), "n_context_tokens": cache.n_context_tokens, "n_segments": cache.n_segments,
               "file_bytes": size, "ingest_s": round(done.seconds, 3), "budgets": cache.info.budgets_record(),
               "layer_budgets": cfg.layer_budgets, "kept_tokens_per_layer": kept_tokens_per_layer(cache)}  # fmt: skip
        typer.echo(json.dumps(row))
    else:
        echo_path(target)
