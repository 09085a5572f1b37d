"""The captured decode step (`--compile-step`, model/captured.py) against the eager direct step,
side by side in one process: greedy answers identical or not, and decode milliseconds per token.

    python benchmarks/captured_step.py          # smollm2-135m, the GPL, 40 questions, 48 tokens
    python benchmarks/captured_step.py --smoke  # tiny: tests/data/harbor.txt, 2 questions, 8 tokens

One model, one cache (the first --chars characters of --text, ingested with the preset's
defaults, kept in --workdir). Question by question, the same `Answerer` answers with the eager
step and with the captured one, their order alternating, so a machine whose load changes slows
both alike; the captured step is compiled (and timed) before the first question. Decode ms per
token is each answer's `decode_s` over its tokens; the summary is the median over questions.
Results go to --out as JSON; the table prints each question that differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from answer_weights import QUESTIONS as ANSWER_WEIGHTS_QUESTIONS  # benchmarks/ is on sys.path when run

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ANSWER_WEIGHTS_QUESTIONS + [  # the GPL's questions there, then 30 more
    "Who publishes this license?",
    "What is the purpose of this license?", "Can I sell copies of the program?",
    "What is an aggregate?", "What does convey mean?", "What does propagate mean?",
    "What is the System Libraries exception?", "What are Installation Information?",
    "Can I use the program privately without accepting the license?", "What is a covered work?",
    "How long does the source code offer last?", "Can I distribute the program over a network server?",
    "What does the license say about DRM?", "What are additional permissions?",
    "How do I get my license back after termination?", "What is an entity transaction?",
    "What is a contributor?", "What is a patent license?", "Is there a warranty for the program?",
    "What happens if a court imposes conditions that contradict this license?",
    "Can the Free Software Foundation publish new versions of the GPL?", "What is the Program?",
    "What is object code?", "What must interactive user interfaces display?",
    "Can I remove the copyright notices?", "Who can accept this license?",
    "Does the license allow linking into proprietary programs?", "What is the Lesser GPL for?",
    "What should I put at the start of each source file?", "Who wrote the GPL?",
]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", type=Path, default=REPO.parent / "shared" / "data" / "gpl-3.txt")
    p.add_argument("--chars", type=int, default=40_000)
    p.add_argument("--questions", type=int, default=len(QUESTIONS))
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=int(os.environ.get("ROCKETKV_THREADS", "2")))
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rocketkv-captured-step"))
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: none)")
    p.add_argument("--smoke", action="store_true", help="a tiny run that CI makes")
    a = p.parse_args()
    if a.smoke:
        a.text, a.chars, a.questions, a.max_new_tokens = REPO / "tests" / "data" / "harbor.txt", 3000, 2, 8

    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.eval.reports import table, write_json
    from rocketkv_cli.model.captured import CapturedStep

    rk = RocketKV.load(a.model, threads=a.threads)
    a.workdir.mkdir(parents=True, exist_ok=True)
    path = a.workdir / f"{a.model}-{a.text.stem}-{a.chars}.kv"
    if not path.exists():
        rk.ingest(text=a.text.read_text(encoding="utf-8")[: a.chars], output=path)
    cache = rk.open(path)
    eager = rk.engine.step
    if eager is None:
        sys.exit(f"{a.model} has no direct decode step to capture")
    captured = CapturedStep(eager)
    steps = {"eager": eager, "captured": captured}

    def answer(name: str, question: str):
        rk.engine.step = steps[name]
        return next(iter(rk.ask(cache, question, max_new_tokens=a.max_new_tokens)))

    t0 = time.perf_counter()
    answer("captured", QUESTIONS[0])  # compiles
    compile_s = time.perf_counter() - t0
    if captured.failure is not None or captured.captured_steps == 0:
        sys.exit(f"the captured step did not run: {captured.failure or 'not applicable to this model'}")
    rows = []
    for i, q in enumerate(QUESTIONS[: a.questions]):
        order = ("eager", "captured") if i % 2 == 0 else ("captured", "eager")
        got = {name: answer(name, q) for name in order}
        e, c = got["eager"], got["captured"]
        rows.append({"question": q, "same": e.token_ids == c.token_ids, "eager": e.text, "captured": c.text,
                     "tokens": e.n_answer_tokens,
                     "eager_ms": 1e3 * e.decode_s / max(e.n_answer_tokens, 1),
                     "captured_ms": 1e3 * c.decode_s / max(c.n_answer_tokens, 1)})  # fmt: skip
        print(f"{i + 1}/{a.questions} same={rows[-1]['same']} eager {rows[-1]['eager_ms']:.1f} ms/token, "
              f"captured {rows[-1]['captured_ms']:.1f}", file=sys.stderr, flush=True)  # fmt: skip
    rk.engine.step = eager
    eager_ms = statistics.median(r["eager_ms"] for r in rows)
    captured_ms = statistics.median(r["captured_ms"] for r in rows)
    same = sum(r["same"] for r in rows)
    summary = {"model": a.model, "text": a.text.name, "chars": a.chars, "threads": a.threads,
               "max_new_tokens": a.max_new_tokens, "questions": len(rows), "identical_answers": same,
               "eager_ms_per_token": eager_ms, "captured_ms_per_token": captured_ms,
               "speedup": eager_ms / captured_ms, "first_answer_with_compile_s": compile_s,
               "captured_steps": captured.captured_steps}  # fmt: skip
    for line in table(["", "eager step", "captured step", "×"],
                      [["decode ms/token (median)", f"{eager_ms:.1f}", f"{captured_ms:.1f}",
                        f"{eager_ms / captured_ms:.2f}"],
                       ["greedy answers identical", "", f"{same} of {len(rows)}", ""]], "lrrr"):  # fmt: skip
        print(line)
    print(f"first answer with the compile: {compile_s:.1f} s")
    for r in rows:
        if not r["same"]:
            print(f"differs: {r['question']!r}\n  eager:    {r['eager']!r}\n  captured: {r['captured']!r}")
    if a.out is not None:
        write_json(a.out, {"summary": summary, "rows": rows}, indent=1, end="\n")
    if a.smoke and (captured.captured_steps == 0 or not all(r["same"] for r in rows)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
