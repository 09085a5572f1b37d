#!/usr/bin/env python
"""Regenerate docs/prose-questions.md: plain questions about real prose, per preset and answering setup.

Usage: python scripts/prose_report.py [--presets P,Q] [--setups S,T] [--from-json]
       python scripts/prose_report.py --quick --model DIR --data DIR   # a smoke run (not evidence)
The question set is tests/data/prose_questions.json (26 questions over the GPL and the books of Ruth
and Jonah, each with hand-written expected strings: an answer is right when it contains one of them,
case-insensitive). Each setup ingests each document through the Python API as `rocketkv ingest` does
and asks every question as `rocketkv ask` does: `full` (every token stored, exact attention), `default`
(the preset's defaults, whatever they are when the report runs), `pruned-512` (the file keeps only what
SnapKV++ keeps for t=512, chosen before the question: the defaults before docs/frontier.md), `focus` (the default
file; each question answered from its 4 best passages by BM25, re-read next to it: `api/focus.py`), and the
focus variants below (`SETUPS`). Results per preset and setup go to
`docs/bench/prose-<preset>.json`, one entry per (setup, document), so a rerun resumes.
Use OMP_NUM_THREADS=1 when anything else runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

from rocketkv_cli.api.focus import FOCUS_PASSAGES
from rocketkv_cli.eval import reports as lib
from rocketkv_cli.eval.reports import table, wilson

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "tests" / "data" / "prose_questions.json"
DATA = ROOT.parent / "shared" / "data"
PRESETS = ("smollm2-135m", "gemma-3-270m")
FULL_BUDGET = 1 << 30  # a token budget above any document: stage 1 keeps everything
# setup → (ingest keywords, ask keywords); "default" takes whatever the preset's defaults are
SETUPS: dict[str, tuple[dict, dict]] = {
    "full": ({"token_budget": FULL_BUDGET}, {"dense": True}),
    "default": ({}, {}),
    "pruned-512": ({"token_budget": 512, "store_budget": 512}, {}),  # SnapKV++ at t=512, no re-selection
    "focus": ({}, {"focus": FOCUS_PASSAGES}),  # the default file; each question re-reads its best passages
    "focus-start": ({}, {"focus": FOCUS_PASSAGES, "keep_start": True}),  # and the document's first passage
    # the default file; passages ranked by the question's own attention over it, or by it and BM25 in turn
    "focus-attention": ({}, {"focus": FOCUS_PASSAGES, "ranking": "attention"}),
    "focus-mixed": ({}, {"focus": FOCUS_PASSAGES, "ranking": "mixed"}),
}


def document_text(spec: dict, data: Path) -> str:
    """A document of the set: a file of `data`, or only its lines starting with one of `line_prefixes`."""
    text = (data / spec["file"]).read_text()
    prefixes = tuple(spec.get("line_prefixes", ()))
    return "\n".join(x for x in text.splitlines() if x.startswith(prefixes)) + "\n" if prefixes else text


def is_right(answer: str, expected: list[str]) -> bool:
    """Right when the answer contains any expected string (case-insensitive)."""
    return any(e.lower() in answer.lower() for e in expected)


def run(model: str, setups: list[str], out: Path, data: Path, limit: int | None) -> dict:
    """Ask every question of the set under each setup (finished (setup, document) entries are kept)."""
    from rocketkv_cli.api.rocketkv import RocketKV, configure
    from rocketkv_cli.core.config import PrefillConfig, with_preset_defaults
    from rocketkv_cli.eval.bench import machine_info

    spec = json.loads(QUESTIONS.read_text())
    done = lib.read_json(out, default=None) or {"model": model, "date": dt.date.today().isoformat(),
                                                "machine": None, "results": {}}  # fmt: skip
    configure(True, progress_bars=False)
    rk = RocketKV.load(model)
    done["machine"] = machine_info()
    made: dict[tuple[str, str], tuple] = {}  # (document, ingest settings) → (Ingested, cache): one ingest each
    with tempfile.TemporaryDirectory() as work:
        for setup in setups:
            ingest_kw, ask_kw = SETUPS[setup]
            wanted = with_preset_defaults(PrefillConfig(**ingest_kw), rk.model_id, ingest_kw).to_dict()
            for doc, dspec in spec["documents"].items():
                key = f"{setup}/{doc}"
                if done["results"].get(key, {}).get("config") == wanted:
                    continue  # measured with the settings this setup has now (the defaults may have changed)
                qs = [q for q in spec["questions"] if q["doc"] == doc][:limit]
                path = Path(work) / f"{doc}.txt"
                path.write_text(document_text(dspec, data))
                same = (doc, json.dumps(wanted, sort_keys=True))
                if same not in made:
                    ing = rk.ingest(str(path), output=Path(work) / f"{setup}-{doc}.kv", force=True, **ingest_kw)
                    made[same] = (ing, rk.open(ing.path))
                ing, cache = made[same]
                if "focus" in ask_kw:  # one question at a time: each re-reads its own passages
                    answers = [rk.ask_focused(cache, q["question"], passages=ask_kw["focus"], max_new_tokens=48,
                                              keep_start=ask_kw.get("keep_start", False),
                                              ranking=ask_kw.get("ranking", "bm25")).answer
                               for q in qs]  # fmt: skip
                else:
                    answers = list(rk.ask(cache, [q["question"] for q in qs], max_new_tokens=48, **ask_kw))
                done["results"][key] = {
                    "config": wanted, "date": dt.date.today().isoformat(), "ingest_s": round(ing.seconds, 1), "file_bytes": Path(ing.path).stat().st_size,
                    "answers": [{"question": q["question"], "expected": q["expected"], "answer": a.text,
                                 "right": is_right(a.text, q["expected"])} for q, a in zip(qs, answers)],
                }  # fmt: skip
                done["date"] = dt.date.today().isoformat()
                lib.write_json(out, done)
                right = sum(a["right"] for a in done["results"][key]["answers"])
                print(f"{model} {key}: {right}/{len(qs)} right", file=sys.stderr, flush=True)
    return done


def render(reports: dict[str, dict], quick: bool) -> str:
    lines = ["# Plain questions about real prose", ""]
    if quick:
        lines += ["**QUICK SMOKE RUN on a tiny model: not evidence.**", ""]
    lines += ["Generated by `python scripts/prose_report.py`: the questions of `tests/data/prose_questions.json` "
              "(the GPL, and the books of Ruth and Jonah from the KJV), each answer checked by hand-written expected "
              "strings; every answer in `docs/bench/prose-<preset>.json`. `full`: every token stored, exact "
              "attention; `default`: what `rocketkv ingest` and `ask` do by default on the date shown; "
              "`pruned-512`: `--budget 512 --store-budget 512`, the file keeps what SnapKV++ keeps for t=512 before "
              "any question (the default before docs/frontier.md); `focus`: the default file, each question answered from "
              "the 4 passages of its text that match it best by BM25, re-read next to it (`RocketKV.ask_focused`, "
              "`rocketkv_cli/api/focus.py`; the file size is the default file's); `focus-start`: the same and the "
              "document's first passage too (its title and front matter); `focus-attention`: the passages ranked "
              "by the question's own attention over the default file instead (every query of its prefill, relative "
              "to a generic question's, the best word token of each passage: `focus.QuestionAttention`); "
              "`focus-mixed`: BM25's and attention's rankings taking turns.", ""]  # fmt: skip
    for model, rep in reports.items():
        m = rep["machine"] or {}
        lines += [f"## {model}", "", f"{rep['date']}: rocketkv {m.get('rocketkv')}, torch {m.get('torch')}, "
                  f"{m.get('threads')} thread(s), {m.get('cpu')}.", ""]  # fmt: skip
        rows = []
        setups = sorted({k.split("/")[0] for k in rep["results"]}, key=lambda s: list(SETUPS).index(s))
        docs = sorted({k.split("/")[1] for k in rep["results"]})
        for setup in setups:
            cells, right, total = [], 0, 0
            for doc in docs:
                r = rep["results"].get(f"{setup}/{doc}")
                k = sum(a["right"] for a in r["answers"]) if r else 0
                n = len(r["answers"]) if r else 0
                right, total = right + k, total + n
                cells.append(f"{k}/{n} ({r['file_bytes'] / 1e6:.1f} MB)" if r else "-")
            lo, hi = wilson(right, total)
            rows.append([setup, *cells, f"{right}/{total} [{100 * lo:.0f}–{100 * hi:.0f}%]"])
        lines += table(["setup", *docs, "all (95% Wilson interval)"], rows, "l" + "r" * (len(docs) + 1)) + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--from-json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a smoke run on --model with 2 questions per document")
    ap.add_argument("--model")
    ap.add_argument("--data", default=str(DATA), help="the folder holding gpl-3.txt and kjv.txt")
    ap.add_argument("--out-dir", default=str(ROOT / "docs"))
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    setups = args.setups.split(",")
    if unknown := [s for s in setups if s not in SETUPS]:
        ap.error(f"unknown setup {unknown[0]!r} (one of {', '.join(SETUPS)})")
    models = [args.model] if args.quick else args.presets.split(",")
    reports = {}
    with lib.report_timer("prose report"):
        for model in models:
            name = Path(model).name
            out = out_dir / "bench" / f"prose-{name}.json"
            if not args.from_json:
                run(model, setups, out, Path(args.data), 2 if args.quick else None)
        for model in models if args.quick else PRESETS:
            out = out_dir / "bench" / f"prose-{Path(model).name}.json"
            if out.exists():
                reports[Path(model).name] = lib.read_json(out)
    lib.write_text(out_dir / "prose-questions.md", render(reports, args.quick))


if __name__ == "__main__":
    main()
