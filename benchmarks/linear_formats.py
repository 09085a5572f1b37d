#!/usr/bin/env python
"""What one decode step's matrix-vector products cost in each weight format on this CPU.

Decode at batch 1 multiplies one activation row by every weight matrix once per token, so on a
CPU its floor is the time to stream all the weights from memory. This builds every distinct
linear of a preset (each layer's attention projections and MLP, and the LM head) with random
weights in each format, and times one decode step's products in layer order — each matrix read
once per step, as decode reads it, so nothing stays in the CPU's caches between its uses (an
earlier version of this script repeated one matrix 20 times and reported cache-hot speeds: 2×
too fast for float32). Formats, side by side and round-robin in one process (so a busy machine
shifts every format alike): float32; bfloat16 weights and activations; weight-only int8
(`aten._weight_int8pack_mm`, `--weights int8`) and weight-only int4 (`aten._weight_int4pack_mm_for_cpu`,
groups of 32, `--weights int4`), each with float32 and with bfloat16 activations. Prints per
format: ms per token over all linears, GB/s of weight bytes streamed, ratio to float32, and
the share of the LM head.

    python benchmarks/linear_formats.py [--preset smollm2-135m] [--threads 2] [--rounds 8] [--json OUT]
    python benchmarks/linear_formats.py --table A.json B.json   # the docs/performance.md table
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

# (K, N) of each linear of a decoder layer (count per layer), and the LM head, from the configs
PRESETS = {
    "smollm2-135m": {
        "layers": 30,
        "shapes": {
            "q_proj": (576, 576),
            "k_proj": (576, 192),
            "v_proj": (576, 192),
            "o_proj": (576, 576),
            "gate/up_proj": (576, 1536),
            "down_proj": (1536, 576),
        },
        "per_layer": {"gate/up_proj": 2},
        "lm_head": (576, 49152),
    },  # fmt: skip
    "gemma-3-270m": {
        "layers": 18,
        "shapes": {
            "q_proj": (640, 1024),
            "k_proj": (640, 256),
            "v_proj": (640, 256),
            "o_proj": (1024, 640),
            "gate/up_proj": (640, 2048),
            "down_proj": (2048, 640),
        },
        "per_layer": {"gate/up_proj": 2},
        "lm_head": (640, 262144),
    },  # fmt: skip
}
FORMATS = ("float32", "bfloat16", "int8, f32 act", "int8, bf16 act", "int4, f32 act", "int4, bf16 act")
INT4_GROUP = 32


def product(fmt: str, k: int, n: int) -> tuple[Callable[[], torch.Tensor], int]:
    """A zero-argument call doing `x [1, k] · Wᵀ` with a fresh random `W [n, k]` in format
    `fmt`, and the bytes of weights (and scales) it streams."""
    w = torch.randn(n, k)
    act = torch.bfloat16 if "bf16" in fmt or fmt == "bfloat16" else torch.float32
    x = torch.randn(1, k, dtype=act)
    if fmt in ("float32", "bfloat16"):
        wf = w.to(act)
        return (lambda: torch.nn.functional.linear(x, wf)), wf.numel() * wf.element_size()
    if fmt.startswith("int8"):
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        s = scale.to(act)
        return (lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s)), n * k + s.numel() * s.element_size()
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.randn(k // INT4_GROUP, n, 2).to(act)
    nbytes = n * k // 2 + scales_zeros.numel() * scales_zeros.element_size()
    return (lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_zeros)), nbytes


def decode_step(spec: dict, fmt: str) -> tuple[list[tuple[str, Callable[[], torch.Tensor]]], int]:
    """Every linear of one decode step, in layer order, each with its own weights; and their bytes."""
    calls, total = [], 0
    for _ in range(spec["layers"]):
        for name, (k, n) in spec["shapes"].items():
            for _ in range(spec["per_layer"].get(name, 1)):
                call, nbytes = product(fmt, k, n)
                calls.append((name, call))
                total += nbytes
    call, nbytes = product(fmt, *spec["lm_head"])
    calls.append(("lm_head", call))
    return calls, total + nbytes


def table(paths: list[str]) -> str:
    """Markdown: per preset, each format's per-token milliseconds over all linears and its speed
    relative to float32, from `--json` results."""
    runs = [json.load(open(p)) for p in paths]
    names = list(runs[0]["per_token_ms"])
    out = ["| preset (threads) | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for run in runs:
        ms = run["per_token_ms"]
        cells = [f"{ms[n]:.1f} ms ({ms['float32'] / ms[n]:.2f}×)" for n in names]
        out.append(f"| {run['preset']} ({run['threads']}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="round-robin rounds (each: one decode step per format)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="only print the markdown table of these results")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    spec = PRESETS[args.preset]
    steps = {f: decode_step(spec, f) for f in FORMATS}
    step_s: dict[str, list[float]] = {f: [] for f in FORMATS}
    head_s: dict[str, list[float]] = {f: [] for f in FORMATS}
    with torch.inference_mode():
        for f, (calls, _) in steps.items():  # warm-up: one step each
            for _, call in calls:
                call()
        for _ in range(args.rounds):
            for f, (calls, _) in steps.items():
                t0 = time.perf_counter()
                for _, call in calls[:-1]:
                    call()
                t1 = time.perf_counter()
                calls[-1][1]()
                t2 = time.perf_counter()
                step_s[f].append(t2 - t0)
                head_s[f].append(t2 - t1)
    per_token = {f: statistics.median(step_s[f]) for f in FORMATS}
    base = per_token["float32"]
    print(f"one decode step's linears of {args.preset}, {args.threads} threads, median of {args.rounds} rounds:")
    rows = []
    for f in FORMATS:
        nbytes, sec, head = steps[f][1], per_token[f], statistics.median(head_s[f])
        rows.append({"format": f, "ms": sec * 1e3, "weight_bytes": nbytes, "gb_per_s": nbytes / sec / 1e9,
                     "lm_head_ms": head * 1e3, "vs_float32": base / sec})  # fmt: skip
        print(f"  {f:>15}: {sec * 1e3:7.1f} ms  {nbytes / 1e6:6.0f} MB  {nbytes / sec / 1e9:5.1f} GB/s  "
              f"{base / sec:4.2f}× float32's speed  (LM head {head * 1e3:.1f} ms)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            result = {"preset": args.preset, "threads": args.threads, "torch": torch.__version__, "cold": True,
                      "rows": rows, "per_token_ms": {f: s * 1e3 for f, s in per_token.items()}}  # fmt: skip
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
