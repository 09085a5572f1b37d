"""Fresh `rocketkv ask` processes with each decode weight format of a preset, side by side in one
run: model load time, decode milliseconds per token, wall time per question, and whether the
answers are the same.

    python benchmarks/answer_weights.py      # gemma-3-270m: head-bf16 vs head-int4, the GPL, 10 questions x 2
    python benchmarks/answer_weights.py --smoke     # float, head-bf16, head-int4, mlp-bf16: tests/data/harbor.txt

The document (the first --chars characters of --text) is ingested once with the preset's
defaults (kept in --workdir). One warm-up `ask` per format (the first writes what the format
keeps under the rocketkv home: head-int4's prepared head), then, question by question, one fresh
`rocketkv ask --no-server --json` process per format, their order alternating, so a machine whose
load changes slows every format alike. Load time is the "loaded … in X s" line, decode ms per
token is the answer's `decode_s` over its tokens, wall time is taken around the process. Results
go to --out as JSON and print as a table with each format's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rocketkv_cli.eval.reports import table, write_json

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "Can I charge a fee for distributing copies of the program?",
    "What must I provide with the object code?",
    "What happens to my license if I violate the terms?",
    "Can I add further restrictions to the license?",
    "What is Corresponding Source?",
    "Does the license cover patents?",
    "What does the preamble say about the freedom to change software?",
    "Who is protected by the GPL's disclaimer of warranty?",
    "What is a User Product?",
    "How can I apply these terms to a new program?",
]
LOADED = re.compile(r"loaded .* in ([0-9.]+)s")


def rocketkv() -> str:
    exe = Path(sys.executable).parent / "rocketkv"
    return str(exe) if exe.exists() else "rocketkv"


def ask(cache: Path, question: str, weights: str, max_new_tokens: int, env: dict) -> dict:
    """One fresh `rocketkv ask` process: wall and load seconds, decode seconds, tokens, answer.
    Raises RuntimeError when it fails."""
    argv = [rocketkv(), "ask", "--cache", str(cache), question, "--weights", weights, "--no-server", "--json",
            "--max-new-tokens", str(max_new_tokens)]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    (record,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    loaded = LOADED.search(done.stderr)
    return {"wall_s": wall, "load_s": float(loaded.group(1)) if loaded else None, "decode_s": record["decode_s"],
            "tokens": record["n_answer_tokens"], "answer": record["answer"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tests/data/harbor.txt, one question, 8 tokens (CI)")
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--formats", nargs="+", default=["head-bf16", "head-int4"])
    p.add_argument("--text", type=Path, default=Path("/work/shared/data/gpl-3.txt"))
    p.add_argument("--chars", type=int, default=30000, help="characters of --text ingested (default: ~6.5K tokens)")
    p.add_argument("--questions", type=int, default=len(QUESTIONS))
    p.add_argument("--rounds", type=int, default=2, help="times each question is asked per format")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/answer-weights"))
    p.add_argument("--out", type=Path, help="JSON result (default without --smoke: docs/bench/answer-weights-M.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.text, args.chars, args.questions, args.rounds, args.max_new_tokens = (
            REPO / "tests" / "data" / "harbor.txt", 4000, 1, 1, 8)  # fmt: skip
        args.formats = ["float", "head-bf16", "head-int4", "mlp-bf16"]
    questions = ["Where does the harbor master keep the tide tables?"] if args.smoke else QUESTIONS[: args.questions]
    out = args.out or (None if args.smoke else REPO / "docs" / "bench" / f"answer-weights-{args.model}.json")
    env = {**os.environ, "ROCKETKV_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    args.workdir.mkdir(parents=True, exist_ok=True)
    doc, cache = args.workdir / "doc.txt", args.workdir / f"doc-{args.model}.kv"
    text = args.text.read_text(encoding="utf-8")[: args.chars]
    if not cache.exists() or not doc.exists() or doc.read_text(encoding="utf-8") != text:
        doc.write_text(text, encoding="utf-8")
        subprocess.run([rocketkv(), "ingest", str(doc), "-m", args.model, "-o", str(cache), "--force", "--quiet"],
                       check=True, env=env, timeout=3600)  # fmt: skip
    for fmt in [] if args.smoke else args.formats:  # warm-up: the page cache, what a format keeps under the home
        ask(cache, questions[0], fmt, 4, env)
    runs: dict[str, list[dict]] = {fmt: [] for fmt in args.formats}
    for r in range(args.rounds):
        for i, question in enumerate(questions):
            order = args.formats if (r + i) % 2 == 0 else args.formats[::-1]
            for fmt in order:
                runs[fmt].append({"question": question, **ask(cache, question, fmt, args.max_new_tokens, env)})
            print(f"round {r + 1}/{args.rounds}, question {i + 1}/{len(questions)}", file=sys.stderr)
    first = args.formats[0]
    summary = {}
    for fmt, rows in runs.items():
        tokens = sum(x["tokens"] for x in rows)
        loads = [x["load_s"] for x in rows if x["load_s"] is not None]
        summary[fmt] = {
            "wall_s_median": statistics.median(x["wall_s"] for x in rows),
            "load_s_median": statistics.median(loads) if loads else None,
            "decode_ms_per_token": 1e3 * sum(x["decode_s"] for x in rows) / max(tokens, 1),
            "answers_same_as_first": sum(x["answer"] == y["answer"] for x, y in zip(rows, runs[first])),
            "answers": len(rows),
        }
    base = summary[first]
    header = ["weights", "wall s (median)", "load s (median)", "decode ms/token", f"decode vs {first}",
              f"answers = {first}'s"]  # fmt: skip
    rows = [[fmt, f"{s['wall_s_median']:.2f}", "–" if s["load_s_median"] is None else f"{s['load_s_median']:.2f}",
             f"{s['decode_ms_per_token']:.1f}", f"{base['decode_ms_per_token'] / s['decode_ms_per_token']:.2f}×",
             f"{s['answers_same_as_first']} of {s['answers']}"] for fmt, s in summary.items()]  # fmt: skip
    print(f"{args.model}, {len(questions)} questions × {args.rounds} rounds, {args.max_new_tokens}-token answers, "
          f"{args.threads} threads, cache {cache} ({args.chars:,} characters of {args.text.name})")  # fmt: skip
    print("\n".join(table(header, rows)))
    if out is not None:
        write_json(out, {"model": args.model, "text": args.text.name, "chars": args.chars, "threads": args.threads,
                         "max_new_tokens": args.max_new_tokens, "summary": summary, "runs": runs})  # fmt: skip
        print(f"wrote {out}", file=sys.stderr)
    mismatched = [fmt for fmt, s in summary.items() if s["answers_same_as_first"] != s["answers"]]
    if mismatched:
        print(f"answers differ from {first}'s with: {', '.join(mismatched)}", file=sys.stderr)
    # head-int4's greedy tokens are proven to be the float head's: a difference is a bug
    return 1 if first == "float" and "head-int4" in mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
