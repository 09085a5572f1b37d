#!/usr/bin/env python
"""Regenerate docs/accuracy.md: run `rocketkv eval` on both presets and choose ingest's defaults.

Usage: python scripts/accuracy_report.py [--quick] [--from-json] [--out-dir DIR] [--samples N]
       python scripts/accuracy_report.py --quick --model DIR --context-tokens N --eval-args "..."  # a smoke test
Runs the installed CLI once per preset and task (SmolLM2 at ~4K tokens, Gemma at ~8K, 20 samples
per task, budgets 128–1024, methods full / rocketkv with each observation window / snapkv / hsa /
sink_recent / reconstruct / reselect) and keeps each run's JSON (`docs/bench/accuracy-<preset>-<task>.json`): an
interrupted report resumes at the first missing one when rerun, so it can run in the background.
Every method scores full attention's answer teacher-forced (top-1 agreement, KL, log-prob) and
generates only where it disagrees, which was meant to fit a preset in an hour on an idle 2-core CPU; it does not: `--cost` measured
about 8-9 hours per preset (docs/accuracy.md, "What the full report costs"). Rates
carry Wilson intervals, means bootstrap intervals (95%). `--quick` is a smoke run of the whole
chain (SmolLM2 only, 1K tokens, one sample, one budget) under build/accuracy-quick/: not evidence;
with `--model`, `--context-tokens` and `--eval-args` (passed on to `rocketkv eval`) it runs on any
model, which is how the test suite runs it on a tiny one (tests/test_eval.py).
`--cost` runs the full report's `rocketkv eval` on one sample of two tasks per preset (a
one-question and a four-question task) into `docs/bench/accuracy-cost-<preset>.json` and adds
"What the full report costs" to the page: the measured seconds per sample, split into the
sample's prefill + stage-1 caches and the answers, projected to the full report's 140 samples.
Run it on an otherwise idle machine, or with OMP_NUM_THREADS=1: torch's two threads spin against
any other process on the same 2 cores and decode runs 10-30x slower (seen here).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rocketkv_cli.eval.reports import kept_run, read_json, report_timer, table, write_json, write_text

ROOT = Path(__file__).resolve().parents[1]
ROCKETKV = str(Path(sys.executable).parent / "rocketkv")
FULL = {"smollm2-135m": 4096, "gemma-3-270m": 8192}  # preset: context tokens
COMMON = ["--budgets", "128,256,512,1024", "--methods", "all", "--observations", "tail,probe,wide",
          "--pool-kernels", "63", "--seed", "0"]  # fmt: skip
QUICK = {"smollm2-135m": 1024}
QUICK_COMMON = ["--budgets", "256", "--methods", "all", "--observations", "tail,probe,wide", "--pool-kernels", "63",
                "--seed", "0"]  # fmt: skip
TASKS = ("niah_noise", "niah_text", "multikey", "multivalue", "multiquery", "vt", "fwe")
COST_TASKS = ("niah_noise", "multiquery")  # one question, four questions: what --cost samples
COST_STANDS_FOR = {"niah_noise": 6, "multiquery": 1}  # tasks of the report each cost task stands for (by questions)
FULL_SAMPLES = 20  # per task in the full report
BUDGET_MINUTES = 60  # what a preset's report was to take on 2 cores
DEFAULT_VARIANT = ("tail", "63")  # ingest's defaults before this report: --observation tail --pool-kernel-size 63
MARGIN = 0.02  # a variant must beat the current default by 2 points of mean score to replace it
NEAR_FULL = 0.05  # a budget is "close to full attention" within 5 points of its mean score


def file_label(model: str) -> str:
    """A model's name in file names and headings: a preset's name, or a model directory's last part."""
    return Path(model).name if ("/" in model or model.startswith(".")) else model


def run(model: str, n: int, common: list[str], json_dir: Path, tasks: tuple[str, ...], resume: bool,
        runs: bool = True) -> dict:  # fmt: skip
    """One `rocketkv eval` per task (a finished task's JSON is reused when `resume`), merged.
    `runs=False` (--from-json, --cost): only the JSON already there; a missing one is an error."""
    parts = []
    for task in tasks:
        out = json_dir / f"accuracy-{file_label(model)}-{task}.json"
        cmd = [ROCKETKV, "eval", "--model", model, "--context-tokens", str(n), "--tasks", task, *common, "--json",
               str(out)]  # fmt: skip
        if not resume and runs:
            out.unlink(missing_ok=True)
        parts.append(kept_run(out, cmd, runs, cwd=ROOT))
    return merge(parts)


def merge(parts: list[dict]) -> dict:
    """One report from per-task reports: records concatenated, the summary recomputed, times added."""
    from rocketkv_cli.eval.runner import summarize

    report = dict(parts[0])
    report["records"] = [r for p in parts for r in p["records"]]
    report["samples"] = [s for p in parts for s in p["samples"]]
    report["config"] = {**parts[0]["config"], "tasks": [t for p in parts for t in p["config"]["tasks"]]}
    report["elapsed_s"] = sum(p["elapsed_s"] for p in parts)
    report["summary"] = summarize(report["records"])
    dates = [p["date"] for p in parts if p.get("date")]
    report["date"] = max(dates) if dates else None
    return report


def ci(row: dict, key: str) -> str:
    """`value [low–high]` in percent, for a summary row's mean and its interval."""
    lo, hi = row.get(f"{key}_ci") or (None, None)
    return f"{pct(row[key])} [{pct(lo)}–{pct(hi)}]" if lo is not None else pct(row[key])


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def rows_of(report: dict) -> dict:
    return {(r["task"], r["label"], r["budget"]): r for r in report["summary"]}


def default_label(report: dict) -> str:
    cfg = report["config"]
    many = len(cfg["observations"]) * len(cfg["pool_kernels"]) > 1
    return f"rocketkv[{DEFAULT_VARIANT[0]},{DEFAULT_VARIANT[1]}]" if many else "rocketkv"


def main_table(report: dict, what: str) -> list[str]:
    """Rows tasks + mean; columns full, then rocketkv / snapkv / hsa / sink_recent per budget."""
    cells, cfg = rows_of(report), report["config"]
    cols = [("full", None)] + [(m, t) for t in cfg["budgets"] for m in
                               (default_label(report), "snapkv", "hsa", "sink_recent", "reconstruct",
                                "reselect", "reconstruct_reselect")]  # fmt: skip
    cols = [c for c in cols if any(k[1:] == c for k in cells)]
    head = ["task"] + [label.split("[")[0] if t is None else f"{label.split('[')[0]} t={t}" for label, t in cols]
    rows = [[f"**{task}**" if task == "mean" else task,
             *(ci(cells[(task, *c)], what) if (task, *c) in cells else "-" for c in cols)]
            for task in [*cfg["tasks"], "mean"]]  # fmt: skip
    return table(head, rows, "-" + "r" * len(cols))


def two_level(report: dict) -> list[str]:
    """Per budget t: rocketkv at t and at the store budget (its file), and reselect at t (the
    store budget's file, t's working set), each as mean score (top-1 agreement) and kept tokens."""
    cells, cfg = rows_of(report), report["config"]
    factor, label = cfg.get("store_factor", 2), default_label(report)
    kept = defaultdict(list)
    for r in report["records"]:
        kept[(r["label"], r["budget"])].append(r.get("stored_tokens", r["kept_tokens"]))
    lines = [f"| t | rocketkv t | rocketkv {factor}t (same file as reselect) | reselect t (file of {factor}t, "
             "working set of t) | reconstruct t |", "| ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip

    def cell(lab: str, t: int) -> str:
        row = cells.get(("mean", lab, t))
        if row is None:
            return "-"
        files = kept.get((lab, t), [0])
        return f"{pct(row['score'])} ({pct(row['top1_agreement'])}); {round(sum(files) / len(files))} stored"

    for t in cfg["budgets"]:
        lines.append(f"| {t} | {cell(label, t)} | {cell(label, factor * t)} | {cell('reselect', t)} | "
                     f"{cell('reconstruct', t)} |")  # fmt: skip
    return lines


def variants(report: dict) -> list[tuple[str, str]]:
    cfg = report["config"]
    return [(o, "auto" if k == 0 else str(k)) for o in cfg["observations"] for k in cfg["pool_kernels"]]


def ablation(reports: dict[str, dict]) -> tuple[list[str], dict]:
    """Mean score (agreement) over tasks of rocketkv per stage-1 variant and budget, per preset."""
    lines = []
    overall: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for model, report in reports.items():
        cells, budgets = rows_of(report), report["config"]["budgets"]
        lines += [f"**{model}**, {report['config']['context_tokens'][0]} tokens — mean score % (teacher-forced "
                  "top-1 agreement % with full attention) over tasks", "",
                  "| observation | pool kernel | " + " | ".join(f"t={t}" for t in budgets) + " | mean |",
                  "| --- | --- |" + " ---: |" * (len(budgets) + 1)]  # fmt: skip
        for obs, kernel in variants(report):
            label = f"rocketkv[{obs},{kernel}]" if len(variants(report)) > 1 else "rocketkv"
            got = [cells.get(("mean", label, t)) for t in budgets]
            got = [g for g in got if g is not None]
            for g in got:
                overall[(obs, kernel)].append((g["score"], g["top1_agreement"] or 0.0))
            mean_s = sum(g["score"] for g in got) / len(got)
            mean_a = sum(g["top1_agreement"] or 0.0 for g in got) / len(got)
            vals = [f"{pct(g['score'])} ({pct(g['top1_agreement'])})" for g in got]
            lines.append(f"| {obs} | {kernel} | " + " | ".join(vals) + f" | {pct(mean_s)} ({pct(mean_a)}) |")
        lines.append("")
    means = {v: (sum(s for s, _ in xs) / len(xs), sum(a for _, a in xs) / len(xs)) for v, xs in overall.items()}
    return lines, means


def _beats(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Variant a (score, agreement) beats b: better by MARGIN on score, or level on score (within
    MARGIN) and better by MARGIN on agreement; never worse by MARGIN on either."""
    if a[0] < b[0] - MARGIN or a[1] < b[1] - MARGIN:
        return False
    return a[0] >= b[0] + MARGIN or (abs(a[0] - b[0]) < MARGIN and a[1] >= b[1] + MARGIN)


def choose(means: dict, reports: dict[str, dict]) -> list[str]:
    """The defaults the numbers support, and why (derived from the numbers, not written by hand)."""
    current = means.get(DEFAULT_VARIANT)
    best = max(means, key=lambda v: (means[v][0], means[v][1]))
    wide = next(iter(reports.values()))["config"]["wide_window_size"]
    flag = {"tail": "--observation tail", "probe": "--observation probe", "wide": f"--window-size {wide}"}
    out = []
    if current is None:
        out.append(f"- The current default (observation {DEFAULT_VARIANT[0]}, kernel {DEFAULT_VARIANT[1]}) was not "
                   "measured in this run; no change is derived.")  # fmt: skip
        return out
    winners = [v for v in means if v != DEFAULT_VARIANT and _beats(means[v], current)]
    if winners:
        best = max(winners, key=lambda v: (means[v][0], means[v][1]))
        out.append(f"- **Change ingest's defaults to `{flag[best[0]]} --pool-kernel-size {best[1]}`**: mean score "
                   f"{pct(means[best][0])}% vs {pct(current[0])}% for the current `tail`/63, agreement with full "
                   f"attention {pct(means[best][1])}% vs {pct(current[1])}% (over the presets, tasks and budgets measured); "
                   f"the gain exceeds the {pct(MARGIN)}-point margin set for sampling noise.")  # fmt: skip
    else:
        why = ("it is the best measured" if best == DEFAULT_VARIANT else
               f"the best other variant (observation {best[0]}, kernel {best[1]}: score {pct(means[best][0])}%, "
               f"agreement {pct(means[best][1])}%) does not beat it by the {pct(MARGIN)}-point margin set for "
               "sampling noise")  # fmt: skip
        out.append(f"- **Keep `--observation tail --pool-kernel-size 63`** (mean score {pct(current[0])}%, agreement "
                   f"{pct(current[1])}% over the presets, tasks and budgets measured): {why}.")  # fmt: skip
    for model, report in reports.items():
        cells, label = rows_of(report), default_label(report)
        full = cells.get(("mean", "full", None))
        if full is None:
            continue
        ok = [
            t
            for t in report["config"]["budgets"]
            if ("mean", label, t) in cells and cells[("mean", label, t)]["score"] >= full["score"] - NEAR_FULL
        ]
        line = (
            f"- {model}: full attention scores {pct(full['score'])}%; the smallest budget whose rocketkv score is "
            f"within {pct(NEAR_FULL)} points of it is " + (f"t={min(ok)}." if ok else "none of those measured.")
        )
        if full["score"] < 0.2:
            line += (" Full attention itself fails most tasks at this length, so the agreement numbers, which need "
                     "no labels, carry the comparison here.")  # fmt: skip
        out.append(line)
    return out


def measure_cost(model: str, n: int, json_dir: Path) -> dict:
    """One sample of each COST_TASKS task through the full report's `rocketkv eval` (COMMON);
    the report JSON, kept as `accuracy-cost-<model>.json`."""
    out = json_dir / f"accuracy-cost-{file_label(model)}.json"
    cmd = [ROCKETKV, "eval", "--model", model, "--context-tokens", str(n), "--tasks", ",".join(COST_TASKS), *COMMON,
           "--samples", "1", "--json", str(out)]  # fmt: skip
    return kept_run(out, cmd, cwd=ROOT)


def cost_lines(costs: dict[str, dict], floors: dict[str, list[list[dict]]] | None = None) -> list[str]:
    """The "What the full report costs" section: per preset, the measured seconds per sample (prefill
    with every stage-1 cache, then the answers of every run), each cost task's sample weighted by the
    report's tasks it stands for (`COST_STANDS_FOR`: six one-question tasks, one four-question
    task), and the full report projected from them; with `floors` (preset → measurements, each a
    list of `benchmarks/reconstruction_ingest.py --json` outputs at the report's length that ran at
    the same time: one, or one per concurrent process), what one document's ingest costs with and
    without the context-reconstruction re-read, times the report's samples."""
    n_full = FULL_SAMPLES * len(TASKS)
    lines = ["## What the full report costs", "",
             f"The full report is {len(TASKS)} tasks × {FULL_SAMPLES} samples = {n_full} documents per preset, each "
             "prefilled once and compressed for every stage-1 cache of the method list (`--methods all`, 3 "
             "observation windows, 4 budgets), then answered by every run. `python scripts/accuracy_report.py "
             "--cost` runs exactly that configuration on one sample of "
             + " and ".join(f"`{t}`" for t in COST_TASKS) + " per preset (JSON: "
             "`docs/bench/accuracy-cost-<preset>.json`); the seconds per sample weight "
             + " and ".join(f"`{t}` by {COST_STANDS_FOR[t]}" for t in COST_TASKS)
             + ", the report's tasks each stands for (six ask one question, one asks four). One sample each "
             "makes this a rough measure (below the table: how much the same work varied between samples). "
             "*Prefill + caches*: the document's prefill, the "
             "context-reconstruction re-read and every cache's selection, saving and loading; *answers*: "
             "every run's teacher-forced scoring and, where it disagrees with full attention, its own "
             "generation. *Two processes*: each core running half the samples on one thread, the most two "
             "cores give (shown when the measurement itself ran on one thread).", "",
             "| preset, tokens | date, CPU | threads | caches / runs per sample | prefill + caches | answers | "
             f"per sample | {n_full} samples | two processes |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    spread = []
    for model, rep in costs.items():
        by_task: dict[str, list[dict]] = defaultdict(list)
        for x in rep["samples"]:
            by_task[x["task"]].append(x)
        weight = {task: COST_STANDS_FOR.get(task, 1) for task in by_task}

        def per_sample(seconds: Callable[[dict], float]) -> float:  # each task's mean, weighted by what it stands for
            return sum(weight[t] * sum(map(seconds, xs)) / len(xs) for t, xs in by_task.items()) / sum(weight.values())

        pre = per_sample(lambda x: x["prefill_s"] + x["save_load_s"])
        total = per_sample(lambda x: x["total_s"])
        n_runs = len({(r["label"], r["budget"]) for r in rep["records"]})
        threads = rep["versions"]["threads"]
        full_h = n_full * total / 3600
        two = f"{full_h / 2:.1f} h" if threads == 1 else "-"
        lines.append(f"| {model}, {rep['config']['context_tokens'][0]} | {rep.get('date') or '-'}, "
                     f"{rep['versions'].get('cpu', '-')} | {threads} | {rep['samples'][0]['n_caches']} / {n_runs} | "
                     f"{pre:.0f} s | {total - pre:.0f} s | {total:.0f} s | {full_h:.1f} h | {two} |")  # fmt: skip
        pre_s = [x["prefill_s"] + x["save_load_s"] for x in rep["samples"]]
        spread.append(f"{model} {min(pre_s):.0f}–{max(pre_s):.0f} s")
    lines += ["", "Prefill + caches (the same work for every sample of a preset) between its samples: "
              + ", ".join(spread) + "."]  # fmt: skip
    if floors:
        lines += ["", "The floor: one ingest of each document (its prefill and one selection) with the `tail` "
                  "window, and with the context-reconstruction re-read that the `reconstruct` observation adds "
                  "(`benchmarks/reconstruction_ingest.py DOC --no-reference` (measured with "
                  "benchmarks/reconstruction_ingest.py at commit db7884c; retired since), a KJV slice of the report's "
                  "length, median of its rounds; JSON `docs/bench/reconstruction-ingest-<preset>-<tokens>*.json`). "
                  "Each sample is a different document, so neither is shared between samples; the other 36 "
                  "caches and every answer come on top.", "",
                  "| preset, tokens | CPU | processes × threads | ingest (tail) | ingest (reconstruct) | "
                  f"{n_full} samples, tail | {n_full} samples, reconstruct |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for model, measurements in floors.items():
            for runs in measurements:
                k = len(runs)  # concurrent processes: each sample costs its time over k
                tail = sum(r["median_s"]["tail window"] for r in runs) / k / k
                recon = sum(r["median_s"]["reconstruct, fast path"] for r in runs) / k / k
                cpu = runs[0].get("machine", {}).get("cpu", "-")
                lines.append(f"| {model}, {runs[0]['context_tokens']} | {cpu} | {k} × {runs[0]['threads']} | "
                             f"{tail:.1f} s | {recon:.1f} s | {n_full * tail / 60:.0f} min | "
                             f"{n_full * recon / 60:.0f} min |")  # fmt: skip
        lines += ["", "With k processes at once, a cell is the mean of the processes' medians divided by k: the "
                  "seconds per sample the machine delivers."]  # fmt: skip
    lines += ["", f"The report was designed for {BUDGET_MINUTES} minutes per preset on a 2-core CPU.", ""]
    return lines


def run_date(reports: dict[str, dict]) -> str:
    """The day of the latest run behind `reports` (each `rocketkv eval` JSON records its own)."""
    dates = sorted(r["date"] for r in reports.values() if r.get("date"))
    return dates[-1] if dates else "an unrecorded date (see `git log docs/bench`)"


def page(reports: dict[str, dict], quick: bool, partial: str | None = None, costs: dict | None = None,
         floors: dict | None = None) -> str:  # fmt: skip
    any_report = next(iter(reports.values()))
    v = any_report["versions"]
    lines = ["# Accuracy: rocketkv vs full attention and baselines", ""]
    if quick:
        lines += ["**QUICK SMOKE RUN (`--quick`): one sample per task — not evidence for anything.**", ""]
    if partial:
        lines += [partial, ""]
    lines += ["The stage-1 methods added after this report's last run (context reconstruction, per-question "
              "re-selection) and the per-preset defaults chosen from them are measured in "
              "[docs/stage1-methods.md](stage1-methods.md) (`python scripts/stage1_report.py`).", ""]  # fmt: skip
    lines += [
        "Generated by `python scripts/accuracy_report.py` (which runs `rocketkv eval`; the JSON with every answer "
        f"is in `docs/bench/accuracy-<preset>.json`) on {run_date(reports)}: rocketkv {v['rocketkv']}, torch {v['torch']}, transformers "
        f"{v['transformers']}, {v['threads']} threads, {v['cpu']}.", "",
        "Tasks are RULER-style and generated locally (docs/accuracy.md): `niah_noise` (one needle in a noise haystack), "
        "`niah_text` (one needle in King James Bible text), `multikey` (a needle among 3 distractor needles), "
        "`multivalue` (4 values for one key), `multiquery` (4 needles, 4 separate questions against one saved "
        "cache), `vt` (variable tracking over 4 hops), `fwe` (three most frequent coded words). Needles sit "
        "between 10% and 90% of the document. **Score** = share of expected values found in the answer "
        "(case-insensitive substring, RULER's string_match_all); **top-1 agreement** = full attention's greedy "
        "answer fed token by token to the method's own cache (stage 2 applied at each step as decode applies it): "
        "the share of tokens where the method's next-token choice is the same; **KL** = KL(full ‖ method) of "
        "the next-token distributions along that answer. A method generates its own answer (for the score) only "
        "where it disagrees somewhere.", "",
        "Methods, each answered from its saved `.kv` file (ingest → file → ask): `full` (nothing pruned, exact "
        "attention); `rocketkv` (SnapKV++ then HSA); `snapkv` (the same stage-1 cache, exact attention: stage 1 "
        "only); `hsa` (nothing pruned, HSA at the budget: stage 2 only); `sink_recent` (first 4 tokens + the most "
        "recent, as many as rocketkv keeps, exact attention); `reconstruct` (stage 1 scored by context "
        "reconstruction, KVzip-style, then HSA); `reselect` (the file keeps what SnapKV++ keeps at twice the "
        "budget, each question re-selects t's working set with its own queries, then HSA). t is the token budget "
        "(docs/algorithm.md §1). "
        "On CPU, `ask` runs the `snapkv` row at these sizes: layers storing up to 4096 tokens are attended "
        "exactly there, below HSA's measured crossover (docs/performance.md, \"Where stage 2 pays\").", "",
    ]  # fmt: skip
    for model, report in reports.items():
        n = report["config"]["context_tokens"][0]
        k = report["config"]["samples"]
        minutes = report["elapsed_s"] / 60
        lines += [f"## {model}, {n} tokens, {k} samples per task ({minutes:.0f} min)", "",
                  "Score % [95% bootstrap interval] (`rocketkv`: observation tail, pool kernel 63):", "",
                  *main_table(report, "score"), "",
                  "Teacher-forced top-1 agreement % with full attention's answer [95% interval]:", "",
                  *main_table(report, "top1_agreement"), "",
                  "KL(full ‖ method) per answer token, nats [95% interval] (×100 in the cells):", "",
                  *main_table(report, "kl"), ""]  # fmt: skip
        if any(r["method"] in ("reselect", "reconstruct") for r in report["records"]):
            lines += ["Two-level budgets and context reconstruction — mean score % (top-1 agreement %); stored "
                      "tokens per KV head per full-attention layer (the file's size follows them):", "",
                      *two_level(report), ""]  # fmt: skip
    abl, means = ablation(reports)
    lines += ["## Ablation: ingest-time observation window and pooling kernel", "",
              "`tail` = the document's last 32 queries; `probe` = those plus the generic probe text "
              "`prompts/probe.txt` (scored, then dropped); `wide` = the last "
              f"{any_report['config']['wide_window_size']} queries. Pool kernel 63 (fixed) "
              "vs `auto` (7 below 4K tokens, 15 below 16K, 31 below 64K, else 63).", "", *abl,
              "## Defaults", "", *(["What this partial data would suggest (**not applied**: the rule is for the "
                                    "full report):", ""] if partial else []),
              *choose(means, reports), ""]  # fmt: skip
    if costs:
        lines += cost_lines(costs, floors)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of the whole chain (not evidence)")
    parser.add_argument("--from-json", action="store_true", help="rewrite the page from the JSON files, no runs")
    parser.add_argument("--out-dir", type=Path, help="default: docs/ (quick: build/accuracy-quick/)")
    parser.add_argument("--samples", type=int, help="samples per task (default 20; quick: 1)")
    parser.add_argument("--presets", help=f"comma-separated subset of {','.join(FULL)} (a partial report)")
    parser.add_argument("--tasks", help=f"comma-separated subset of {','.join(TASKS)} (a partial report)")
    parser.add_argument("--model", help="with --quick: run on this model (a directory or preset) instead")
    parser.add_argument("--context-tokens", type=int, default=1024, help="with --quick --model: document length")
    parser.add_argument("--eval-args", default="", help="with --quick: more `rocketkv eval` options (later win)")
    parser.add_argument("--cost", action="store_true",
                        help="measure what the full report costs (one sample of two tasks per preset; kept JSON reused)")  # fmt: skip
    args = parser.parse_args()
    if (args.model or args.eval_args) and not args.quick:
        parser.error("--model and --eval-args are for --quick smoke runs")
    out_dir = args.out_dir or (ROOT / "build" / "accuracy-quick" if args.quick else ROOT / "docs")
    json_dir = out_dir / "bench"
    json_dir.mkdir(parents=True, exist_ok=True)
    samples = args.samples or (1 if args.quick else 20)
    presets = dict(QUICK if args.quick else FULL)
    if args.model:
        presets = {args.model: args.context_tokens}
    if args.presets:
        presets = {m: presets[m] for m in args.presets.split(",")}
    tasks = tuple(args.tasks.split(",")) if args.tasks else TASKS
    if not set(tasks) <= set(TASKS):
        parser.error(f"--tasks: unknown {sorted(set(tasks) - set(TASKS))}")
    if (args.from_json or args.cost) and not args.quick:  # the page from what was run: presets, tasks, samples
        have = lambda m, t: (json_dir / f"accuracy-{file_label(m)}-{t}.json").exists()  # noqa: E731
        if not args.presets:
            presets = {m: n for m, n in presets.items() if any(have(m, t) for t in tasks)}
        if not args.tasks:
            tasks = tuple(t for t in TASKS if presets and all(have(m, t) for m in presets))
        if not presets or not tasks:
            parser.error(f"no per-task accuracy JSON in {json_dir} yet (run without --from-json and --cost)")
        if not args.samples:
            first = json_dir / f"accuracy-{file_label(next(iter(presets)))}-{tasks[0]}.json"
            samples = read_json(first)["config"]["samples"]
    costs = {}
    for model, n in ({} if args.quick else FULL).items():
        kept = json_dir / f"accuracy-cost-{file_label(model)}.json"
        if args.cost and not args.from_json and not kept.exists():
            costs[model] = measure_cost(model, n, json_dir)
        elif kept.exists():
            costs[model] = read_json(kept)
    floors: dict[str, list[list[dict]]] = {}
    for model, n in ({} if args.quick else FULL).items():
        one = json_dir / f"reconstruction-ingest-{file_label(model)}-{n}.json"
        together = sorted(json_dir.glob(f"reconstruction-ingest-{file_label(model)}-{n}-concurrent-*.json"))
        floors[model] = [[read_json(one)]] if one.exists() else []
        if together:
            floors[model].append([read_json(p) for p in together])
    floors = {m: f for m, f in floors.items() if f}
    if args.cost and args.from_json and not costs:
        parser.error("--cost --from-json: no docs/bench/accuracy-cost-*.json yet")
    reports = {}
    for model, n in presets.items():
        common = [*(QUICK_COMMON if args.quick else COMMON), "--samples", str(samples), *shlex.split(args.eval_args)]
        reports[model] = run(model, n, common, json_dir, tasks, resume=not args.quick or args.from_json,
                             runs=not (args.from_json or args.cost))  # fmt: skip
        write_json(json_dir / f"accuracy-{file_label(model)}.json", reports[model])
    partial = None
    if not args.quick and (presets.keys() != FULL.keys() or tasks != TASKS or samples < 20):
        partial = (f"**Partial report**: presets {', '.join(presets)}; tasks {', '.join(tasks)}; {samples} samples "
                   f"per task (the full report: both presets, all {len(TASKS)} tasks, 20 samples). Intervals are "
                   "wide at this size and the defaults below are not changed from it.")  # fmt: skip
    write_text(out_dir / "accuracy.md", page(reports, args.quick, partial, costs, floors))
    print(out_dir / "accuracy.md")
    return 0


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        sys.exit(main())
