"""A long question's prefill: in chunks with sliding-window keys sliced (what `ask` runs) against
one forward over the whole question with every key attended (what it ran before), side by side.

    python benchmarks/long_question.py          # gemma-3-270m over the GPL; KJV questions of 4K-16K tokens
    python benchmarks/long_question.py --smoke  # tiny: tests/data/harbor.txt, short questions, small chunks

One model, one cache (--text ingested with the preset's defaults, kept in --workdir). Each question
is "Who is named first?" after --question-chars characters of --question-text; the two ways answer
it in turns (their order alternating by round, so a change of load slows both alike), each with an
8-token greedy answer. Printed per length: question tokens, each way's prefill seconds (median over
rounds), their ratio, and whether the answer tokens are the same (the two sum in another order:
float32 rounding may flip a near-tie). Results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--text", type=Path, default=DATA / "gpl-3.txt")
    p.add_argument("--question-text", type=Path, default=DATA / "kjv.txt")
    p.add_argument("--question-chars", default="16000,60000", help="comma-separated lengths in characters")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=int(os.environ.get("ROCKETKV_THREADS", "2")))
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rocketkv-long-question"))
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: none)")
    p.add_argument("--smoke", action="store_true", help="a tiny run that CI makes")
    a = p.parse_args()
    import torch

    from rocketkv_cli import RocketKV
    from rocketkv_cli.engine import decoder
    from rocketkv_cli.model import hf

    chunk, slice_min = decoder.QUESTION_CHUNK_TOKENS, hf.WINDOW_SLICE_MIN_KEYS
    if a.smoke:  # the same code paths at a size CI runs in seconds
        a.text = a.question_text = REPO / "tests" / "data" / "harbor.txt"
        a.question_chars, a.rounds, chunk, slice_min = "900,1700", 1, 128, 128  # harbor.txt: 1,756 characters
    torch.set_num_threads(a.threads)
    a.workdir.mkdir(parents=True, exist_ok=True)
    rk = RocketKV.load(a.model)
    kv = a.workdir / f"{a.model}-{a.text.stem}.kv"
    if not kv.exists():
        rk.ingest(str(a.text), output=kv)
    cache = rk.open(kv)
    source = a.question_text.read_text(encoding="utf-8")
    ways = {"chunked": (chunk, slice_min), "one forward": (1 << 40, 1 << 40)}
    rows = []
    print(f"{a.model}, {cache.n_context_tokens} stored tokens, {a.threads} threads")
    print("| question tokens | chunked s | one forward s | × | same answer |")
    for n_chars in (int(c) for c in a.question_chars.split(",")):
        question = " ".join(source[:n_chars].split()) + "\n\nWho is named first?"
        times: dict[str, list[float]] = {w: [] for w in ways}
        tokens: dict[str, tuple[int, ...]] = {}
        for r in range(a.rounds):
            for way in list(ways)[:: 1 if r % 2 == 0 else -1]:
                decoder.QUESTION_CHUNK_TOKENS, hf.WINDOW_SLICE_MIN_KEYS = ways[way]
                answer = next(iter(rk.ask(cache, question, max_new_tokens=8)))
                times[way].append(answer.prefill_s)
                tokens[way] = answer.token_ids
        med = {w: statistics.median(t) for w, t in times.items()}
        same = tokens["chunked"] == tokens["one forward"]
        rows.append({"question_tokens": answer.n_question_tokens, "prefill_s": times, "same_answer": same})
        speedup = med["one forward"] / med["chunked"]
        print(f"| {answer.n_question_tokens} | {med['chunked']:.2f} | {med['one forward']:.2f} | {speedup:.2f} | "
              f"{'yes' if same else 'no'} |")  # fmt: skip
    if a.out is not None:
        a.out.write_text(json.dumps({"model": a.model, "threads": a.threads, "rows": rows}, indent=1) + "\n")
    if a.smoke and not all(r["same_answer"] for r in rows):  # CI: a changed answer at this size is a bug
        print("FAILED: the two ways answered differently", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
