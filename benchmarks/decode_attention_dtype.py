#!/usr/bin/env python
"""Exact decode attention over float32 vs bfloat16 keys and values, side by side (CPU).

One decode step's exact attention as `model.hf.exact_decode_attention` computes it on a CPU (the
G query heads of a GQA group against their KV head, two matmuls, softmax in float32), over
random keys and values of a preset's geometry, for every full-attention layer, with the stored
tokens per layer that a default-budget cache keeps (SmolLM2 at 6.4K tokens: 2,114). The two
dtypes take turns round by round in one process; prints the median ms per step of each. The
bfloat16 way also rounds the logits and the probabilities to bfloat16 (what a bfloat16 matmul
does), so it is a speed bound, not an accuracy claim: its agreement with float32 is not measured
here.

    python benchmarks/decode_attention_dtype.py [--tokens 2114] [--layers 30] [--kv-heads 3]
        [--group 3] [--head-dim 64] [--threads 2] [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def step(query: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], scaling: float) -> torch.Tensor:
    """query [1, Hkv, G, D] float32; kv: per layer keys, values [1, Hkv, L, D] → last output [1, Hkv, G, D]."""
    out = query
    for keys, values in kv:
        logits = torch.matmul(query.to(keys.dtype), keys.transpose(-1, -2)).float() * scaling  # [1, Hkv, G, L]
        out = torch.matmul(torch.softmax(logits, dim=-1).to(values.dtype), values)  # [1, Hkv, G, D]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2114, help="stored tokens per KV head and layer")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head (GQA group)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if min(args.tokens, args.layers, args.kv_heads, args.group, args.head_dim, args.threads, args.rounds,
           args.steps) < 1:  # fmt: skip
        ap.error("every size must be at least 1")
    torch.set_num_threads(args.threads)
    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    caches = {
        dtype: [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
        for dtype in (torch.float32, torch.bfloat16)
    }
    query = torch.randn(1, args.kv_heads, args.group, args.head_dim)
    scaling = args.head_dim**-0.5
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in caches}
    for _ in range(args.rounds):
        for dtype, kv in caches.items():
            step(query, kv, scaling)  # warm-up
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(query, kv, scaling)
                times[dtype].append(time.perf_counter() - t0)
    ms = {dtype: statistics.median(v) * 1e3 for dtype, v in times.items()}
    print(f"exact decode attention, {args.layers} layers × {args.kv_heads} KV heads × {args.group} queries, "
          f"{args.tokens} stored tokens, head dim {args.head_dim}, {args.threads} threads, median of "
          f"{args.rounds * args.steps} steps:")  # fmt: skip
    for dtype, value in ms.items():
        print(f"  {str(dtype).removeprefix('torch.'):>9}: {value:6.2f} ms per step "
              f"({ms[torch.float32] / value:4.2f}× float32's speed)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
