#!/usr/bin/env python
"""Checks `rocketkv summarize` on real documents (issue 37); writes docs/summaries.md and its JSON.

Usage: OMP_NUM_THREADS=1 python scripts/summary_check_report.py [--presets gemma-3-270m,smollm2-135m]
       [--documents gpl,ruth,jonah] [--runs model,extractive] [--quick] [--out PAGE] [--json FILE]
       [--from-json] [--resume] [--cache NAME=FILE.kv]

`--resume` keeps the records of --json already made (the JSON is written after every summary) and
runs only the others. `--documents` also takes `kjv` (the whole book) and `NAME=PATH` (any text
file). `--cache NAME=FILE.kv`: that document's runs summarize FILE.kv (`summarize --cache`: a book
whose ingest is too long to repeat per run) instead of the text; the check still reads the text.

Documents: the GPL v3 (`gpl-3.txt`) and books of the KJV sliced from `kjv.txt` at run time
(`book`: every line that starts with the book's reference prefix and a chapter number, e.g.
"Ruth1:1 …" for Ruth, "Ge1:1 …" for Genesis; Ruth, Jonah, Mark, Genesis), both from shared/data beside the repository
(`--data`). Each document is summarized by the installed CLI in a subprocess, once per preset and
run: "model" (`rocketkv summarize DOC --json --write-from document`: the model writes, with the
retry and extractive fallback of a rejected result), "extractive" (`--extractive`) and
"sentences" (`--write-from sentences`). Each summary is checked with
`rocketkv_cli/api/summary_check.py` (the rules are in its docstring) against the document's
text and every prompt in prompts/. `--quick` (a smoke run, about 2 minutes on 2 cores): the GPL,
gemma-3-270m, the model run, written under build/summary-check-quick/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from rocketkv_cli.eval.reports import kept, read_json, read_text, report_timer, table, write_json, write_text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rocketkv_cli.api.summary_check import check_summary  # noqa: E402  (standard library only)

DATA = ROOT.parent / "shared" / "data"  # beside the clone (CI), else ROCKETKV_SHARED_DATA or /work/shared/data
if not DATA.is_dir():
    DATA = Path(os.environ.get("ROCKETKV_SHARED_DATA", "/work/shared/data"))
BOOKS = {"ruth": "Ruth", "jonah": "Jonah", "mark": "Mark", "genesis": "Ge"}  # name → the KJV reference prefix
DOCUMENTS = ("gpl", "ruth", "jonah")  # the default set; mark and genesis on request
RUNS = {
    "model": ["--write-from", "document"],
    "extractive": ["--extractive"],
    "sentences": ["--write-from", "sentences"],
}


def book(kjv: str, prefix: str) -> str:
    """The lines of `kjv` that start with `prefix` and a chapter number ("Ruth1:1 Now it came…")."""
    lines = [line for line in kjv.splitlines(keepends=True) if re.match(rf"{re.escape(prefix)}\d+:\d+ ", line)]
    if not lines:
        raise SystemExit(f"error: no line of the KJV starts with {prefix}<chapter>:<verse>")
    return "".join(lines)


def documents(data: Path, names: list[str]) -> dict[str, str]:
    """Text of each named document (`gpl`, `kjv`, a book of BOOKS, or NAME=PATH)."""
    out = {}
    for name in names:
        if "=" in name:
            name, path = name.split("=", 1)
            out[name] = Path(path).read_text(encoding="utf-8")
        elif name in ("gpl", "kjv"):
            out[name] = (data / ("gpl-3.txt" if name == "gpl" else "kjv.txt")).read_text(encoding="utf-8")
        elif name in BOOKS:
            out[name] = book((data / "kjv.txt").read_text(encoding="utf-8"), BOOKS[name])
        else:
            raise SystemExit(f"error: unknown document {name!r}; choose from gpl, kjv, {', '.join(BOOKS)} or NAME=PATH")
    return out


def rocketkv_bin() -> str:
    """The installed console script beside this Python (a virtual environment's), else on PATH."""
    beside = Path(sys.executable).parent / "rocketkv"
    return str(beside) if beside.exists() else "rocketkv"


def summarize(path: Path, preset: str, run: str, max_new_tokens: int, cache: Path | None = None) -> tuple[dict, float]:
    """The `summarize --json` record of one run (of `cache` when given, else of the text at `path`),
    and its wall time in seconds."""
    source = ["--cache", str(cache)] if cache is not None else [str(path)]
    cmd = [rocketkv_bin(), "summarize", *source, "--model", preset, "--json", "--quiet",
           "--max-new-tokens", str(max_new_tokens), *RUNS[run]]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout), time.perf_counter() - t0


def prompt_texts() -> list[str]:
    """Every prompt of prompts/ (a summary that repeats any of their lines is an echo)."""
    return [p.read_text(encoding="utf-8") for p in sorted((ROOT / "prompts").glob("*.txt"))]


def record(name: str, preset: str, run: str, row: dict, source: str, wall_s: float, cache: Path | None = None) -> dict:
    """One report row: the CLI's record, the check's, and the table's columns (`cache`: the .kv
    summarized instead of the text)."""
    check = check_summary(row["summary"], source, prompt_texts())
    partial_modes = [p["mode"] for p in row.get("partial_summaries", [])]
    return {"document": name, "preset": preset, "run": run, "mode": row["mode"], "rejected": row["rejected"],
            "summary": row["summary"],
            "words": len(row["summary"].split()), "partial_modes": partial_modes, "wall_s": round(wall_s, 1),
            "summarize_s": row["summarize_s"], "check": check.to_dict(),
            "cache": None if cache is None else cache.name}  # fmt: skip


def summary_table(records: list[dict]) -> list[str]:
    """The Markdown table of the records."""
    rows = []
    for r in records:
        c = r["check"]
        missing = f" (absent: {', '.join(c['missing_names'])})" if c["missing_names"] else ""
        rows.append([r["document"], r["preset"], r["run"], r["mode"], r["words"], ", ".join(c["degenerate"]) or "no",
                     f"{c['grounding']:.2f} {'✓' if c['grounding_passed'] else '✗'}{missing}",
                     f"{len(c['named'])}/{c['names_required']} {'✓' if c['coverage_passed'] else '✗'}",
                     "yes" if c["passed"] else "no"])  # fmt: skip
    head = ["document", "preset", "run", "mode", "words", "degenerate?", "grounding", "coverage", "pass"]
    return table(head, rows)


def render(records: list[dict], command: str, quick: bool, day: str, old: str = "") -> str:
    """The page: what was run, the rules (kept from the previous page `old` as written), the table, each summary."""
    n_pass = sum(r["check"]["passed"] for r in records)
    out = ["# Summaries: are they degenerate, grounded, covering?", "",
           *(["QUICK SMOKE RUN (not evidence)", ""] if quick else []),
           f"Written by `{command}` on {day} (times: wall seconds on 2 shared CPU cores, 1–2 threads, other jobs beside some runs: compare within a row, not across): {n_pass} of {len(records)} "
           "summaries pass all three checks.", "",
           *kept(old, "Rules (`rocketkv_cli/api/summary_check.py`", ("| document",)),
           *summary_table(records), "", "## The summaries", ""]  # fmt: skip
    for r in records:
        parts = f"; parts: {', '.join(r['partial_modes'])}" if r["partial_modes"] else ""
        names = ", ".join(r["check"]["named"]) or "none"
        rejected = f"; rejected: {'; '.join(r['rejected'])}" if r["rejected"] else ""
        cache = f"; summarize --cache {r['cache']}" if r.get("cache") else ""
        out.append(f"- {r['document']}, {r['preset']}, {r['run']} ({r['mode']}{cache}{parts}{rejected}; names: {names}; "
                   f"{r['wall_s']} s): {json.dumps(r['summary'], ensure_ascii=False)}")  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    """Run the summaries, check them, write the page and the JSON, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=None, help="comma-separated presets (default gemma-3-270m)")
    ap.add_argument(
        "--documents",
        default=None,
        help=f"comma-separated, of gpl, kjv, {', '.join(BOOKS)} or NAME=PATH (default {','.join(DOCUMENTS)})",
    )
    ap.add_argument("--runs", default=None, help="of model,extractive,sentences (default model,extractive)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--data", type=Path, default=DATA, help="the folder of gpl-3.txt and kjv.txt")
    ap.add_argument("--quick", action="store_true", help="the GPL, gemma-3-270m, the model run")
    ap.add_argument("--from-json", action="store_true", help="rewrite the page from --json without running")
    ap.add_argument("--out", type=Path, default=None, help="the page (default docs/summaries.md)")
    ap.add_argument("--json", type=Path, default=None, help="the records (default docs/bench/summaries.json)")
    ap.add_argument("--resume", action="store_true", help="keep --json's records, run only the others")
    ap.add_argument("--cache", action="append", default=[], metavar="NAME=FILE.kv",
                    help="summarize this .kv for document NAME (repeatable)")  # fmt: skip
    args = ap.parse_args()
    caches = {}
    for spec in args.cache:
        name, _, path = spec.partition("=")
        if not path or not Path(path).is_file():
            ap.error(f"--cache {spec!r}: give NAME=FILE.kv of an existing file")
        caches[name] = Path(path)
    quick_dir = ROOT / "build" / "summary-check-quick"
    presets = (args.presets or "gemma-3-270m").split(",")
    names = (args.documents or ("gpl" if args.quick else ",".join(DOCUMENTS))).split(",")
    runs = (args.runs or ("model" if args.quick else "model,extractive")).split(",")
    if bad := [r for r in runs if r not in RUNS]:
        ap.error(f"unknown run {bad[0]!r}; choose from {', '.join(RUNS)}")
    out = args.out or (quick_dir / "summaries.md" if args.quick else ROOT / "docs" / "summaries.md")
    json_path = args.json or (
        quick_dir / "summaries.json" if args.quick else ROOT / "docs" / "bench" / "summaries.json"
    )
    if args.from_json:
        saved = read_json(json_path)
        write_text(out, render(saved["records"], saved["command"], args.quick, saved["date"], read_text(out)))
        print("\n".join(summary_table(saved["records"])))
        return
    texts = documents(args.data, names)
    command = ("python scripts/summary_check_report.py " + " ".join(a for a in sys.argv[1:] if a != "--resume")).strip()
    day = date.today().isoformat()
    records = read_json(json_path)["records"] if args.resume and json_path.exists() else []
    done = {(r["document"], r["preset"], r["run"]) for r in records}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in texts.items():
            path = Path(tmp) / f"{name}.txt"
            path.write_text(text, encoding="utf-8")
            for preset in presets:
                for run in runs:
                    if (name, preset, run) in done:
                        continue
                    row, wall_s = summarize(path, preset, run, args.max_new_tokens, caches.get(name))
                    records.append(record(name, preset, run, row, text, wall_s, caches.get(name)))
                    print(f"{name} {preset} {run}: {row['mode']} in {wall_s:.0f}s", file=sys.stderr)
                    write_json(json_path, {"command": command, "date": day, "records": records}, end="\n",
                               ensure_ascii=False)  # fmt: skip
    write_text(out, render(records, command, args.quick, day, read_text(out)))
    print("\n".join(summary_table(records)))


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        main()
