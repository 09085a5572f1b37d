#!/usr/bin/env python
"""Regenerate docs/accuracy.md: run `rocketkv eval` on both presets and choose ingest's defaults.

Usage: python scripts/accuracy_report.py [--quick] [--from-json] [--cost] [--out-dir DIR] [--samples N]
       python scripts/accuracy_report.py --quick --model DIR --context-tokens N --eval-args "..."  # a smoke test
Runs the installed CLI once per preset and task (SmolLM2 at ~4K tokens, Gemma at ~8K, 20 samples per
task, budgets 128–1024, every method) and keeps each run's JSON (`docs/bench/accuracy-<preset>-<task>.json`):
a rerun resumes at the first missing one. Every method scores full attention's answer teacher-forced
(top-1 agreement, KL) and generates only where it disagrees; rates carry Wilson intervals, means
bootstrap intervals (95%). `--quick`: a smoke run of the whole chain under build/accuracy-quick/ (not
evidence; with `--model`, `--context-tokens`, `--eval-args` on any model: tests/test_eval.py). `--cost`:
one sample of a one-question and a four-question task per preset (`docs/bench/accuracy-cost-<preset>.json`),
projected to the full report's 140 samples ("What the full report costs": about 8-9 hours per preset).
Use OMP_NUM_THREADS=1 when anything else runs: torch's two threads spin against it (10-30x slower).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rocketkv_cli.eval import reports as lib
from rocketkv_cli.eval.reports import interval, kept, kept_run, read_json, read_text, report_timer, table

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
             *(interval(r[what], r.get(f"{what}_ci")) if (r := cells.get((task, *c))) else "-" for c in cols)]
            for task in [*cfg["tasks"], "mean"]]  # fmt: skip
    return table(head, rows, "-" + "r" * len(cols))


def two_level(report: dict) -> list[str]:
    """Per budget t: rocketkv at t and at the store budget (its file), and reselect at t (the
    store budget's file, t's working set), each as mean score (top-1 agreement) and kept tokens."""
    cells, cfg = rows_of(report), report["config"]
    factor, label = cfg.get("store_factor", 2), default_label(report)
    stored = defaultdict(list)
    for r in report["records"]:
        stored[(r["label"], r["budget"])].append(r.get("stored_tokens", r["kept_tokens"]))

    def cell(lab: str, t: int) -> str:
        row = cells.get(("mean", lab, t))
        if row is None:
            return "-"
        files = stored.get((lab, t), [0])
        return f"{pct(row['score'])} ({pct(row['top1_agreement'])}); {round(sum(files) / len(files))} stored"

    head = ["t", "rocketkv t", f"rocketkv {factor}t (same file as reselect)",
            f"reselect t (file of {factor}t, working set of t)", "reconstruct t"]  # fmt: skip
    rows = [
        [t, cell(label, t), cell(label, factor * t), cell("reselect", t), cell("reconstruct", t)]
        for t in cfg["budgets"]
    ]
    return table(head, rows, "rrrrr")


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
                  "top-1 agreement % with full attention) over tasks", ""]  # fmt: skip
        rows = []
        for obs, kernel in variants(report):
            label = f"rocketkv[{obs},{kernel}]" if len(variants(report)) > 1 else "rocketkv"
            got = [g for t in budgets if (g := cells.get(("mean", label, t))) is not None]
            overall[(obs, kernel)] += [(g["score"], g["top1_agreement"] or 0.0) for g in got]
            mean_s = sum(g["score"] for g in got) / len(got)
            mean_a = sum(g["top1_agreement"] or 0.0 for g in got) / len(got)
            vals = [f"{pct(g['score'])} ({pct(g['top1_agreement'])})" for g in got]
            rows.append([obs, kernel, *vals, f"{pct(mean_s)} ({pct(mean_a)})"])
        lines += [*table(["observation", "pool kernel", *(f"t={t}" for t in budgets), "mean"], rows,
                         "--" + "r" * (len(budgets) + 1)), ""]  # fmt: skip
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


def cost_lines(costs: dict[str, dict], floors: dict[str, list[list[dict]]] | None = None, old: str = "") -> list[str]:
    """ "What the full report costs": per preset the measured seconds per sample (prefill + every cache,
    then every run's answers), each cost task weighted by the tasks it stands for (`COST_STANDS_FOR`),
    projected to the full report; with `floors` (preset → runs side by side, each run a list of the
    retired benchmarks/reconstruction_ingest.py's outputs, one per concurrent process) one document's
    ingest with and without the reconstruction re-read. The prose is kept from the previous page `old`."""
    n_full = FULL_SAMPLES * len(TASKS)
    lines = ["## What the full report costs", "", *kept(old, "The full report is ", ("",)), ""]
    spread, rows = [], []
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
        rows.append([f"{model}, {rep['config']['context_tokens'][0]}", f"{rep.get('date') or '-'}, "
                     f"{rep['versions'].get('cpu', '-')}", threads, f"{rep['samples'][0]['n_caches']} / {n_runs}",
                     f"{pre:.0f} s", f"{total - pre:.0f} s", f"{total:.0f} s", f"{full_h:.1f} h", two])  # fmt: skip
        pre_s = [x["prefill_s"] + x["save_load_s"] for x in rep["samples"]]
        spread.append(f"{model} {min(pre_s):.0f}–{max(pre_s):.0f} s")
    lines += table(["preset, tokens", "date, CPU", "threads", "caches / runs per sample", "prefill + caches", "answers",
                    "per sample", f"{n_full} samples", "two processes"], rows, "--" + "r" * 7)  # fmt: skip
    lines += ["", "Prefill + caches (the same work for every sample of a preset) between its samples: "
              + ", ".join(spread) + "."]  # fmt: skip
    if floors:
        lines += ["", *kept(old, "The floor: one ingest", ("",)), ""]
        rows = []
        for model, measurements in floors.items():
            for runs in measurements:
                k = len(runs)  # concurrent processes: each sample costs its time over k
                tail = sum(r["median_s"]["tail window"] for r in runs) / k / k
                recon = sum(r["median_s"]["reconstruct, fast path"] for r in runs) / k / k
                cpu = runs[0].get("machine", {}).get("cpu", "-")
                rows.append([f"{model}, {runs[0]['context_tokens']}", cpu, f"{k} × {runs[0]['threads']}",
                             f"{tail:.1f} s", f"{recon:.1f} s", f"{n_full * tail / 60:.0f} min",
                             f"{n_full * recon / 60:.0f} min"])  # fmt: skip
        lines += table(["preset, tokens", "CPU", "processes × threads", "ingest (tail)", "ingest (reconstruct)",
                        f"{n_full} samples, tail", f"{n_full} samples, reconstruct"], rows, "--" + "r" * 5)  # fmt: skip
        lines += ["", *kept(old, "With k processes at once", ("",))]
    lines += ["", *kept(old, "The report was designed for", ("",)), ""]
    return lines


def run_date(reports: dict[str, dict]) -> str:
    """The day of the latest run behind `reports` (each `rocketkv eval` JSON records its own)."""
    dates = sorted(r["date"] for r in reports.values() if r.get("date"))
    return dates[-1] if dates else "an unrecorded date (see `git log docs/bench`)"


def page(reports: dict[str, dict], quick: bool, partial: str | None = None, costs: dict | None = None,
         floors: dict | None = None, old: str = "") -> str:  # fmt: skip
    """The page from the reports; its prose (tasks, methods, the cost notes) is kept from the previous page `old`."""
    any_report = next(iter(reports.values()))
    v = any_report["versions"]
    lines = ["# Accuracy: rocketkv vs full attention and baselines", ""]
    if quick:
        lines += ["**QUICK SMOKE RUN (`--quick`): one sample per task — not evidence for anything.**", ""]
    if partial:
        lines += [partial, ""]
    lines += [*kept(old, "The stage-1 methods added after", ("",)), ""]
    lines += [
        "Generated by `python scripts/accuracy_report.py` (which runs `rocketkv eval`; the JSON with every answer "
        f"is in `docs/bench/accuracy-<preset>.json`) on {run_date(reports)}: rocketkv {v['rocketkv']}, torch {v['torch']}, transformers "
        f"{v['transformers']}, {v['threads']} threads, {v['cpu']}.", "",
        *kept(old, "Tasks are RULER-style"),
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
        lines += cost_lines(costs, floors, old)
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
        path = json_dir / f"accuracy-cost-{file_label(model)}.json"  # the full report's eval on one sample each
        if path.exists() or (args.cost and not args.from_json):
            cmd = [ROCKETKV, "eval", "--model", model, "--context-tokens", str(n), "--tasks", ",".join(COST_TASKS),
                   *COMMON, "--samples", "1", "--json", str(path)]  # fmt: skip
            costs[model] = kept_run(path, cmd, cwd=ROOT)
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
        lib.write_json(json_dir / f"accuracy-{file_label(model)}.json", reports[model])
    partial = None
    if not args.quick and (presets.keys() != FULL.keys() or tasks != TASKS or samples < 20):
        partial = (f"**Partial report**: presets {', '.join(presets)}; tasks {', '.join(tasks)}; {samples} samples "
                   f"per task (the full report: both presets, all {len(TASKS)} tasks, 20 samples). Intervals are "
                   "wide at this size and the defaults below are not changed from it.")  # fmt: skip
    page_path = out_dir / "accuracy.md"
    lib.write_text(page_path, page(reports, args.quick, partial, costs, floors, read_text(page_path)))
    print(out_dir / "accuracy.md")
    return 0


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        sys.exit(main())
