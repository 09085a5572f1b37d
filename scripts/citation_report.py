#!/usr/bin/env python
"""How often `ask --cite` cites the passage that holds the answer; writes docs/citations.md.

Usage: OMP_NUM_THREADS=1 python scripts/citation_report.py [--runs gemma-3-270m:512,...]
       [--out docs/citations.md] [--json docs/bench/citations.jsonl] [--from-json]

Five facts (a code, a name, a place, a date, a number) are planted as lines of their own at 10%,
30%, 50%, 70% and 90% of each of five real documents (the documents of
scripts/framing_report.py: the GPL v3, two books of the KJV, docs/algorithm.md, the README of
`rich`), which are ingested once per run (preset and token budget) and asked one question per
fact through the engine that ships. For each answer the citations are computed from the same
attention mass three ways: "shipped" (what `--cite` does: scores relative to a generic
question's attention, passages picked by their best word token), "plain" (the answer's
attention alone, no baseline) and "line sum" (relative scores, lines ranked by their total).
Reported: the share of questions whose first cited passage holds the planted value (hit@1),
whose three passages do (hit@3), the same among the correctly answered questions, and the
answers' accuracy. About 30 minutes on 2 cores for the default runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rocketkv_cli.eval.reports import read_jsonl, report_timer, write_jsonl, write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from framing_report import ROOT, documents  # noqa: E402

FACTS = [
    ("The access code for the north gate is 4817.", "What is the access code for the north gate?", "4817"),
    ("The harbor pilot on duty is named Selma Okafor.", "What is the name of the harbor pilot on duty?", "Okafor"),
    ("The spare key is kept in the blue tin box.", "Where is the spare key kept?", "blue tin"),
    ("The annual audit is held on the ninth of March.", "When is the annual audit held?", "ninth of March"),
    ("The archive holds exactly 3260 maps.", "How many maps does the archive hold?", "3260"),
]
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_RUNS = "gemma-3-270m:512,gemma-3-270m:full,smollm2-135m:512"


def plant(text: str) -> tuple[str, list[int]]:
    """`text` with FACTS[i] as a line of its own at DEPTHS[i]; returns it and each planted value's
    character offset in it."""
    for (fact, _, _), depth in sorted(zip(FACTS, DEPTHS), key=lambda fd: -fd[1]):
        cut = text.index("\n", int(len(text) * depth)) + 1
        text = text[:cut] + fact + "\n" + text[cut:]
    return text, [text.index(fact) + fact.index(value) for fact, _, value in FACTS]


def hit(citations, position: int) -> bool:
    return any(c.start <= position < c.end for c in citations)


def run(model: str, budget: str, docs: dict[str, str], log) -> list[dict]:
    from rocketkv_cli import RocketKV
    from rocketkv_cli.engine.answer import Answerer, decode_config_for
    from rocketkv_cli.engine.cite import baseline_mass, cite, token_scores
    from rocketkv_cli.model.hf import attention_mass

    rk = RocketKV.load(model, device="cpu", weights="float")  # as docs/citations.md was measured
    token_budget = 10**6 if budget == "full" else int(budget)
    rows = []
    for name, text in docs.items():
        planted, positions = plant(text)
        t0 = time.perf_counter()
        cache = rk.ingest(text=planted, token_budget=token_budget, max_new_tokens=64).cache
        log(f"{model} budget {budget} {name}: {cache.n_context_tokens} tokens in {time.perf_counter() - t0:.0f}s")
        answerer = Answerer(rk.engine, cache, 48, decode_config_for(cache))
        base = baseline_mass(rk.engine, answerer.decoder, cache)
        for (fact, question, value), position in zip(FACTS, positions):
            with attention_mass(cache.n_context_tokens, rk.engine.loaded.device) as mass:
                ans = answerer.ask(question)
            relative, plain = token_scores(mass, base), token_scores(mass, None)
            tok = rk.engine.tokenizer
            by = {"shipped": cite(tok, cache, *relative, 3), "plain": cite(tok, cache, *plain, 3),
                  "sum": cite(tok, cache, *relative, 3, rank="sum")}  # fmt: skip
            row = {"model": model, "budget": budget, "document": name, "question": question, "answer": ans.text,
                   "correct": value.lower() in ans.text.lower(),
                   **{f"{rank}_hit1": hit(cs[:1], position) for rank, cs in by.items()},
                   **{f"{rank}_hit3": hit(cs, position) for rank, cs in by.items()},
                   "citations": [c.to_dict() for c in by["shipped"]]}  # fmt: skip
            rows.append(row)
            log(f"  {question} -> {ans.text[:60]!r}; hit@1 {row['shipped_hit1']}, @3 {row['shipped_hit3']}")
    return rows


def share(rows: list[dict], key: str) -> str:
    return f"{sum(r[key] for r in rows)}/{len(rows)}" if rows else "-"


def report(rows: list[dict], docs: dict[str, str]) -> str:
    lines = ["# Citations: does `ask --cite` point at the passage that holds the answer?", "",
             "Written by `python scripts/citation_report.py` (its docstring describes the method). Five facts planted "
             "as lines of their own in each of " + ", ".join(docs) + "; one question per fact. A hit: the cited "
             "passage's characters include the planted value. *shipped* is what `--cite` does; *plain* ranks by "
             "the answer's attention alone (no generic-question baseline); *line sum* ranks whole lines.", "",
             "| preset | budget | answered correctly | shipped hit@1 | shipped hit@3 | shipped hit@1 when correct | "
             "plain hit@1 | plain hit@3 | line sum hit@1 |", "| --- " * 9 + "|"]  # fmt: skip
    for key in dict.fromkeys((r["model"], r["budget"]) for r in rows):
        rs = [r for r in rows if (r["model"], r["budget"]) == key]
        good = [r for r in rs if r["correct"]]
        lines.append(f"| {key[0]} | {key[1]} | {share(rs, 'correct')} | {share(rs, 'shipped_hit1')} | "
                     f"{share(rs, 'shipped_hit3')} | {share(good, 'shipped_hit1')} | {share(rs, 'plain_hit1')} | "
                     f"{share(rs, 'plain_hit3')} | {share(rs, 'sum_hit1')} |")  # fmt: skip
    lines += ["", "Per document (shipped hit@1 / questions):", ""]
    for key in dict.fromkeys((r["model"], r["budget"]) for r in rows):
        per = []
        for doc in docs:
            rs = [r for r in rows if (r["model"], r["budget"]) == key and r["document"] == doc]
            per.append(f"{doc} {share(rs, 'shipped_hit1')}")
        lines.append(f"- {key[0]} at budget {key[1]}: " + ", ".join(per))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="preset:budget,... (budget: tokens or full)")
    ap.add_argument("--max-chars", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "citations.md")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "citations.jsonl")
    ap.add_argument("--from-json", action="store_true", help="rewrite the page from --json without running")
    args = ap.parse_args()
    docs = documents(args.max_chars)
    log = lambda message: print(message, file=sys.stderr, flush=True)
    if args.from_json:
        rows = read_jsonl(args.json)
    else:
        rows = []
        for spec in args.runs.split(","):
            model, budget = spec.rsplit(":", 1)
            rows += run(model, budget, docs, log)
        write_jsonl(args.json, rows)
    write_text(args.out, report(rows, docs))
    log(f"wrote {args.out} and {args.json}")


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        main()
