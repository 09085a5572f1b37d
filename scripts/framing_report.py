#!/usr/bin/env python
"""Choose each preset's summary and question framing by measurement; writes docs/framings.md.

Usage: OMP_NUM_THREADS=1 python scripts/framing_report.py [--models gemma-3-270m,smollm2-135m]
       [--max-chars 20000] [--out docs/framings.md] [--json docs/bench/framings.jsonl]

A framing is the text that follows a stored document to ask for something: a summary, or the
answer to a question. Each preset's candidates (below) are scored on real documents — the GPL v3
and two books of the KJV from shared/data, this repository's docs/algorithm.md, and the README of
the `rich` package (installed with rocketkv) — each ingested once per preset (budget 512, the
default) and answered with every candidate from the same cache, through the engine that ships.

Summaries are scored by measurable properties (`summary_scores`):
  coverage  share of the document's 12 key terms (its most frequent words of ≥ 4 letters that
            are not stop words) found in the summary;
  novel     share of the summary's content words found nowhere in the document (invented words,
            such as a "GPLL" licence);
  echo      share of the summary's word trigrams that are in the framing's own text (the model
            repeating the instruction: "The document above is a summary of the document above.");
  loop      the answer stopped on a loop, or fewer than half of its trigrams are distinct;
  short     fewer than 8 words.
  score     coverage − novel − echo − 0.5·loop − 0.5·short (per document; the table's mean).
Questions are scored on three facts planted in each document (at 25%, 50% and 75% of it): the
share answered with the expected value, and the share that echo the template or loop.
The best summary framing per preset (highest mean score) is what `summarize` ships
(`prompts/summarize_plain.txt`, `prompts/summarize_chat.txt`). Takes about 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rocketkv_cli.eval.reports import read_jsonl, report_timer, write_jsonl, write_text

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
STOP_WORDS = set(
    "a about above after again against all also an and any are as at be because been before being below between "
    "both but by can could did do does doing down during each few for from further had has have having he her here "
    "hers him his how i if in into is it its itself just may me might more most must my no nor not now of off on "
    "once only or other our out over own same shall she should so some such than that the their them then there "
    "these they this those through thy thee thou to too under until up upon very was we were what when where which "
    "while who whom why will with would ye you your unto".split()
)
PLAIN_PREFIX = "The following is a document.\n\n{document}"
CHAT_PREFIX = "Read the document below.\n\n<document>\n{document}\n</document>\n\n"
QUESTION_OF_SUMMARY = "Summarize the document above in a few sentences."


@dataclass(frozen=True)
class Framing:
    """One candidate: `template` (the prompt with `{document}` and, for questions, `{question}`),
    the stop strings its answers end at, and a `lead` that starts the answer (part of it)."""

    name: str
    template: str
    stops: tuple[str, ...]
    lead: str = ""


SUMMARY_FRAMINGS = {
    "plain": [
        Framing(
            "question (0.1.0)",
            PLAIN_PREFIX + "\n\nAnswer the question using only the document above. Give a short "
            f"answer.\nQuestion: {QUESTION_OF_SUMMARY}\nAnswer:",
            ("\n\n\n",),
        ),  # fmt: skip
        Framing("tldr", PLAIN_PREFIX + "\n\nTL;DR:", ("\n\n",)),
        Framing("summary:", PLAIN_PREFIX + "\n\nSummary:", ("\n\n",)),
        Framing(
            "three sentences", PLAIN_PREFIX + "\n\nA summary of the document above, in three sentences:\n", ("\n\n",)
        ),  # fmt: skip
        Framing("lead", PLAIN_PREFIX + "\n\nSummary:", ("\n\n",), lead=" This document"),
        Framing(
            "one-shot",
            PLAIN_PREFIX + "\n\nExample. Text: a recipe that lists flour, water, salt and yeast and "
            "says to bake the dough for forty minutes.\nSummary: A bread recipe: mix flour, water, salt and yeast, "
            "then bake for forty minutes.\n\nText: the document above.\nSummary:",
            ("\n\n", "\nText:"),
        ),  # fmt: skip
    ],
    "chat": [
        Framing(
            "question (0.1.0)",
            CHAT_PREFIX + "Answer the question using only the document above. Give a short "
            f"answer.\nQuestion: {QUESTION_OF_SUMMARY}",
            (),
        ),  # fmt: skip
        Framing("summarize", CHAT_PREFIX + QUESTION_OF_SUMMARY, ()),
        Framing(
            "three sentences",
            CHAT_PREFIX + "Write a summary of the document above in three sentences: what "
            "it is, and its main points. Use only facts from the document.",
            (),
        ),  # fmt: skip
        Framing("tldr", CHAT_PREFIX + "TL;DR of the document above:", ()),
        Framing("lead", CHAT_PREFIX + QUESTION_OF_SUMMARY, (), lead="This document"),
    ],
}
QUESTION_FRAMINGS = {
    "plain": [
        Framing(
            "shipped",
            PLAIN_PREFIX + "\n\nAnswer the question using only the document above. Give a short "
            "answer.\nQuestion: {question}\nAnswer:",
            ("\n\n", "\nQuestion:"),
        ),  # fmt: skip
        Framing("question/answer", PLAIN_PREFIX + "\n\nQuestion: {question}\nAnswer:", ("\n\n", "\nQuestion:")),
        Framing("q/a", PLAIN_PREFIX + "\n\nQ: {question}\nA:", ("\n\n", "\nQ:")),
    ],
    "chat": [
        Framing(
            "shipped",
            CHAT_PREFIX + "Answer the question using only the document above. Give a short answer.\n"
            "Question: {question}",
            (),
        ),  # fmt: skip
        Framing("plain question", CHAT_PREFIX + "{question}", ()),
        Framing("one sentence", CHAT_PREFIX + "Answer in one sentence, using only the document above: {question}", ()),
    ],
}
FACTS = [
    ("The access code for the north gate is 4817.", "What is the access code for the north gate?", "4817"),
    ("The harbor pilot on duty is named Selma Okafor.", "What is the name of the harbor pilot on duty?", "Okafor"),
    ("The spare key is kept in the blue tin box.", "Where is the spare key kept?", "blue tin"),
]


def documents(max_chars: int) -> dict[str, str]:
    """The real documents, each cut at a line end to at most `max_chars` characters."""
    kjv = (DATA / "kjv.txt").read_text(encoding="utf-8-sig").splitlines()
    docs = {
        "gpl-3": (DATA / "gpl-3.txt").read_text(),
        "ruth": "\n".join(line for line in kjv if re.match(r"Ruth\d", line)),
        "jonah": "\n".join(line for line in kjv if re.match(r"Jonah\d", line)),
        "algorithm.md": (ROOT / "docs" / "algorithm.md").read_text(),
        "rich README": importlib.metadata.metadata("rich").get_payload(),  # type: ignore[attr-defined]
    }
    out = {}
    for name, text in docs.items():
        if len(text) > max_chars:
            text = text[: text.rindex("\n", 0, max_chars)]
        out[name] = text.strip() + "\n"
    return out


def planted(text: str) -> str:
    """`text` with the FACTS as lines of their own at 25%, 50% and 75% of it (at line ends)."""
    for fact, depth in zip(reversed(FACTS), (0.75, 0.5, 0.25)):
        cut = text.index("\n", int(len(text) * depth)) + 1
        text = text[:cut] + fact[0] + "\n" + text[cut:]
    return text


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def stem(word: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if len(word) > len(suffix) + 3 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


def key_terms(text: str, n: int = 12) -> list[str]:
    counts = Counter(stem(w) for w in words(text) if len(w) >= 4 and w not in STOP_WORDS)
    return [w for w, _ in counts.most_common(n)]


def trigrams(ws: list[str]) -> list[tuple[str, ...]]:
    return [tuple(ws[i : i + 3]) for i in range(len(ws) - 2)]


def summary_scores(summary: str, document: str, prompt: str, stop_reason: str) -> dict:
    """The properties above for one summary (`prompt`: the framing's text around the document)."""
    ws = words(summary)
    doc_stems = {stem(w) for w in words(document)}
    content = [w for w in ws if len(w) >= 3 and w not in STOP_WORDS]
    terms = key_terms(document)
    got = {stem(w) for w in ws}
    tri = trigrams(ws)
    prompt_tri = set(trigrams(words(prompt)))
    row = {
        "coverage": sum(t in got for t in terms) / len(terms),
        "novel": sum(stem(w) not in doc_stems for w in content) / max(1, len(content)),
        "echo": sum(t in prompt_tri for t in tri) / max(1, len(tri)),
        "loop": stop_reason == "repetition" or (len(tri) >= 4 and len(set(tri)) < 0.5 * len(tri)),
        "short": len(ws) < 8,
        "words": len(ws),
    }
    row["score"] = row["coverage"] - row["novel"] - row["echo"] - 0.5 * row["loop"] - 0.5 * row["short"]
    return row


def ask_framed(rk, cache, framing: Framing, question: str = "", max_new_tokens: int = 160):
    """Answer `framing` (with `question` in it) from `cache` through the shipped decode loop."""
    from rocketkv_cli.engine.answer import Answerer, decode_config_for
    from rocketkv_cli.engine.documents import tokenize
    from rocketkv_cli.model.templates import follow_up

    engine = rk.engine
    after = follow_up(engine.tokenizer, engine.prompt, framing.template.replace("{question}", question))
    ids = tokenize(engine.tokenizer, after + framing.lead, False)
    answerer = Answerer(
        engine, cache, max_new_tokens, decode_config_for(cache), framing.stops, question_tokens=len(ids)
    )
    ans = answerer.ask(question or framing.name, ids)
    text = f"{framing.lead.strip()} {ans.text}".strip() if framing.lead else ans.text
    return text, ans


def run_model(model: str, docs: dict[str, str], log) -> list[dict]:
    from rocketkv_cli import RocketKV

    rk = RocketKV.load(model, device="cpu")
    kind = "chat" if rk.engine.prompt.template_id.startswith("chat") else "plain"
    rows = []
    for name, text in docs.items():
        t0 = time.perf_counter()
        cache = rk.ingest(text=text, token_budget=512, max_new_tokens=256).cache
        log(f"{model} {name}: {cache.n_context_tokens} tokens ingested in {time.perf_counter() - t0:.0f}s")
        for framing in SUMMARY_FRAMINGS[kind]:
            summary, ans = ask_framed(rk, cache, framing, max_new_tokens=160)
            prompt = framing.template.replace("{document}", " ")
            row = {"model": model, "task": "summary", "document": name, "framing": framing.name, "text": summary,
                   "stop_reason": ans.stop_reason, **summary_scores(summary, text, prompt, ans.stop_reason)}  # fmt: skip
            rows.append(row)
            log(f"  summary [{framing.name}] score {row['score']:.2f}: {summary[:150]!r}")
        cache = rk.ingest(text=planted(text), token_budget=512, max_new_tokens=256).cache
        for framing in QUESTION_FRAMINGS[kind]:
            for fact, question, expected in FACTS:
                answer_text, ans = ask_framed(rk, cache, framing, question, max_new_tokens=48)
                row = {"model": model, "task": "question", "document": name, "framing": framing.name,
                       "question": question, "text": answer_text, "stop_reason": ans.stop_reason,
                       "correct": expected.lower() in answer_text.lower(),
                       "echo": "question:" in answer_text.lower() or "answer:" in answer_text.lower(),
                       "loop": ans.stop_reason == "repetition", "empty": not answer_text.strip()}  # fmt: skip
                rows.append(row)
            hits = sum(r["correct"] for r in rows[-len(FACTS) :])
            log(f"  questions [{framing.name}] {hits}/{len(FACTS)} correct")
    return rows


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def report(rows: list[dict], docs: dict[str, str]) -> str:
    """docs/framings.md: tables, the choice per preset, and the summaries of the GPL."""
    models = sorted({r["model"] for r in rows}, key=lambda m: m != "gemma-3-270m")
    lines = ["# Framings: how each preset is asked for a summary and an answer", "",
             "Written by `python scripts/framing_report.py` (the script's docstring defines every measure). "
             "Documents: " + ", ".join(f"{n} ({len(t):,} characters)" for n, t in docs.items()) + "; each ingested "
             "once per preset at budget 512 and answered with every candidate from the same cache.", ""]  # fmt: skip
    best: dict[str, str] = {}
    for model in models:
        summ = [r for r in rows if r["model"] == model and r["task"] == "summary"]
        names = list(dict.fromkeys(r["framing"] for r in summ))
        lines += [f"## {model}: summaries", "",
                  "| framing | score | coverage | novel | echo | loops | short | words | " +
                  " | ".join(f"score {d}" for d in docs) + " |",
                  "| --- " * (8 + len(docs)) + "|"]  # fmt: skip
        scored = []
        for name in names:
            rs = [r for r in summ if r["framing"] == name]
            by_doc = {r["document"]: r["score"] for r in rs}
            scored.append((mean(r["score"] for r in rs), name))
            lines.append(f"| {name} | {mean(r['score'] for r in rs):.2f} | {mean(r['coverage'] for r in rs):.2f} | "
                         f"{mean(r['novel'] for r in rs):.2f} | {mean(r['echo'] for r in rs):.2f} | "
                         f"{sum(r['loop'] for r in rs)}/{len(rs)} | {sum(r['short'] for r in rs)}/{len(rs)} | "
                         f"{mean(r['words'] for r in rs):.0f} | " +
                         " | ".join(f"{by_doc.get(d, float('nan')):.2f}" for d in docs) + " |")  # fmt: skip
        best[model] = max(scored)[1]
        lines += ["", f"Best summary framing for {model}: **{best[model]}**.", ""]
        qs = [r for r in rows if r["model"] == model and r["task"] == "question"]
        lines += [f"## {model}: questions about planted facts", "",
                  "| framing | correct | echo the template | loops | empty |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for name in dict.fromkeys(r["framing"] for r in qs):
            rs = [r for r in qs if r["framing"] == name]
            lines.append(f"| {name} | {sum(r['correct'] for r in rs)}/{len(rs)} | {sum(r['echo'] for r in rs)} | "
                         f"{sum(r['loop'] for r in rs)} | {sum(r['empty'] for r in rs)} |")  # fmt: skip
        lines.append("")
    lines += default_preset(rows, best)
    lines += ["## The summaries of the GPL", ""]
    for model in models:
        for r in rows:
            if r["model"] == model and r["task"] == "summary" and r["document"] == "gpl-3":
                lines.append(f"- {model}, {r['framing']} (score {r['score']:.2f}): {json.dumps(r['text'][:400])}")
    return "\n".join(lines) + "\n"


def default_preset(rows: list[dict], best: dict[str, str], current: str = "gemma-3-270m") -> list[str]:
    """The rule for the default preset: another preset replaces the current default only if it
    is better both at summaries (mean score of each preset's best framing) and at questions
    (planted facts answered with the shipped framing)."""
    summary = {m: mean(r["score"] for r in rows if r["model"] == m and r["task"] == "summary"
                       and r["framing"] == f) for m, f in best.items()}  # fmt: skip
    novel = {m: mean(r["novel"] for r in rows if r["model"] == m and r["task"] == "summary"
                     and r["framing"] == f) for m, f in best.items()}  # fmt: skip
    qa = {m: sum(r["correct"] for r in rows if r["model"] == m and r["task"] == "question" and r["framing"] == "shipped")
          for m in best}  # fmt: skip
    n_q = {m: sum(1 for r in rows if r["model"] == m and r["task"] == "question" and r["framing"] == "shipped")
           for m in best}  # fmt: skip
    better = [m for m in best if m != current and summary[m] > summary.get(current, -9) and qa[m] > qa.get(current, 0)]
    choice = better[0] if better else current
    out = ["## Default preset for `ask` and `summarize`", "",
           "Rule: another preset replaces the default only if it is better at both summaries (mean score of its "
           "best framing) and questions (planted facts answered, shipped framing, budget 512).", ""]  # fmt: skip
    out += [f"- {m}: summary score {summary[m]:.2f} (novel words {novel[m]:.2f}) with '{best[m]}'; "
            f"planted facts answered {qa[m]}/{n_q[m]}" for m in best]  # fmt: skip
    out += ["", f"Default: **{choice}**" + (" (unchanged)." if choice == current else "."), ""]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--models", default="gemma-3-270m,smollm2-135m")
    ap.add_argument("--max-chars", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "framings.md")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "framings.jsonl")
    ap.add_argument("--from-json", action="store_true", help="rewrite the page from --json without running")
    args = ap.parse_args()
    docs = documents(args.max_chars)
    log = lambda message: print(message, file=sys.stderr, flush=True)
    if args.from_json:
        rows = read_jsonl(args.json)
    else:
        rows = [row for model in args.models.split(",") for row in run_model(model, docs, log)]
        write_jsonl(args.json, rows)
    write_text(args.out, report(rows, docs))
    log(f"wrote {args.out} and {args.json}")


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        main()
