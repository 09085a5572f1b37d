#!/usr/bin/env python
"""The direct decode step (`rocketkv_cli/model/step.py`) against the model's own forward, side by side.

One model load; the same cache answers the same question, alternating the two ways of running a
decode step round by round (so a busy machine shifts both alike): the question's prefill, then
`--steps` greedy decode steps timed after 4 warm-up steps, exact attention over the pruned cache
(what `ask` runs on CPU at the default budget). Prints the median ms per step of each and the
ratio. The weights are the model's default for the device (`--weights` to choose).

    python benchmarks/decode_step.py CACHE.kv [--steps 24] [--rounds 5] [--weights bf16] [--json OUT]
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
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", choices=["float", "bf16", "int8", "int4"], default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--steps, --rounds and --threads must be at least 1")
    if not args.cache.is_file():
        ap.error(f"{args.cache}: no such file")
    torch.set_num_threads(args.threads)
    from rocketkv_cli.engine.api import RocketKV, read_cache
    from rocketkv_cli.eval.bench import machine_info, rocketkv_answer_s

    model_id = read_cache(args.cache).info.identity.model_id
    rk = RocketKV.load(model_id, device="cpu", weights=args.weights)
    engine = rk.engine
    direct = engine.step
    if direct is None:
        ap.error(f"{model_id}: its architecture has no direct decode step")
    times: dict[str, list[float]] = {"direct": [], "forward": []}
    with torch.inference_mode():
        for r in range(args.rounds):
            for way in ("direct", "forward") if r % 2 == 0 else ("forward", "direct"):
                engine.step = direct if way == "direct" else None
                _, step = rocketkv_answer_s(engine, args.cache, QUESTION, args.steps, 4, sparse=False)
                times[way].append(step)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    engine.step = direct
    ms = {w: statistics.median(v) * 1e3 for w, v in times.items()}
    weights = engine.loaded.weights
    print(f"decode ms per step, {model_id} ({weights} weights), {args.cache.name}, {args.threads} threads, exact "
          f"attention, median of {args.rounds} rounds of {args.steps} steps:")  # fmt: skip
    print(f"  model forward: {ms['forward']:7.1f} ms")
    print(f"  direct step:   {ms['direct']:7.1f} ms ({ms['forward'] / ms['direct']:4.2f}× faster)")
    if args.json:
        args.json.write_text(json.dumps({"model": model_id, "weights": weights, "cache": args.cache.name,
                                         "threads": args.threads, "steps": args.steps, "rounds": args.rounds,
                                         "machine": machine_info(), "ms": ms, "all_s": times}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
