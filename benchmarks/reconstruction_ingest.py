#!/usr/bin/env python
"""Ingest with context reconstruction: the CPU fast path against the reference, side by side.

`--observation reconstruct` (SmolLM2's default) re-reads the document after its prefill and
scores every key by the attention the re-read gives it (docs/stage1-methods.md). Its attention
has a CPU fast path (`rocketkv_cli/ops/cpu.py`: fused attention plus blocked score maxima)
beside the torch reference (`core/stage1.py`, chosen with `ROCKETKV_KERNELS=torch`). One model
load; the same document ingested in turn with the fast path, with the reference, and with the
tail window (no re-read, for the cost of reconstruction itself), `--rounds` times round-robin
so a busy machine shifts them alike. Prints the median seconds of each, the fast path's speed-up
over the reference, and whether the two caches keep the same tokens.

    python benchmarks/reconstruction_ingest.py DOCUMENT [--model smollm2-135m] [--rounds 2] [--json OUT]
        [--no-reference]   # only the fast path and the tail window: what reconstruction adds to a prefill
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("document", type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-reference", action="store_true", help="skip the torch reference (the slow way)")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    if not args.document.is_file():
        ap.error(f"{args.document}: no such file")
    torch.set_num_threads(args.threads)
    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.core.cache import CompressedKVCache
    from rocketkv_cli.eval.bench import machine_info

    rk = RocketKV.load(args.model, device="cpu")
    ways = {"reconstruct, fast path": ("auto", "reconstruct"), "reconstruct, reference": ("torch", "reconstruct"),
            "tail window": ("auto", "tail")}  # fmt: skip
    if args.no_reference:
        del ways["reconstruct, reference"]
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    caches: dict[str, CompressedKVCache] = {}
    previous = os.environ.get("ROCKETKV_KERNELS")
    try:
        for r in range(args.rounds):
            for way, (backend, observation) in ways.items():
                os.environ["ROCKETKV_KERNELS"] = backend
                t0 = time.perf_counter()
                cache = rk.ingest(args.document, observation=observation).cache
                if not isinstance(cache, CompressedKVCache):  # before any more rounds are spent
                    raise SystemExit(f"{args.document}: the document must fit one segment of {args.model}'s context")
                caches[way] = cache
                seconds[way].append(time.perf_counter() - t0)
                print(f"round {r + 1}: {way}: {seconds[way][-1]:.1f} s", flush=True)
    finally:
        if previous is None:
            os.environ.pop("ROCKETKV_KERNELS", None)
        else:
            os.environ["ROCKETKV_KERNELS"] = previous
    fast, ref = caches["reconstruct, fast path"], caches.get("reconstruct, reference")
    same = (
        None
        if ref is None
        else sum(torch.equal(a.positions, b.positions) for a, b in zip(fast.layers, ref.layers, strict=True))
    )
    med = {w: statistics.median(v) for w, v in seconds.items()}
    tail = med["tail window"]
    print(f"ingest of {args.document.name} ({fast.n_context_tokens} tokens), {args.model}, {args.threads} threads, "
          f"median of {args.rounds} rounds:")  # fmt: skip
    for way, s in med.items():
        print(f"  {way:>22}: {s:7.1f} s ({s / tail:4.2f}× the tail window's)")
    if ref is not None:
        speedup = med["reconstruct, reference"] / med["reconstruct, fast path"]
        print(
            f"  fast path {speedup:.2f}× faster than the reference; {same} of {len(fast.layers)} layers keep the "
            "same tokens"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "document": args.document.name,
                                         "context_tokens": fast.n_context_tokens, "threads": args.threads,
                                         "rounds": args.rounds, "machine": machine_info(), "median_s": med,
                                         "all_s": seconds, "layers_same_tokens": same,
                                         "layers": len(fast.layers)}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
