"""Measure the `.kv` storage types side by side and write docs/storage.md (+ docs/bench/storage.json).

For each preset and document length: documents cut from the KJV with a planted fact each
(`rocketkv eval`'s niah_text task, so that answer can be scored) plus four open questions; one
prefill per document, compressed at the default budget and stored as every storage type; file
size vs the bfloat16 full KV cache; fidelity vs the float32 cache of the same budget (teacher-forced
top-1 agreement, greedy agreement) and the planted-fact score. Resumable: finished (preset,
length, sample) results are kept in the JSON and skipped on a rerun; a storage type added to DTYPES
since is measured alone for those samples (with the float32 reference again, which must come out
the same), and the load timing is redone side by side when it lacks one of LOAD_DTYPES.

    python scripts/storage_report.py                       # both presets (~40 min on 2 cores)
    python scripts/storage_report.py --presets smollm2-135m --samples 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from rocketkv_cli.eval.reports import (
    interval,
    kept,
    read_json,
    read_text,
    report_timer,
    table,
    wilson,
    write_json,
    write_text,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ROCKETKV_SHARED_DATA", ROOT.parent / "shared" / "data"))
DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "int8",
    "int4",
    "int4+rope",
    "int4+alloc",
    "int4+sinks0",
]  # +sinks0: sinks quantized
PLAN = {"smollm2-135m": [7800], "gemma-3-270m": [8192, 32000]}
LOAD_DTYPES = ["float32", "int8", "int4", "int4+alloc"]  # float32: what rocketkv stored before integer storage
OPEN_QUESTIONS = [
    "Who is mentioned first in this text, and what happens to them?",
    "Summarize the text in one sentence.",
    "What is said about God in this text?",
    "Which places are named in this text?",
]


def run(args) -> dict:
    import torch

    from rocketkv_cli.api.documents import read_document
    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.core.config import PrefillConfig, with_preset_defaults
    from rocketkv_cli.engine.inputs import Document
    from rocketkv_cli.eval.storage import Probe, load_first_token_seconds, storage_rows
    from rocketkv_cli.eval.tasks import generate

    torch.set_num_threads(args.threads)
    report = read_json(args.json, {"results": {}})
    haystack = read_document(str(DATA / "kjv.txt")).text
    for preset in args.presets:
        rk = RocketKV.load(preset, device="cpu", weights="float", threads=args.threads)  # storage alone varies
        engine = rk.engine
        report.setdefault("models", {})[preset] = {"head_dim": engine.shape.head_dim, "n_kv_heads": engine.shape.n_kv_heads,
                                                   "layer_windows": [s.sliding_window for s in engine.shape.layers]}  # fmt: skip
        count = lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        for n in PLAN[preset] if args.lengths is None else args.lengths:
            for index in range(args.samples):
                key = f"{preset}/{n}/{index}"
                before = report["results"].get(key)
                missing = [d for d in DTYPES if before and d not in {r["kv_dtype"] for r in before["rows"]}]
                if before and not missing:
                    print(f"{key}: done before, skipped", file=sys.stderr)
                    continue
                t0 = time.perf_counter()
                sample = generate("niah_text", index, 7, n - 200, count, haystack)
                probes = [Probe(q.text, q.expected) for q in sample.questions] + [Probe(q) for q in OPEN_QUESTIONS]
                doc = Document(sample.document, f"{index:064x}", f"kjv-{n}-{index}")
                with tempfile.TemporaryDirectory() as tmp:
                    rows = storage_rows(engine, doc, with_preset_defaults(PrefillConfig(), preset, set()),
                                        missing or DTYPES, probes, Path(tmp),
                                        log=lambda m: print(f"{key}: {m}", file=sys.stderr))  # fmt: skip
                if before:  # the reference the earlier rows were scored against must be the same
                    if rows[0]["token_ids"] != before["rows"][0]["token_ids"]:
                        raise SystemExit(f"{key}: the float32 reference changed since the JSON was written; "
                                         "remove the sample from it and rerun")  # fmt: skip
                    order = {d: i for i, d in enumerate(DTYPES)}
                    rows = sorted(before["rows"] + rows[1:], key=lambda r: order.get(r["kv_dtype"], len(DTYPES)))
                report["results"][key] = {"rows": rows, "seconds": time.perf_counter() - t0 + (before or {}).get(
                                          "seconds", 0), "questions": [p.text for p in probes]}  # fmt: skip
                write_json(args.json, report)
                print(f"{key}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            key = f"{preset}/{n}"
            if args.load_rounds and set(LOAD_DTYPES) - set(report.setdefault("load", {}).get(key, {})):
                sample = generate("niah_text", 0, 7, n - 200, count, haystack)
                doc = Document(sample.document, f"{0:064x}", f"kjv-{n}-0")
                with tempfile.TemporaryDirectory() as tmp:
                    report["load"][key] = load_first_token_seconds(
                        engine, doc, with_preset_defaults(PrefillConfig(), preset, set()), LOAD_DTYPES,
                        sample.questions[0].text, Path(tmp), args.load_rounds)  # fmt: skip
                write_json(args.json, report)
                print(f"{key}: load + first token measured", file=sys.stderr)
    return report


def _steps(result: dict) -> int:
    """Teacher-forced steps of a document: the float32 cache's answer tokens, all questions."""
    return sum(len(ids) for ids in result["rows"][0]["token_ids"])


def pooled(results: list[dict], i: int) -> dict:
    """Row i of a (preset, length) group over its documents: means, and top-1 agreement pooled
    over every teacher-forced step with its Wilson 95% interval."""
    rows = [r["rows"][i] for r in results]
    steps = [_steps(r) for r in results]
    same = round(sum(row["top1_agreement"] * n for row, n in zip(rows, steps)))
    facts = [row["score"] for row in rows if row["score"] is not None]
    mean = lambda k: sum(row.get(k, float("nan")) for row in rows) / len(rows)  # noqa: E731
    return {"kv_dtype": rows[0]["kv_dtype"], "bytes_per_token": mean("bytes_per_token"),
            "file_vs_bf16_full_kv": mean("file_vs_bf16_full_kv"), "top1": same / max(1, sum(steps)),
            "top1_ci": wilson(same, sum(steps)), "steps": sum(steps), "mean_kl": mean("mean_kl"),
            "greedy": mean("greedy_agreement"), "facts": sum(facts) / len(facts) if facts else float("nan")}  # fmt: skip


def page(report: dict, old: str = "") -> str:
    """The page from the JSON; its prose (what each column means, the notes, the ablation) is kept
    from the previous page `old`, as written."""
    lines = ["# Storage types of the `.kv` file", "", *kept(old, "Generated by `python scripts/storage_report.py`")]
    by_group: dict[str, list] = {}
    for key, res in sorted(report["results"].items()):
        preset, n, _ = key.split("/")
        by_group.setdefault(f"{preset}/{n}", []).append(res)
    for group, results in by_group.items():
        preset, n = group.split("/")
        rows = [[r["kv_dtype"], f"{r['bytes_per_token']:,.0f}", f"1/{1 / r['file_vs_bf16_full_kv']:.1f}",
                 interval(r["top1"], r["top1_ci"], 3, 1, paren=True, note=f"{r['steps']} tokens"),
                 f"{r['mean_kl']:.4f}", f"{r['greedy']:.3f}", f"{r['facts']:.2f}"]
                for r in (pooled(results, i) for i in range(len(results[0]["rows"])))]  # fmt: skip
        lines += [f"## {preset}, {n} tokens ({len(results)} document{'s' * (len(results) > 1)})", "",
                  *table(COLUMNS, rows, "-rrrrrr"), ""]  # fmt: skip
    if report.get("load"):
        lines += ["## Load and first token", "",
                  *kept(old, "Seconds from opening the file", ("",)), ""]  # fmt: skip
        rows = []
        for group, times in report["load"].items():
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            base = med.get("float32") or next(iter(med.values()))
            rows.append([group.replace("/", ", "), *(f"{t:.2f} s ({t / base:.2f}×)" for t in med.values())])
        names = list(next(iter(report["load"].values())))
        lines += [*table(["preset, tokens", *names], rows, "-" + "r" * len(names)), ""]
    lines += accuracy_section(old)
    lines += kept(old, "## Ablation", ("## ",))  # written by scripts/storage_ablation.py at commit db7884c (retired)
    notes = kept(old, "## What the rows show", ("- **Allocated key bits**", "- **What would close"))
    lines += ["## Default and targets", "", *verdicts(by_group, report.get("load")), "", *notes, *alloc_bullet(by_group),
              *kept(old, "- **What would close the Gemma gap**", ("- ", "## ", "")), ""]  # fmt: skip
    return "\n".join(lines) + "\n"


def accuracy_section(old: str) -> list[str]:
    """The eval scores of the same tasks with each storage (docs/bench/storage-eval-*.json, one
    `rocketkv eval --kv-dtype D` run per storage, same seed): mean score with its bootstrap interval."""
    runs = sorted((ROOT / "docs" / "bench").glob("storage-eval-*.json"))
    if not runs:
        return []
    out = ["## Accuracy with each storage", "", *kept(old, "`rocketkv eval --model smollm2-135m", ("",)), ""]
    rows = []
    for path in runs:
        report = read_json(path)
        for row in (r for r in report["summary"] if r["task"] == "mean"):
            rows.append([report["config"]["kv_dtype"], row["label"] + (f" t={row['budget']}" if row["budget"] else ""),
                         interval(row["score"], row["score_ci"], 2, 1, paren=True),
                         "—" if row["top1_agreement"] is None else f"{row['top1_agreement']:.3f}",
                         "—" if row["kl"] is None else f"{row['kl']:.4f}", row["n"]])  # fmt: skip
    out += table(["storage", "method", "score (95% CI)", "top-1 vs full", "KL vs full", "samples"], rows, "--rrrr")
    return [*out, ""]


def alloc_bullet(by_group: dict[str, list]) -> list[str]:
    """int4+alloc against int4 per group: pooled top-1, KL and bytes per token, from the rows."""
    parts = []
    for group, results in by_group.items():
        names = [row["kv_dtype"] for row in results[0]["rows"]]
        if "int4" not in names or "int4+alloc" not in names:
            continue
        a, b = pooled(results, names.index("int4")), pooled(results, names.index("int4+alloc"))
        parts.append(f"{group.replace('/', ' at ')} tokens: KL {a['mean_kl']:.4f} → {b['mean_kl']:.4f}, top-1 "
                     f"{a['top1']:.3f} → {b['top1']:.3f}, {a['bytes_per_token']:,.0f} → {b['bytes_per_token']:,.0f} "
                     "bytes per token")  # fmt: skip
    if not parts:
        return []
    return [
        "- **Allocated key bits** (`+alloc`): int4's bytes, each key channel 2–8 bits by the document's own "
        "query energy (core/quant.py, `allocate_key_bits`), against int4 — " + "; ".join(parts) + ". Per "
        "document the KL can still rise (docs/bench/storage.json has each); top-1 moves by whole near-ties."
    ]


COLUMNS = ["storage", "bytes / token", "file / bf16 full KV", "top-1 vs float32 (95% CI)", "KL", "greedy", "facts"]
AGREEMENT_BAR = 0.98  # teacher-forced top-1 agreement a storage needs against float32 to be a default
SAME_SIZE = 0.01  # storages within this fraction of the smallest one's bytes per token are the same size
LOAD_SLACK = 0.10  # … and may replace it only if their load + first token is at most this much slower
TARGETS = {"gemma-3-270m/32000": 20, "smollm2-135m/7800": 10}  # file ≤ 1/k of the bf16 full KV


def load_ratio(load: dict, groups: list[str], name: str, base: str) -> float:
    """The largest ratio over `groups` of `name`'s median load + first token to `base`'s (1.0 for
    the same storage; inf where `name` was not timed beside `base`)."""
    if name == base:
        return 1.0
    ratios = []
    for g in groups:
        times = load.get(g, {})
        if name not in times or base not in times:
            return float("inf")
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items() if k in (name, base)}
        ratios.append(med[name] / med[base])
    return max(ratios) if ratios else float("inf")


def verdicts(by_group: dict[str, list], load: dict | None = None) -> list[str]:
    """Each preset's default the numbers support — the smallest storage whose pooled top-1
    agreement is at or above the bar at every length measured for that preset — checked against
    `core.config.default_kv_dtype`, and each size target, met or missed by how much."""
    from rocketkv_cli.core.config import default_kv_dtype

    load = load or {}
    names = [row["kv_dtype"] for row in next(iter(by_group.values()))[0]["rows"]]
    presets = sorted({g.split("/")[0] for g in by_group})
    out = []
    for preset in presets:
        groups = [g for g in by_group if g.startswith(preset + "/")]
        ok = [i for i in range(len(names)) if all(pooled(by_group[g], i)["top1"] >= AGREEMENT_BAR for g in groups)]
        size = {i: max(pooled(by_group[g], i)["bytes_per_token"] for g in groups) for i in ok}
        kl = {i: max(pooled(by_group[g], i)["mean_kl"] for g in groups) for i in ok}
        smallest = min(ok, key=lambda i: (size[i], kl[i]))
        # within SAME_SIZE of the smallest counts as the same size: the lower KL decides among those, if
        # it opens and answers its first token within LOAD_SLACK of the smallest one's time
        best = min((i for i in ok if size[i] <= size[smallest] * (1 + SAME_SIZE)
                    and load_ratio(load, groups, names[i], names[smallest]) <= 1 + LOAD_SLACK),
                   key=lambda i: (kl[i], size[i]))  # fmt: skip
        lengths = " and ".join(g.split("/")[1] for g in groups)
        code = default_kv_dtype(preset)
        agrees = "as `core/config.py` has it" if code == names[best] else f"BUT `core/config.py` says {code}"
        out.append(f"- **{preset}: default `--kv-dtype {names[best]}`** ({agrees}): of the storages whose pooled "
                   f"teacher-forced top-1 agreement with float32 is ≥ {AGREEMENT_BAR} at {lengths} tokens, the lowest "
                   f"KL among those within {SAME_SIZE:.0%} of the smallest one's bytes per token that open and "
                   f"answer the first token within {LOAD_SLACK:.0%} of its time (the load table).")  # fmt: skip
    for group, k in TARGETS.items():
        if group not in by_group:
            continue
        default = default_kv_dtype(group.split("/")[0])
        for i, name in enumerate(names):
            if name not in (default, "int4", "int4+rope", "int4+alloc", "int8"):
                continue
            row = pooled(by_group[group], i)
            frac, top1 = row["file_vs_bf16_full_kv"], row["top1"]
            size = f"meets (1/{1 / frac:.1f})" if frac <= 1 / k else f"misses ({1 / frac:.1f}× smaller, not {k}×)"
            bar = "meets" if top1 >= AGREEMENT_BAR else "misses"
            tag = " (the default)" if name == default else ""
            out.append(f"- {group} tokens, target file ≤ 1/{k} of the bf16 full KV at top-1 ≥ {AGREEMENT_BAR}: "
                       f"{name}{tag} {size} the size and {bar} the agreement (top-1 {top1:.3f}, KL {row['mean_kl']:.4f}).")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(PLAN))
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-rounds", type=int, default=5, help="rounds of the load + first token timing (0: skip)")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "storage.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "storage.md")
    ap.add_argument("--from-json", action="store_true", help="only rewrite the page from the JSON")
    args = ap.parse_args()
    report = read_json(args.json) if args.from_json else run(args)
    write_text(args.out, page(report, read_text(args.out)))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        sys.exit(main())
