#!/usr/bin/env python
"""Whole decode steps from one `.kv` file in each weight format, side by side in one process.

`benchmarks/linear_formats.py` times the linears alone; this times what `ask` runs: for each
weight format (`float`: the checkpoint's float32; `head-bf16`: float linears, the LM head ranked
in bfloat16; `bf16`, `int8`, `int4`: weight-only linears in
a float32 model, each product's input rounded to bfloat16: `model/weights.py`), the model is loaded once and the same
cache answers the same question, round-robin over the formats (so a busy machine shifts every
format alike): the question's prefill, then `--steps` greedy decode steps timed after 4 warm-up
steps, with exact attention over the pruned cache (what `ask` runs on CPU at the default budget,
docs/performance.md "Where stage 2 pays") and with HSA. Prints, per format, the median ms per
decode step over the rounds and its speed relative to the first format given (float by default).

    python benchmarks/decode_formats.py CACHE.kv [--formats float bf16 int8 int4] [--steps 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

QUESTION = "Summarize the document in detail, section by section."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--formats", nargs="+", default=["float", "bf16", "int8", "int4"],
                    choices=["float", "head-bf16", "bf16", "int8", "int4"])  # fmt: skip
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--steps, --rounds and --threads must be at least 1")
    if not args.cache.is_file():
        ap.error(f"{args.cache}: no such file")
    torch.set_num_threads(args.threads)
    from rocketkv_cli.api.rocketkv import RocketKV, read_cache
    from rocketkv_cli.eval.bench import machine_info, rocketkv_answer_s

    model_id = read_cache(args.cache).info.identity.model_id
    engines = {f: RocketKV.load(model_id, device="cpu", weights=f).engine for f in args.formats}
    times: dict[str, dict[str, list[float]]] = {f: {"exact": [], "hsa": []} for f in args.formats}
    with torch.inference_mode():
        for r in range(args.rounds):
            for f, engine in engines.items():
                for mode in ("exact", "hsa"):
                    _, step = rocketkv_answer_s(engine, args.cache, QUESTION, args.steps, 4, sparse=mode == "hsa")
                    times[f][mode].append(step)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    ms = {f: {m: statistics.median(v) * 1e3 for m, v in d.items()} for f, d in times.items()}
    base = ms[args.formats[0]]
    print(f"decode ms per step, {model_id}, {args.cache.name}, {args.threads} threads, median of {args.rounds} rounds "
          f"of {args.steps} steps:")  # fmt: skip
    for f in args.formats:
        print(f"  {f:>6}: exact {ms[f]['exact']:7.1f} ms ({base['exact'] / ms[f]['exact']:4.2f}×)   "
              f"HSA {ms[f]['hsa']:7.1f} ms ({base['hsa'] / ms[f]['hsa']:4.2f}×)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"model": model_id, "cache": args.cache.name, "threads": args.threads,
                                         "steps": args.steps, "rounds": args.rounds, "machine": machine_info(),
                                         "ms": ms, "all_s": times}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
