"""How closely each decode compute format answers like float32 weights (docs/performance.md, "Weight formats").

A quantized weight format may become a default only where its answers agree with the unquantized
model's (teacher-forced top-1 ≥ 0.98). For each preset and document (the storage report's: KJV
with a planted fact, five questions, default budget and storage), every format ingests the
document itself (a cache records the weights that built it) and is scored teacher-forced
against the float32 model's greedy answers from its own cache: top-1 agreement per answer token
(Wilson 95% interval over the pooled tokens), mean KL(float32 ‖ format), greedy prefix agreement,
planted facts found. Formats: `float32`; `bfloat16` (the whole model: `--dtype bfloat16`);
`bf16+int8w` (weight-only int8 linears in a bfloat16 model: `--dtype bfloat16 --weights int8`);
and the weight-only formats in a float32 model, whose linears round only their inputs to
bfloat16: `bf16w` (`--weights bf16`), `int8w` (`--weights int8`), `int4w` (`--weights int4`),
`headbf16w` (`--weights head-bf16`: float linears, the LM head's ranking in bfloat16).
A format named with ` (decode)` (e.g. `bf16w (decode)`) answers from the float32 model's own
cache instead (ingest with float weights, `ask --weights …`): only decode's precision differs,
not which tokens stage 1 kept. Resumable per (preset, format, document); the float32 reference
is recomputed on each run.

    python scripts/weights_agreement.py [--presets smollm2-135m gemma-3-270m] [--formats int4w] [--samples 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from storage_report import DATA, OPEN_QUESTIONS  # noqa: E402

FORMATS = {"float32": ("float32", "float"), "bfloat16": ("bfloat16", "float"), "bf16+int8w": ("bfloat16", "int8"),
           "bf16w": ("float32", "bf16"), "int8w": ("float32", "int8"), "int4w": ("float32", "int4"),
           "headbf16w": ("float32", "head-bf16")}  # fmt: skip
DECODE_ONLY = " (decode)"  # suffix: the format answers from the float32 model's cache
FORMATS.update({f"{name}{DECODE_ONLY}": spec for name, spec in list(FORMATS.items()) if name != "float32"})
LENGTHS = {"smollm2-135m": 7800, "gemma-3-270m": 8192}
BAR = 0.98


def run(args) -> dict:
    import torch

    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.core.config import PrefillConfig, default_kv_dtype, with_preset_defaults
    from rocketkv_cli.core.quant import KVStorage
    from rocketkv_cli.engine.answer import answer, decode_config_for, prepare_questions
    from rocketkv_cli.engine.documents import Document, read_document
    from rocketkv_cli.eval.runner import match_fraction, token_agreement
    from rocketkv_cli.eval.storage import teacher_forced_log_probs
    from rocketkv_cli.eval.tasks import generate

    torch.set_num_threads(args.threads)
    report = json.loads(args.json.read_text()) if args.json.exists() else {}
    results = report.setdefault("results", {})
    haystack = read_document(str(DATA / "kjv.txt")).text
    for preset in args.presets:
        n = LENGTHS[preset]
        cfg = with_preset_defaults(PrefillConfig(), preset, set())
        storage = KVStorage.parse(default_kv_dtype(preset))
        refs: dict[int, dict] = {}
        formats = ["float32", *(f for f in args.formats if f != "float32")]  # float32 first: the reference
        if all(f"{preset}/{fmt}/{i}" in results for fmt in formats for i in range(args.samples)):
            continue
        for fmt in formats:
            dtype, weights = FORMATS[fmt]
            decode_only = fmt.endswith(DECODE_ONLY)
            keys = [f"{preset}/{fmt}/{i}" for i in range(args.samples)]
            if all(k in results for k in keys) and fmt != "float32":
                continue
            rk = RocketKV.load(preset, device="cpu", dtype=dtype, weights=weights)
            engine = rk.engine
            count = lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
            for index, key in enumerate(keys):
                if key in results and fmt != "float32":
                    continue
                t0 = time.perf_counter()
                sample = generate("niah_text", index, 7, n - 200, count, haystack)
                probes = [(q.text, q.expected) for q in sample.questions] + [(q, ()) for q in OPEN_QUESTIONS]
                doc = Document(sample.document, f"{index:064x}", f"kjv-{n}-{index}")
                cache = refs[index]["cache"] if decode_only else engine.ingest(doc, cfg, storage=storage)
                texts = [q for q, _ in probes]
                answers = list(answer(engine, cache, texts, 32, decode_config_for(cache)))
                prepared = prepare_questions(engine, cache, texts, 32)
                if fmt == "float32":
                    lps = [teacher_forced_log_probs(engine, cache, ids, a.token_ids)
                           for (_, ids), a in zip(prepared, answers)]  # fmt: skip
                    refs[index] = {"answers": answers, "log_probs": lps, "cache": cache}
                    if key in results:
                        continue
                ref = refs[index]
                same = steps = 0
                kl = 0.0
                for (_, ids), r, r_lp in zip(prepared, ref["answers"], ref["log_probs"]):
                    lp = teacher_forced_log_probs(engine, cache, ids, r.token_ids)
                    if len(lp):
                        same += int((lp.argmax(-1) == torch.tensor(r.token_ids)).sum())
                        kl += float((r_lp.exp() * (r_lp - lp.float())).sum())
                    steps += len(r.token_ids)
                facts = [match_fraction(a.text, exp) for a, (_, exp) in zip(answers, probes) if exp]
                greedy = [token_agreement(r.token_ids, a.token_ids) for r, a in zip(ref["answers"], answers)]
                results[key] = {"same": same, "steps": steps, "kl": kl, "greedy": sum(greedy) / len(greedy),
                                "facts": sum(facts) / len(facts), "seconds": time.perf_counter() - t0,
                                "answers": [a.text for a in answers]}  # fmt: skip
                args.json.write_text(json.dumps(report, indent=1))
                print(f"{key}: top-1 {same}/{steps}, KL {kl / max(1, steps):.4f} "
                      f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)  # fmt: skip
    return report


def table(report: dict) -> list[str]:
    """Markdown rows: per preset and format, pooled top-1 with its interval, KL, greedy, facts."""
    from rocketkv_cli.eval.stats import wilson

    out = ["| preset | format | top-1 vs float32 (95% CI) | KL | greedy | facts | meets the bar |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    groups: dict[tuple[str, str], list[dict]] = {}
    for key, row in report.get("results", {}).items():
        preset, fmt, _ = key.split("/")
        groups.setdefault((preset, fmt), []).append(row)
    for (preset, fmt), rows in groups.items():
        same, steps = sum(r["same"] for r in rows), sum(r["steps"] for r in rows)
        lo, hi = wilson(same, steps)
        kl = sum(r["kl"] for r in rows) / max(1, steps)
        greedy = sum(r["greedy"] for r in rows) / len(rows)
        facts = sum(r["facts"] for r in rows) / len(rows)
        ok = "yes" if same / steps >= BAR else "no"
        out.append(f"| {preset} | {fmt} | {same / steps:.3f} ({lo:.3f}–{hi:.3f}, {steps} tokens, {len(rows)} "
                   f"documents) | {kl:.4f} | {greedy:.3f} | {facts:.2f} | {ok} |")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "weights-agreement.json")
    ap.add_argument("--from-json", action="store_true", help="only print the table")
    args = ap.parse_args()
    report = json.loads(args.json.read_text()) if args.from_json else run(args)
    print("\n".join(table(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
