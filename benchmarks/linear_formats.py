#!/usr/bin/env python
"""What one decode step's matrix-vector products cost in each weight format on this CPU.

Decode at batch 1 multiplies one activation row by every weight matrix, so its speed on a CPU
is set by how fast each kernel streams its weights. This times, side by side in one process and
round-robin (so a busy machine shifts every format alike), `x [1, K] · Wᵀ` for each linear shape
of a preset (attention projections, MLP, LM head) in: float32; bfloat16 weights and activations;
weight-only int8 (`aten._weight_int8pack_mm`, what `--weights int8` runs) with float32 and with
bfloat16 activations; weight-only int4 (`aten._weight_int4pack_mm_for_cpu`, groups of 32) with
bfloat16 activations. Prints one row per shape and format: median µs, GB/s of weight bytes
streamed, and the ratio to float32; then the per-token total over the model's linears.

    python benchmarks/linear_formats.py [--preset smollm2-135m] [--threads 2] [--rounds 15] [--json OUT]
    python benchmarks/linear_formats.py --table A.json B.json   # the docs/performance.md table
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# (K, N, count per token) of each linear of a decoder layer, and the LM head, from the configs
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


def formats(k: int, n: int) -> dict:
    """name → (a zero-argument call doing one product, bytes of weights it streams)."""
    w = torch.randn(n, k)
    x = torch.randn(1, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    scale = w.abs().amax(dim=1) / 127
    w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    out = {
        "float32": (lambda: torch.nn.functional.linear(x, w), 4 * n * k),
        "bfloat16": (lambda: torch.nn.functional.linear(xb, wb), 2 * n * k),
        "int8, f32 act": (lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scale), n * k),
        "int8, bf16 act": (lambda: torch.ops.aten._weight_int8pack_mm(xb, w8, scale.bfloat16()), n * k),
    }
    if k % 32 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_zeros = torch.randn(k // 32, n, 2).bfloat16()
        out["int4, bf16 act"] = (
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, scales_zeros),
            n * k // 2 + scales_zeros.numel() * 2,
        )
    return out


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
    ap.add_argument("--rounds", type=int, default=15, help="round-robin rounds (each: every format once per shape)")
    ap.add_argument("--repeat", type=int, default=20, help="products per timing")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="only print the markdown table of these results")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    torch.set_num_threads(args.threads)
    spec = PRESETS[args.preset]
    shapes = {**spec["shapes"], "lm_head": spec["lm_head"]}
    rows, per_token = [], {}
    with torch.inference_mode():
        for name, (k, n) in shapes.items():
            calls = formats(k, n)
            times: dict[str, list[float]] = {f: [] for f in calls}
            for f, (call, _) in calls.items():  # warm-up
                for _ in range(3):
                    call()
            for _ in range(args.rounds):
                for f, (call, _) in calls.items():
                    t0 = time.perf_counter()
                    for _ in range(args.repeat):
                        call()
                    times[f].append((time.perf_counter() - t0) / args.repeat)
            base = statistics.median(times["float32"])
            count = 1 if name == "lm_head" else spec["layers"] * spec["per_layer"].get(name, 1)
            for f, (_, nbytes) in calls.items():
                med = statistics.median(times[f])
                rows.append({"linear": name, "k": k, "n": n, "format": f, "median_us": med * 1e6,
                             "weight_gb_per_s": nbytes / med / 1e9, "vs_float32": base / med})  # fmt: skip
                per_token[f] = per_token.get(f, 0.0) + med * count
                print(f"{name:>13} [{k}x{n}] {f:>15}: {med * 1e6:9.1f} µs  {nbytes / med / 1e9:6.1f} GB/s  "
                      f"{base / med:5.2f}× float32's speed")  # fmt: skip
    print(f"\nper token, all linears of {args.preset} ({args.threads} threads):")
    for f, seconds in per_token.items():
        print(f"  {f:>15}: {seconds * 1e3:7.1f} ms  ({per_token['float32'] / seconds:4.2f}× float32's speed)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"preset": args.preset, "threads": args.threads, "torch": torch.__version__, "rows": rows,
                       "per_token_ms": {f: s * 1e3 for f, s in per_token.items()}}, fh, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
