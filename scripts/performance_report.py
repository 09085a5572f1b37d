#!/usr/bin/env python
"""Regenerate docs/performance.md: `rocketkv bench` on both presets, compute formats side by side.

Usage: python scripts/performance_report.py [--quick] [--from-json] [--llama-cpp PYTHON]
For each preset at its target length (SmolLM2 ~7.8K tokens, Gemma 8K and 32K) and each compute
format (float32; the whole model in bfloat16; weight-only bf16, int8 and int4 linears in a
float32 model: `--weights`), one `rocketkv bench` run measures, side by side in that process: decode ms/token with
HSA, with exact attention over the same pruned cache and with plain transformers' full cache; a
fresh `rocketkv ask` process's wall time; the per-layer HSA/exact crossover; and, with
`--llama-cpp PYTHON` (an interpreter with llama-cpp-python), llama.cpp's state-file path on the
same document and GGUF. Results are kept per run under docs/bench/perf-*.json (a rerun skips
finished runs: it resumes). Run it on an otherwise idle machine: the ratios come from one
process, but a busy machine still adds noise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rocketkv_cli.eval.reports import kept_run, read_text, replace_section, report_timer, table, write_text

ROOT = Path(__file__).resolve().parents[1]
ROCKETKV = str(Path(sys.executable).parent / "rocketkv")
RUNS = {"smollm2-135m": "7800", "gemma-3-270m": "8192,32000"}
FORMATS = {"float32": ["--dtype", "float32", "--weights", "float"], "bfloat16": ["--dtype", "bfloat16"],
           "bf16w": ["--dtype", "float32", "--weights", "bf16"], "int8w": ["--dtype", "float32", "--weights", "int8"],
           "int4w": ["--dtype", "float32", "--weights", "int4"]}  # fmt: skip
TARGET_MS = {"smollm2-135m": (7800, 15.0), "gemma-3-270m": (32000, 25.0)}


def run(model: str, fmt: str, lengths: str, out: Path, llama_cpp: str | None, quick: bool) -> dict:
    """One `rocketkv bench` run of a preset and compute format (a kept JSON is reused: it resumes)."""
    cmd = [ROCKETKV, "bench", "--model", model, "--context-tokens", lengths, *FORMATS[fmt], "--json", str(out)]
    if quick:
        cmd += ["--steps", "4", "--no-memory", "--crossover", "1024,4096"]
    if llama_cpp and fmt == "float32":
        cmd += ["--llama-cpp", llama_cpp]
    return kept_run(out, cmd, cwd=ROOT)


def ms(row: dict, key: str) -> str:
    return f"{row[key] * 1e3:.1f}" if row.get(key) is not None else "-"


COLUMNS = ["format", "context", "decode ms HSA", "exact (pruned)", "full cache", "HSA × exact", "fresh ask s",
           "TTFT file s", "file / full KV", "llama.cpp ms", "llama.cpp TTFT s", "llama.cpp fresh s", "llama.cpp state MB"]  # fmt: skip


def decode_table(reports: dict[str, dict]) -> list[str]:
    """One row per compute format and length: decode ms, fresh ask and TTFT, file size, llama.cpp's."""
    rows = []
    for fmt, rep in reports.items():
        for r in rep["rows"]:
            fresh = f"{r['fresh_ask_wall_s']:.2f}" if "fresh_ask_wall_s" in r else "-"
            ttft = f"{r['llama_cpp_ttft_s']:.2f}" if "llama_cpp_ttft_s" in r else "-"
            state = f"{r['llama_cpp_state_file_bytes'] / 1e6:.0f}" if "llama_cpp_state_file_bytes" in r else "-"
            lfresh = f"{r['llama_cpp_fresh_wall_s']:.2f}" if "llama_cpp_fresh_wall_s" in r else "-"
            cells = [fmt, str(r["context_tokens"]), ms(r, "decode_step_hsa_s"), ms(r, "decode_step_exact_pruned_s"),
                     ms(r, "decode_step_full_s"), f"{r['hsa_vs_exact_pruned']:.2f}", fresh,
                     f"{r['ttft_from_file_s']:.2f}", f"{r['file_vs_full_kv']:.3f}", ms(r, "llama_cpp_decode_step_s"),
                     ttft, lfresh, state]  # fmt: skip
            rows.append(cells)
    return table(COLUMNS, rows, "-" + "r" * (len(COLUMNS) - 1))


def crossover(reports: dict[str, dict]) -> list[str]:
    rows = [[fmt, c["kept_tokens"], f"{c['hsa_s'] * 1e3:.3f}", f"{c['exact_s'] * 1e3:.3f}", f"{c['hsa_speedup']:.2f}"]
            for fmt, rep in reports.items() for c in rep.get("attention_crossover", [])]  # fmt: skip
    return table(["format", "stored tokens", "HSA ms", "exact ms", "HSA speed-up"], rows, "-rrrr")


def targets(all_reports: dict[str, dict[str, dict]]) -> list[str]:
    out = []
    for model, (n, limit) in TARGET_MS.items():
        best = []
        for fmt, rep in all_reports.get(model, {}).items():
            for r in rep["rows"]:
                if r["context_tokens"] == n:
                    step = min(r["decode_step_hsa_s"], r["decode_step_exact_pruned_s"])
                    best.append((step * 1e3, fmt))
        if best:
            got, fmt = min(best)
            verdict = "met" if got <= limit else f"MISSED by {got / limit:.1f}×"
            out.append(f"- {model} at {n} tokens: ≤ {limit:.0f} ms per decode token — {verdict}: best {got:.1f} ms "
                       f"({fmt}; the faster of HSA and exact attention over the pruned cache).")  # fmt: skip
        for fmt, rep in all_reports.get(model, {}).items():
            for r in rep["rows"]:
                if "llama_cpp_decode_step_s" in r:
                    ours = min(r["decode_step_hsa_s"], r["decode_step_exact_pruned_s"])
                    out.append(f"- {model} at {r['context_tokens']} tokens vs llama.cpp ({fmt}): decode "
                               f"{ours * 1e3:.1f} vs {r['llama_cpp_decode_step_s'] * 1e3:.1f} ms/token; a fresh ask "
                               f"{r.get('fresh_ask_wall_s', float('nan')):.2f} s vs a fresh llama.cpp process "
                               f"{r.get('llama_cpp_fresh_wall_s', float('nan')):.2f} s (its state load + first "
                               f"token in a loaded process {r['llama_cpp_ttft_s']:.2f} s; its state file "
                               f"{r['llama_cpp_state_file_bytes'] / 1e6:.0f} MB, ours "
                               f"{r['file_bytes'] / 1e6:.1f} MB).")  # fmt: skip
    return out


START, END = "<!-- performance-report:start -->", "<!-- performance-report:end -->"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short, few steps (a smoke run, not for the docs)")
    parser.add_argument("--from-json", action="store_true", help="rewrite the page from docs/bench/perf-*.json")
    parser.add_argument("--llama-cpp", help="a Python interpreter with llama-cpp-python installed")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--presets", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out", type=Path, help="the page to write, its JSON in bench/ beside it (default: docs/)")
    parser.add_argument("--model", help="with --quick: this model (e.g. a tiny directory: the CI smoke) only")
    args = parser.parse_args()
    bench_dir = args.out.parent / "bench" if args.out else ROOT / ("build/perf-quick" if args.quick else "docs/bench")
    all_reports: dict[str, dict[str, dict]] = {}
    for model, lengths in ({args.model: "1024"} if args.model and args.quick else RUNS).items():
        if model not in args.presets and not args.from_json and not args.model:
            continue
        for fmt in args.formats:
            out = bench_dir / f"perf-{Path(model).name}-{fmt}.json"
            if args.from_json and not out.exists():
                continue
            all_reports.setdefault(model, {})[fmt] = run(model, fmt, "1024" if args.quick else lengths, out,
                                                         args.llama_cpp, args.quick)  # fmt: skip
    if not all_reports:
        raise SystemExit(f"no {bench_dir}/perf-*.json yet (run without --from-json to make them)")
    machine = next(iter(next(iter(all_reports.values())).values()))["machine"]
    lines = [
        "## Current measurements", "",
        "Generated by `python scripts/performance_report.py` (budget 512, the default storage), which runs",
        "`rocketkv bench` per preset and compute format; raw results in `docs/bench/perf-*.json`.",
        f"Machine: {machine['cpu']}, {machine['threads']} torch threads, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, rocketkv {machine['rocketkv']}.", "",
        "Measured side by side in one `rocketkv bench` process per row: *decode ms HSA* = median step with",
        "stage 2 at every full-attention layer; *exact (pruned)* = exact attention over the same pruned",
        "cache (what `ask` runs below the crossover); *full cache* = plain transformers with its",
        "`DynamicCache` over the whole document; *fresh ask* = wall time of a new `rocketkv ask` process",
        "answering 32 tokens from the file (interpreter start, imports, model and cache load included);",
        "*llama.cpp* = llama-cpp-python on the same GGUF and framed document: its state file saved once,",
        "loaded in a fresh context, the question evaluated (TTFT includes the state load) and 24 tokens",
        "decoded, with the same thread count; *llama.cpp fresh* = wall time of a new Python process doing",
        "what a fresh ask does with llama.cpp (import, model load, state file, question, 32 tokens).", "",
    ]  # fmt: skip
    for model, reports in all_reports.items():
        lines += [f"### {model}", "", *decode_table(reports), "", "One full-attention layer's attention, HSA vs exact:", "",
                  *crossover(reports), ""]  # fmt: skip
    lines += ["### Targets", "", *targets(all_reports), ""]
    page = args.out or (bench_dir if args.quick else ROOT / "docs") / "performance.md"
    old = read_text(page) or "# Performance\n"
    write_text(page, replace_section(old, START, END, "\n".join(lines)))
    print(f"wrote {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        sys.exit(main())
