#!/usr/bin/env python
"""The direct decode step (`rocketkv_cli/model/step.py`) against the model's own forward, side by side.

Four ways of running a decode step: `forward` (the model's forward: the code before the direct
step), `direct, SDPA, separate` (the direct step with SDPA's CPU kernel for exact decode
attention and each projection its own linear: the step before the two changes below),
`direct, separate` (exact decode attention as grouped matmuls, `model.hf.exact_decode_attention`,
each projection still its own linear) and `direct` (also q/k/v and gate/up joined into one
linear each for int8/bf16 weights, `_PackedLinear.join`: what `ask` runs). With `--compile`, two
more: `compiled MLP` (`direct` with each layer's joined MLP through `torch.compile`) and
`compiled step` (the whole `direct` step through `torch.compile`), inductor with automatic
dynamic shapes and room for a graph per layer; a recompile past dynamo's limit fails the run
instead of silently timing eager code, and each way's first call (its compile) is reported.
One model load, one decoder over the cache: the question's prefill, then greedy decode steps
with the ways taking turns step by step (so a busy machine, and the tail's growth, shift them
alike), exact attention over the pruned cache (what `ask` runs on CPU at the default budget);
the first 8 steps (with `--compile`, 8 per way) are warm-up. Prints the median ms per step of
each and its speed relative to `forward`. The weights are the model's default for the device
(`--weights` to choose).

    python benchmarks/decode_step.py CACHE.kv [--steps 48] [--weights int8] [--compile] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

QUESTION = "Summarize the document in detail, section by section."


def sdpa_decode_attention(query, keys, values, scaling):
    """SDPA's kernel for one decode token (rocketkv's exact decode attention before the grouped matmuls)."""
    gqa = query.shape[1] != keys.shape[1]
    return F.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=gqa)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--steps", type=int, default=48, help="timed steps per way")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", choices=["float", "head-bf16", "bf16", "int8", "int4"], default=None)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd ways")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.steps < 1 or args.threads < 1:
        ap.error("--steps and --threads must be at least 1")
    if not args.cache.is_file():
        ap.error(f"{args.cache}: no such file")
    torch.set_num_threads(args.threads)
    from rocketkv_cli.api.rocketkv import RocketKV, read_cache
    from rocketkv_cli.eval.bench import machine_info

    model_id = read_cache(args.cache).info.identity.model_id
    rk = RocketKV.load(model_id, device="cpu", weights=args.weights)
    engine = rk.engine
    direct = engine.step
    if direct is None:
        ap.error(f"{model_id}: its architecture has no direct decode step")
    from rocketkv_cli.engine.answer import decode_config_for
    from rocketkv_cli.engine.decoder import Decoder
    from rocketkv_cli.model import hf
    from rocketkv_cli.store.format import load_cache

    grouped, joins = hf.exact_decode_attention, direct._joins
    ways = ["forward", "direct, SDPA, separate", "direct, separate", "direct"]
    compiled: dict[int, tuple] = {}
    compiled_step = None
    if args.compile:
        import torch._dynamo as dynamo

        ways += ["compiled MLP", "compiled step"]
        # Room for every layer's MLP (one code object, guards per layer) and for the step's
        # shapes; `dynamic=None` lets dynamo mark the growing cache length dynamic after its
        # first recompile instead of compiling a graph per length.
        dynamo.config.recompile_limit = 1024
        dynamo.config.accumulated_recompile_limit = 4096
        dynamo.config.fail_on_recompile_limit_hit = True  # never time a silent eager fallback
        compiled_step = torch.compile(direct, dynamic=None)

        def compiled_joins(i, layer):  # the joins, each layer's MLP compiled once
            if i not in compiled:
                qkv, mlp = joins(i, layer)
                compiled[i] = (qkv, None if mlp is None else torch.compile(mlp, dynamic=None))
            return compiled[i]

    first_call_s: dict[str, float] = {}
    times: dict[str, list[float]] = {w: [] for w in ways}
    stored = load_cache(args.cache)
    ids = engine.question_ids(QUESTION)
    n = len(ways)
    warmup = 8 * n if args.compile else 8  # compiled ways recompile during their first calls
    decoder = Decoder(engine, stored, len(ids) + warmup + n * args.steps + 16, decode_config_for(stored, False))
    try:
        with torch.inference_mode(), decoder.attention():
            token = int(decoder.prefill(ids).argmax())
            for i in range(warmup + n * args.steps):
                way = ways[i % n]
                engine.step = None if way == "forward" else compiled_step if way == "compiled step" else direct
                hf.exact_decode_attention = sdpa_decode_attention if "SDPA" in way else grouped  # type: ignore[assignment]
                direct._joins = (joins if way in ("direct", "compiled step") else compiled_joins  # type: ignore[method-assign]
                                 if way == "compiled MLP" else (lambda *_: (None, None)))  # fmt: skip
                t0 = time.perf_counter()
                token = int(decoder.decode_one_token(token).argmax())
                elapsed = time.perf_counter() - t0
                first_call_s.setdefault(way, elapsed)
                if i >= warmup:
                    times[way].append(elapsed)
    finally:
        engine.step, hf.exact_decode_attention, direct._joins = direct, grouped, joins  # type: ignore[method-assign]
    ms = {w: statistics.median(v) * 1e3 for w, v in times.items()}
    weights = engine.loaded.weights
    print(f"decode ms per step, {model_id} ({weights} weights), {args.cache.name}, {args.threads} threads, exact "
          f"attention, median of {args.steps} steps each, taking turns:")  # fmt: skip
    for way in ways:
        print(f"  {way:>22}: {ms[way]:7.1f} ms ({ms['forward'] / ms[way]:4.2f}× the forward's speed; "
              f"first call {first_call_s[way]:.2f} s)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"model": model_id, "weights": weights, "cache": args.cache.name,
                                         "threads": args.threads, "steps": args.steps,
                                         "machine": machine_info(), "ms": ms, "first_call_s": first_call_s,
                                         "all_s": times}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
