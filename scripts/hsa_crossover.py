#!/usr/bin/env python
"""Where stage 2 pays: one full-attention layer's decode attention, HSA (as `ask` runs it) vs exact
attention over the same stored tokens, per preset, at the default budget (docs/performance.md,
"Where stage 2 pays"; `HSA_MIN_TOKENS` in rocketkv_cli/engine/answer.py is set from it).

Usage: python scripts/hsa_crossover.py [--models gemma-3-270m,smollm2-135m] [--sizes 2048,...]
       [--threads 1] [--steps 20]
Prints one JSON line per preset and size (milliseconds, and HSA's speedup over exact attention),
then the smallest size from which HSA is faster at every larger size measured.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gemma-3-270m,smollm2-135m")
    ap.add_argument("--sizes", default="2048,3072,4096,6144,8192,32768", help="stored tokens per layer")
    ap.add_argument("--budget", type=int, default=512, help="token budget the page settings derive from")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per size (median)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from rocketkv_cli import RocketKV
    from rocketkv_cli.eval.bench import attention_crossover, crossover_tokens

    for model in args.models.split(","):
        rk = RocketKV.load(model, device="cpu")
        rows = [attention_crossover(rk.engine, (int(s),), token_budget=args.budget, steps=args.steps)[0]
                for s in args.sizes.split(",")]  # fmt: skip
        for row in rows:
            print(json.dumps({"model": model, "kept_tokens": row["kept_tokens"], "page_size": row["page_size"],
                              "hsa_ms": round(1e3 * row["hsa_s"], 3), "exact_ms": round(1e3 * row["exact_s"], 3),
                              "hsa_speedup": round(row["hsa_speedup"], 2)}), flush=True)  # fmt: skip
        print(json.dumps({"model": model, "hsa_faster_from": crossover_tokens(rows, margin=1.0)}), flush=True)


if __name__ == "__main__":
    main()
