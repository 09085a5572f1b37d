#!/usr/bin/env python
"""Regenerate docs/frontier.md: the accuracy frontier of store size × answering mode, per preset.

Usage: python scripts/frontier_report.py [--presets P,Q] [--samples N] [--max-minutes M] [--from-json] [--focus]
       python scripts/frontier_report.py --quick [--model DIR --context-tokens N --haystack F]  # a smoke run
Per preset (SmolLM2 at 4096 tokens, Gemma 3 at 8192; 5 tasks × `--samples`), each document is
prefilled once and compressed to every store (`rocketkv_cli/eval/frontier.py`: everything, 50%, 25%,
4096, 2048, 1024 tokens per KV head, with the preset's own stage-1 method and storage); each store
is saved, read back and answered in every mode (exact; HSA at t = 256, 512, 1024; one-shot
re-selection at t = 512, 1024). One line per finished sample goes to
`docs/bench/frontier-<preset>.jsonl`, so an interrupted run resumes at the next sample; samples run
task by task within each index, so a partial run covers every task. `--max-minutes` stops between
samples (resumable). The page applies the default rule: the smallest file whose score on the tasks
full attention solves is ≥ 98% of full's and whose top-1 agreement is ≥ 0.98.
`--focus` adds focus mode's row (`ask --focus 4`: each question answered from the 4 passages of
the document's text that match it best by BM25, re-read next to it), on the samples already run:
one line per sample to `docs/bench/frontier-<preset>-focus.jsonl`, resumable the same way. It has
no top-1 agreement (it reads another context than full attention's), so the default rule cannot
choose it; the page compares its score with full attention's per task.
Run one process per preset with OMP_NUM_THREADS=1 when both run (2 cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

from rocketkv_cli.core.config import FOCUS_RANKINGS
from rocketkv_cli.eval import reports as lib
from rocketkv_cli.eval.frontier_summary import SCORE_BAR, SOLVED, TOP1_BAR, product_settings, screen, summarize
from rocketkv_cli.eval.reports import interval, read_text, table

ROOT = Path(__file__).resolve().parents[1]
KJV = ROOT.parent / "shared" / "data" / "kjv.txt"
PRESETS = {"smollm2-135m": 4096, "gemma-3-270m": 8192}  # preset: context tokens
TASKS = ("niah_noise", "niah_text", "multikey", "multivalue", "multiquery")
SAMPLES = 8
HAND_WRITTEN = "\n## How to read it"
# the preset's own choice of store and budget is what the frontier decides, not an input to it
STORE_FIELDS = ("store_budget", "token_budget", "prompt_budget")  # the page's hand-written part starts here


def read_lines(path: Path) -> list[dict]:
    """The report's JSON lines; a last line cut short by a killed run is dropped (and the file
    rewritten without it), so the run resumes at that sample."""
    if not path.exists():
        return []
    raw = path.read_text().splitlines()
    lines = []
    for i, text in enumerate(raw):
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            if i != len(raw) - 1:
                raise
            print(f"{path}: dropped a last line cut short; its sample runs again", file=sys.stderr)
            lib.write_jsonl(path, lines)
    return lines


def file_label(model: str) -> str:
    return Path(model).name if ("/" in model or model.startswith(".")) else model


def run_preset(model: str, n: int, samples: int, out: Path, haystack: str, deadline: float, quick: bool,
               screen: dict | None = None, main: Path | None = None) -> None:  # fmt: skip
    """Run (or resume) one preset's samples into `out` (JSON lines: a header, then one per sample).
    screen: stage-1 fields to try instead of the preset's (`frontier.screen_config`), on the tasks
    full attention solves in `main` (the preset's own results)."""
    import torch

    from rocketkv_cli.api.rocketkv import RocketKV, configure
    from rocketkv_cli.core.config import PRESET_PREFILL_DEFAULTS, default_kv_dtype
    from rocketkv_cli.engine.inputs import tokenize
    from rocketkv_cli.eval.bench import machine_info
    from rocketkv_cli.eval.frontier import FrontierConfig, run_sample, screen_config
    from rocketkv_cli.eval.tasks import generate

    configure(True, progress_bars=False)
    engine = RocketKV.load(model).engine
    kw = dict(stores=("all", "50%"), hsa_budgets=(64,), reselect_budgets=(64,), window_size=8,
              plan_new_tokens=3) if quick else {}  # fmt: skip
    stage1 = {k: v for k, v in PRESET_PREFILL_DEFAULTS.get(model, {}).items() if k not in STORE_FIELDS}
    cfg = FrontierConfig(context_tokens=n, tasks=TASKS, samples=samples, kv_dtype=default_kv_dtype(model),
                         stage1=tuple(stage1.items()), **kw)  # fmt: skip
    if screen is not None and main is not None:
        solved = summarize(read_lines(main), file_label(model))["solved"]
        if len(old := read_lines(out)):  # a screen resumes on the tasks it started with
            solved = old[0]["config"]["tasks"]
        budget = PRESET_PREFILL_DEFAULTS.get(model, {}).get("token_budget", 64)  # the default's re-selection
        cfg = screen_config(cfg, screen, tuple(solved) or cfg.tasks, budget)  # all tasks where none is solved
    lines = read_lines(out)
    if lines and lines[0].get("digest") != cfg.digest():
        sys.exit(f"error: {out} was written with another configuration; move it away to start over")
    if not lines:
        head = {"format": "rocketkv.frontier", "digest": cfg.digest(), "config": cfg.to_dict(), "model": model,
                "machine": machine_info(), "date": dt.date.today().isoformat(),
                "layers": [s.sliding_window for s in engine.shape.layers], "n_kv_heads": engine.shape.n_kv_heads,
                "head_dim": engine.shape.head_dim}  # fmt: skip
        lib.write_jsonl(out, [head])
        lines = [head]
    done = {(r["timing"]["task"], r["timing"]["sample"]) for r in lines[1:]}
    count = lambda text: len(tokenize(engine.tokenizer, text, False))  # noqa: E731
    with tempfile.TemporaryDirectory() as work, torch.inference_mode():
        for index in range(samples):
            for task in cfg.tasks:
                if (task, index) in done:
                    continue
                if time.time() > deadline:
                    print(f"{model}: stopped at the time limit; rerun to resume", file=sys.stderr)
                    return
                sample = generate(task, index, cfg.seed, n, count, haystack)
                row = run_sample(engine, cfg, sample, Path(work), time_decode=len(lines) == 1)
                with out.open("a") as f:  # one whole line per sample: a killed run loses at most the sample
                    f.write(json.dumps(row) + "\n")
                lines.append(row)
                print(f"{model}: {task} #{index} in {row['timing']['total_s']:.0f} s", file=sys.stderr, flush=True)


def run_focus(model: str, n: int, lines: list[dict], out: Path, haystack: str, deadline: float,
              ranking: str = "bm25", max_index: int | None = None) -> None:  # fmt: skip
    """Focus mode on every sample of `lines` (the preset's frontier lines; with `max_index`, those
    of a lower index) not yet in `out`: each question answered as `RocketKV.ask_focused` answers it
    (the passages of the text a file of everything stores, ranked by `ranking`, their short prefill
    with the model's defaults, then `ask`); one line per sample. BM25 needs only the text: a
    question that shares no word with any passage, which `ask_focused` answers from the whole file,
    takes full attention's answer here (exact attention over everything, the sample's first record)
    and is counted in `fallback`. The other rankings need the question's attention over the file:
    each sample's document is ingested with the model's defaults and `ask_focused` answers."""
    import torch

    from rocketkv_cli.api.focus import FOCUS_PASSAGES, best_passages, focus_text
    from rocketkv_cli.api.rocketkv import RocketKV, configure
    from rocketkv_cli.engine.inputs import Document, tokenize
    from rocketkv_cli.eval.bench import machine_info
    from rocketkv_cli.eval.runner import match_fraction
    from rocketkv_cli.eval.tasks import generate

    configure(True, progress_bars=False)
    rk = RocketKV.load(model)
    engine = rk.engine
    cfg = _config_of(lines)
    focused = read_lines(out)
    digest = f"{lines[0]['digest']}:focus@{FOCUS_PASSAGES}" + ("" if ranking == "bm25" else f":{ranking}")
    if focused and focused[0].get("digest") != digest:
        sys.exit(f"error: {out} was written for other frontier results; move it away to start over")
    if not focused:
        focused = [{"format": "rocketkv.frontier-focus", "digest": digest, "passages": FOCUS_PASSAGES,
                    "ranking": ranking, "date": dt.date.today().isoformat(), "machine": machine_info()}]  # fmt: skip
        lib.write_jsonl(out, focused)
    done = {(r["timing"]["task"], r["timing"]["sample"]) for r in focused[1:]}
    count = lambda text: len(tokenize(engine.tokenizer, text, False))  # noqa: E731
    frame = len(engine.document_ids(Document("", "", "")))
    with torch.inference_mode():
        for row in lines[1:]:
            task, index = row["timing"]["task"], row["timing"]["sample"]
            if (task, index) in done or (max_index is not None and index >= max_index):
                continue
            if time.time() > deadline:
                print(f"{model}: focus stopped at the time limit; rerun to resume", file=sys.stderr)
                return
            t0 = time.perf_counter()
            sample = generate(task, index, cfg.seed, n, count, haystack)
            ids = engine.document_ids(Document(sample.document, "", "focus"))
            text = engine.tokenizer.decode(ids[frame:], skip_special_tokens=True)  # what the file stores
            full = [r for r in row["records"] if r["label"] == row["records"][0]["label"]]
            records = []
            whole = None if ranking == "bm25" else rk.ingest(text=sample.document).cache
            for qi, question in enumerate(sample.questions):
                if whole is not None:
                    got = rk.ask_focused(whole, question.text, passages=FOCUS_PASSAGES, ranking=ranking,
                                         max_new_tokens=sample.max_new_tokens)  # fmt: skip
                    chosen = list(got.passages)
                    answer, n_tokens = got.answer.text, got.answer.n_answer_tokens
                elif chosen := best_passages(text, question.text, FOCUS_PASSAGES):
                    short = rk.ingest(text=focus_text(chosen)).cache
                    ans = next(iter(rk.ask(short, question.text, max_new_tokens=sample.max_new_tokens)))
                    answer, n_tokens = ans.text, ans.n_answer_tokens
                else:
                    answer, n_tokens = full[qi]["answer"], full[qi]["n_answer_tokens"]
                records.append({"task": task, "sample": index, "question_index": qi, "n_context_tokens":
                                row["timing"]["n_context_tokens"], "store": full[qi]["store"],
                                "store_label": full[qi]["store_label"], "stored_tokens": full[qi]["stored_tokens"],
                                "mode": "focus", "budget": FOCUS_PASSAGES, "ranking": ranking,
                                "label": f"{full[qi]['store_label']} · {_focus_name(ranking)}@{FOCUS_PASSAGES}",
                                "answer": answer,
                                "expected": list(question.expected), "score": match_fraction(answer, question.expected),
                                "top1_agreement": None, "kl": None, "n_answer_tokens": n_tokens,
                                "fallback": not chosen, "passages": [[p.first_line, p.last_line] for p in chosen]})  # fmt: skip
            line = {"records": records, "timing": {"task": task, "sample": index,
                                                   "total_s": round(time.perf_counter() - t0, 3)}}  # fmt: skip
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")
            focused.append(line)
            print(f"{model}: focus {task} #{index} in {line['timing']['total_s']:.0f} s", file=sys.stderr, flush=True)


def _field(text: str) -> tuple[str, object]:
    """`--stage1 FIELD=VALUE`: an integer value as an int."""
    name, _, value = text.partition("=")
    return name.strip(), int(value) if value.strip().isdigit() else value.strip()


def _screen_path(out: Path, fields: dict) -> Path:
    slug = "_".join(f"{k}-{v}" for k, v in sorted(fields.items()))
    return out.with_name(f"{out.stem}-stage1-{slug}.jsonl")


def screens_of(out: Path, lines: list[dict], model: str) -> list[tuple[dict, dict, dict]]:
    """Each screened stage-1 method beside `out`: (its stage-1 fields, the preset's own points on
    its samples, its points)."""
    found = []
    for path in sorted(out.parent.glob(f"{out.stem}-stage1-*.jsonl")):
        one = read_lines(path)
        if len(one) < 2:
            continue
        try:
            found.append((one[0]["config"]["stage1"], *screen(lines, one, model)))
        except ValueError as exc:  # written against other results of the preset: left off the page
            print(f"{path}: {exc}; rerun with --stage1", file=sys.stderr)
    return found


def _focus_name(ranking: str) -> str:
    return "focus" if ranking == "bm25" else f"focus-{ranking}"


def _config_of(lines: list[dict]):
    """The `FrontierConfig` a frontier file's header was written with."""
    from rocketkv_cli.eval.frontier import FrontierConfig

    c = lines[0]["config"]
    return FrontierConfig(**{**c, "stage1": tuple(c["stage1"].items()),
                             **{k: tuple(v) for k, v in c.items() if isinstance(v, list)}})  # fmt: skip


def time_preset(model: str, n: int, lines: list[dict], summary: dict, out: Path, haystack: str, quick: bool) -> None:
    """Time, side by side in one process, the decode step of every point that holds the bar and of
    full attention (`frontier.time_points` on the first niah_noise sample); written to `out`."""
    import torch

    from rocketkv_cli.api.rocketkv import RocketKV, configure
    from rocketkv_cli.engine.inputs import tokenize
    from rocketkv_cli.eval.bench import machine_info
    from rocketkv_cli.eval.frontier import time_points
    from rocketkv_cli.eval.tasks import generate

    configure(True, progress_bars=False)
    engine = RocketKV.load(model).engine
    cfg = _config_of(lines)
    labels = [summary["points"][0]["label"]] + [p["label"] for p in summary["points"][1:] if p["passes"]]
    count = lambda text: len(tokenize(engine.tokenizer, text, False))  # noqa: E731
    sample = generate(TASKS[0], 0, cfg.seed, n, count, haystack)
    with tempfile.TemporaryDirectory() as work, torch.inference_mode():
        rounds = 2 if quick else 5
        ms = time_points(engine, cfg, sample, labels, Path(work), rounds=rounds)
    lib.write_json(out, {"digest": lines[0]["digest"], "samples": len(lines) - 1, "decode_ms": ms, "rounds": rounds,
                         "machine": machine_info(), "date": dt.date.today().isoformat()})  # fmt: skip


def render(results: dict[str, dict], quick: bool) -> str:
    """The generated part of docs/frontier.md."""
    lines = ["# The accuracy frontier: how small the stored cache, how each question attends", ""]
    if quick:
        lines += ["**QUICK SMOKE RUN on a tiny model: not evidence.**", ""]
    lines += [
        "Generated by `python scripts/frontier_report.py` (the JSON lines with every answer: "
        "`docs/bench/frontier-<preset>.jsonl`). What the rows mean: [How to read it](#how-to-read-it).",
        "",
    ]
    for model, s in results.items():
        head, m = s["head"], s["head"]["machine"]
        per_sample = s["elapsed_s"] / max(s["samples"], 1)
        lines += [f"## {model}, {head['config']['context_tokens']} tokens, {s['samples']} samples "
                  f"({', '.join(s['tasks'])})", "",
                  f"{head['date']}: rocketkv {m['rocketkv']}, torch {m['torch']}, {m['threads']} thread(s), "
                  f"{m['cpu']}; storage {head['config']['kv_dtype']}, stage 1 "
                  f"{head['config']['stage1'] or 'tail window'}. {s['elapsed_s'] / 60:.0f} min of samples "
                  f"({per_sample:.0f} s each); {len(head['config']['tasks'])} tasks × {head['config']['samples']} "
                  f"samples would take {per_sample * len(head['config']['tasks']) * head['config']['samples'] / 60:.0f}"
                  " min.", "",
                  f"Tasks full attention solves (mean score ≥ {SOLVED:.0%}): {', '.join(s['solved']) or 'none'}; "
                  f"full attention scores {interval(s['full_score'])}% on them.", ""]  # fmt: skip
        rows = []
        for p in s["points"]:
            mark = " **← default rule**" if s["chosen"] and p["label"] == s["chosen"]["label"] else ""
            rows.append([
                p["store_label"], f"{p['stored_tokens']:,.0f}", _mode(p) + mark,
                interval(p["score"], p["score_ci"]), interval(p["share_of_full"]), interval(p["top1"], p["top1_ci"]),
                f"{p['kl']:.3f}" if p["kl"] is not None else "-", f"{p['bytes_per_token']:,.0f}",
                f"{p['vs_bf16']:.1f}×" if p["vs_bf16"] else "-",
                f"{p['vs_llamacpp']:.1f}×" if p["vs_llamacpp"] else "-",
                f"{p['decode_ms']:.1f}" if p["decode_ms"] is not None else "-",
            ])  # fmt: skip
        lines += table(["store", "tokens/head", "answering", "score % (solved tasks)", "% of full", "top-1 %",
                        "KL (nats)", "file bytes/token", "smaller than bf16 KV", "smaller than llama.cpp",
                        "decode ms/token"], rows, "lrlrrrrrrrr")  # fmt: skip
        for f in s["focus"]:
            p = next(p for p in s["points"] if p["label"] == f["label"])
            fm = f["machine"]
            lines += ["", f"`{_mode(p)}` on {f['samples']} samples ({f['date']}: {fm.get('cpu', '?')}, "
                      f"{fm.get('threads', '?')} thread(s); {f['seconds'] / 60:.0f} min; "
                      f"{f['fallbacks']} question(s) answered from the whole file: no passage shared a word with "
                      "them): its score per task beside full attention's on the same samples, every task (those full "
                      "attention does not solve included):", ""]  # fmt: skip
            lines += table(["task", "full (exact)", _mode(p)],
                           [[t, interval(a), interval(b)] for t, (a, b) in f["by_task"].items()]
                           + [["all tasks", interval(f["all"][0]), interval(f["all"][1])]], "lrr")  # fmt: skip
        c = s["chosen"]
        t = s["timed"]
        lines += ["", "decode ms/token: " + (f"timed side by side in one process on {t['date']} (`--time`: {t['rounds']} rounds "
                  f"of 12 steps, {t['machine']['threads']} thread(s), median)" if t else "from the first sample, while "
                  "the report ran (noisy; `--time` times the points that hold the bar side by side)") + "."]  # fmt: skip
        lines += ["", f"Default rule (score ≥ {SCORE_BAR:.0%} of full's and top-1 ≥ {TOP1_BAR:.2f}, among the points "
                  f"`ingest` can make; the smallest file, then the fastest decode): **{c['label'] if c else 'no point'}**"
                  + (f" ({c['bytes_per_token']:,.0f} bytes/token)" if c else "")
                  + (f", which is `ingest` with {_flags(product_settings(c))}." if product_settings(c) else "."),
                  ""]  # fmt: skip
        if s.get("screens"):
            lines += _render_screens(s["screens"], head["config"]["stage1"])
    return "\n".join(lines)


def _render_screens(screens: list[tuple[dict, dict, dict]], own: dict) -> list[str]:
    """The section of other stage-1 methods, each beside the preset's own on its samples."""
    lines = ["### Other stage-1 methods at the pruned stores", "",
             "Each screened on the tasks full attention solves (`--stage1 FIELD=VALUE`), after full attention's and "
             "the preset's own stage 1's rows on the same samples.", ""]  # fmt: skip
    rows = []
    for fields, base, tried in screens:
        for name, s in ((_stage1_name(own), base), (_stage1_name({**own, **fields}), tried)):
            for p in s["points"]:
                full = p["store_label"].startswith("everything")
                if full and (p["mode"] != "exact" or s is tried):
                    continue
                row = ["full attention" if full else name, p["store_label"].split(" = ")[0],
                       f"{p['stored_tokens']:,.0f}", _mode(p), interval(p["score"], p["score_ci"]),
                       interval(p["share_of_full"]),
                       interval(p["top1"], p["top1_ci"]), f"{p['kl']:.3f}", f"{p['bytes_per_token']:,.0f}",
                       str(s["samples"])]  # fmt: skip
                if row not in rows:  # screens run on the same samples share full's and the preset's rows
                    rows.append(row)
    return lines + table(["stage 1", "store", "tokens/head", "answering", "score % (solved tasks)", "% of full",
                          "top-1 %", "KL (nats)", "file bytes/token", "samples"], rows, "llrlrrrrrr") + [""]  # fmt: skip


def _stage1_name(fields: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(fields.items())) or "observation tail"


def _mode(p: dict) -> str:
    """A point's answering mode as the page names it: "hsa t=512", "focus, 4 passages", "exact"."""
    if p["mode"] == "focus":
        return f"focus, {p['budget']} passages" + ("" if p["ranking"] in (None, "bm25") else f", {p['ranking']}")
    return p["mode"] + ("" if p["budget"] is None else f" t={p['budget']}")


def _flags(settings: dict | None) -> str:
    names = {"store_budget": "--store-budget", "token_budget": "--budget"}
    return " ".join(f"`{names[k]} {v}`" for k, v in (settings or {}).items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop between samples after this long")
    ap.add_argument("--from-json", action="store_true", help="render the page from the JSON lines only")
    ap.add_argument("--quick", action="store_true", help="a smoke run on a tiny model (not evidence)")
    ap.add_argument("--model", help="with --quick: a model directory")
    ap.add_argument(
        "--time",
        action="store_true",
        help="time the points that hold the bar side by side (after the samples; needs a quiet machine)",
    )
    ap.add_argument("--focus", action="store_true", help="add focus mode's row, on the samples already run")
    ap.add_argument(
        "--focus-ranking",
        default="bm25",
        choices=("bm25", "attention", "mixed"),
        help="with --focus: how passages are ranked (attention and mixed ingest each document)",
    )
    ap.add_argument("--focus-samples", type=int, default=None, help="with --focus: samples of a lower index only")
    ap.add_argument("--stage1", action="append", default=[], metavar="FIELD=VALUE",
                    help="screen another stage-1 method (e.g. observation=probe) on the tasks full attention solves")  # fmt: skip
    ap.add_argument("--context-tokens", type=int, default=300)
    ap.add_argument("--haystack", default=str(KJV))
    ap.add_argument("--out-dir", default=str(ROOT / "docs"))
    args = ap.parse_args()
    if args.time and args.from_json:
        ap.error("--time runs the model; it does not combine with --from-json")
    out_dir = Path(args.out_dir)
    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    runs = {args.model: args.context_tokens} if args.quick else {p: PRESETS[p] for p in args.presets.split(",")}
    deadline = time.time() + 60 * args.max_minutes if args.max_minutes else float("inf")
    haystack = Path(args.haystack).read_text()[:2_000_000] if not args.from_json else ""
    results = {}
    with lib.report_timer("frontier report"):
        for model, n in runs.items():
            if not args.from_json:
                out = out_dir / "bench" / f"frontier-{file_label(model)}.jsonl"
                run_preset(model, n, 1 if args.quick else args.samples, out, haystack, deadline, args.quick)
                if screen := dict(_field(kv) for kv in args.stage1):
                    run_preset(model, n, 1 if args.quick else args.samples, _screen_path(out, screen), haystack,
                               deadline, args.quick, screen, out)  # fmt: skip
                if args.focus and len(lines := read_lines(out)) > 1:
                    path = out.with_name(out.stem + "-" + _focus_name(args.focus_ranking) + ".jsonl")
                    run_focus(model, n, lines, path, haystack, deadline, args.focus_ranking, args.focus_samples)
        for model in runs if args.quick else PRESETS:  # every preset measured so far, whichever this run was
            out = out_dir / "bench" / f"frontier-{file_label(model)}.jsonl"
            timed = out_dir / "bench" / f"frontier-{file_label(model)}-timing.json"
            lines = read_lines(out)
            if len(lines) < 2:
                continue
            if args.time and model in runs:
                time_preset(model, runs[model], lines, summarize(lines, file_label(model)), timed, haystack, args.quick)
            timing = lib.read_json(timed) if timed.exists() else None
            if timing is not None and (timing.get("digest"), timing.get("samples")) != (
                lines[0]["digest"],
                len(lines) - 1,
            ):
                print(f"{timed}: timed for other results; rerun with --time", file=sys.stderr)
                timing = None
            focus = []
            for ranking in FOCUS_RANKINGS:
                path = out.with_name(out.stem + "-" + _focus_name(ranking) + ".jsonl")
                got = read_lines(path) if path.exists() else []
                if got and got[0].get("digest", "").split(":focus@")[0] != lines[0]["digest"]:
                    print(f"{path}: written for other frontier results; rerun with --focus", file=sys.stderr)
                elif got:
                    focus.append(got)
            results[file_label(model)] = summarize(lines, file_label(model), timing, focus)
            results[file_label(model)]["screens"] = screens_of(out, lines, file_label(model))
    page_path = out_dir / "frontier.md"
    old = read_text(page_path) if page_path.exists() else ""
    kept = old[old.index(HAND_WRITTEN) :] if HAND_WRITTEN in old else ""
    lib.write_text(page_path, render(results, args.quick) + kept)


if __name__ == "__main__":
    main()
