"""A question's working set in bfloat16 against float32, side by side in one process: decode
milliseconds per token, greedy answers identical or not, and teacher-forced top-1 agreement
with the float32 working set's answers (the bar for a default: ≥ 0.98, docs/performance.md).

    python benchmarks/working_set_dtype.py          # smollm2-135m (bf16 weights), the GPL, 40 questions, 24 tokens
    python benchmarks/working_set_dtype.py --smoke  # tiny: tests/data/harbor.txt, 2 questions, 8 tokens

One model, one cache (the first --chars characters of --text, ingested with the preset's
defaults, kept in --workdir; it must be one segment). Question by question the same `RocketKV`
answers with the working set in float32 and in bfloat16 (`Engine.working_set_dtype`), their
order alternating, so a machine whose load changes slows both alike; then the bfloat16 working
set scores the float32 answer's tokens teacher-forced (`Decoder.score`, equal to step-by-step
decode: tests/test_working_set_dtype.py) and counts the positions whose top token is the
answer's, from the second (the first comes from the question's prefill, before any working
set). Decode ms per token is each answer's `decode_s` over its tokens; the summary is the median
over questions. bfloat16 is measured whatever the CPU (`native bf16` says whether this
one multiplies it natively, where rocketkv uses it by default). Results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from captured_step import QUESTIONS  # benchmarks/ is on sys.path when run

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", type=Path, default=REPO.parent / "shared" / "data" / "gpl-3.txt")
    p.add_argument("--chars", type=int, default=30_000)
    p.add_argument("--questions", type=int, default=len(QUESTIONS))
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=int(os.environ.get("ROCKETKV_THREADS", "2")))
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rocketkv-working-set-dtype"))
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: none)")
    p.add_argument("--smoke", action="store_true", help="a tiny run that CI makes")
    a = p.parse_args()
    budget = None  # the preset's token budget
    if a.smoke:  # a budget under the short document's length, so that each question narrows it
        a.text, a.chars, a.questions, a.max_new_tokens = REPO / "tests" / "data" / "harbor.txt", 3000, 2, 8
        budget = 128

    import torch

    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.engine.answer import decode_config_for
    from rocketkv_cli.engine.decoder import Decoder
    from rocketkv_cli.eval.reports import table, write_json
    from rocketkv_cli.model.linears import cpu_has_native_bf16

    rk = RocketKV.load(a.model, threads=a.threads)
    a.workdir.mkdir(parents=True, exist_ok=True)
    path = a.workdir / f"{a.model}-{a.text.stem}-{a.chars}{f'-t{budget}' if budget else ''}.kv"
    if not path.exists():
        rk.ingest(text=a.text.read_text(encoding="utf-8")[: a.chars], output=path, token_budget=budget)
    cache = rk.open(path)
    if not hasattr(cache, "layers") or cache.info.config.store_budget is None:
        sys.exit(f"{path}: the benchmark needs one segment whose questions re-select a working set")
    engine, dtypes = rk.engine, {"float32": None, "bfloat16": torch.bfloat16}
    scorer = Decoder(engine, cache, 4096, decode_config_for(cache, exact_working_set=1))

    def answer(name: str, question: str):
        engine.working_set_dtype = dtypes[name]
        return next(iter(rk.ask(cache, question, max_new_tokens=a.max_new_tokens)))

    answer("bfloat16", QUESTIONS[0])  # warm-up: buffers, the prepared question prefix
    rows = []
    for i, q in enumerate(QUESTIONS[: a.questions]):
        order = ("float32", "bfloat16") if i % 2 == 0 else ("bfloat16", "float32")
        got = {name: answer(name, q) for name in order}
        f, b = got["float32"], got["bfloat16"]
        engine.working_set_dtype = torch.bfloat16
        scorer.reset()
        ref = list(f.token_ids)
        top1 = scorer.score(engine.question_ids(q), ref).argmax(dim=-1).tolist()[1:] if ref else []
        bf16_layers = sum(layer.keys.dtype == torch.bfloat16 for layer in scorer.cache.layers) if ref else None
        scorer.reset()
        rows.append({"question": q, "same": f.token_ids == b.token_ids, "float32": f.text, "bfloat16": b.text,
                     "tokens": len(ref[1:]), "top1": sum(x == y for x, y in zip(top1, ref[1:], strict=True)),
                     "bfloat16_layers": bf16_layers,
                     "float32_ms": 1e3 * f.decode_s / max(f.n_answer_tokens, 1),
                     "bfloat16_ms": 1e3 * b.decode_s / max(b.n_answer_tokens, 1)})  # fmt: skip
        r = rows[-1]
        print(f"{i + 1}/{a.questions} same={r['same']} top1 {r['top1']}/{r['tokens']} float32 "
              f"{r['float32_ms']:.1f} ms/token, bfloat16 {r['bfloat16_ms']:.1f}",
              file=sys.stderr, flush=True)  # fmt: skip
    f_ms = statistics.median(r["float32_ms"] for r in rows)
    b_ms = statistics.median(r["bfloat16_ms"] for r in rows)
    same = sum(r["same"] for r in rows)
    hits, tokens = sum(r["top1"] for r in rows), sum(r["tokens"] for r in rows)
    summary = {"model": a.model, "text": a.text.name, "chars": a.chars, "threads": a.threads,
               "max_new_tokens": a.max_new_tokens, "questions": len(rows), "native_bf16": cpu_has_native_bf16(),
               "identical_answers": same, "top1": hits, "tokens": tokens, "top1_share": hits / max(tokens, 1),
               "float32_ms_per_token": f_ms, "bfloat16_ms_per_token": b_ms, "speedup": f_ms / b_ms}  # fmt: skip
    for line in table(["", "float32 working set", "bfloat16 working set", "×"],
                      [["decode ms/token (median)", f"{f_ms:.1f}", f"{b_ms:.1f}", f"{f_ms / b_ms:.2f}"],
                       ["greedy answers identical", "", f"{same} of {len(rows)}", ""],
                       ["teacher-forced top-1", "", f"{hits} of {tokens} ({hits / max(tokens, 1):.4f})", ""]],
                      "lrrr"):  # fmt: skip
        print(line)
    print(f"native bf16 on this CPU: {'yes' if summary['native_bf16'] else 'no'}")
    for r in rows:
        if not r["same"]:
            print(f"differs: {r['question']!r}\n  float32:  {r['float32']!r}\n  bfloat16: {r['bfloat16']!r}")
    if a.out is not None:
        write_json(a.out, {"summary": summary, "rows": rows}, indent=1, end="\n")
    if a.smoke and not any(r["bfloat16_layers"] for r in rows):
        print("the bfloat16 working set was never selected: nothing was measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
