"""The LM head alone per decode step in float32, head-bf16 and head-int4, side by side in one
process, and whether head-int4's greedy tokens are the float head's on real text.

    python benchmarks/head_formats.py            # gemma-3-270m, 2,000 positions of the GPL, 1 thread
    python benchmarks/head_formats.py --smoke    # a tiny random Gemma, seconds (CI)

Hidden states: one prefill forward (after the final norm: what the head reads). Timing: one
position per call in `decode_step()`, the formats in turn on each of `--steps` positions
(round-robin), median and p90. Then each format's greedy token against the float head's at every
position, one per call as decode runs, and head-int4's outcomes (`CertifiedHead.positions`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rocketkv_cli.eval.reports import write_json
from rocketkv_cli.model.weights import Bf16Linear, CertifiedHead, RefinedHead, decode_step

REPO = Path(__file__).resolve().parents[1]


def hidden_states(smoke: bool, text: Path, positions: int) -> tuple[str, nn.Linear, torch.Tensor]:
    """(model name, its LM head, hidden states `[positions, H]` after the final norm)."""
    if smoke:
        from transformers import AutoModelForCausalLM, Gemma3TextConfig

        torch.manual_seed(0)
        cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                               sliding_window=16, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        model, name = AutoModelForCausalLM.from_config(cfg).float().eval(), "tiny random Gemma 3 (V=4096, H=128)"
        ids = torch.randint(2, cfg.vocab_size, (1, positions))
    else:
        from rocketkv_cli.model.loading import load_model

        loaded = load_model("gemma-3-270m", device="cpu", weights="float")
        model, name = loaded.model, "gemma-3-270m"
        ids = loaded.tokenizer(text.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, :positions]
    with torch.inference_mode():
        return name, model.lm_head, model.model(ids).last_hidden_state[0]  # [T, H]


def measure(head: nn.Linear, hidden: torch.Tensor, steps: int) -> dict[str, Any]:
    """Build the three heads over `head` (seconds each), time them round-robin on `steps`
    positions of `hidden` `[T, H]` (ms), and compare greedy tokens at every position."""
    build = {"float": lambda: head, "head-bf16": lambda: RefinedHead(Bf16Linear(head), head.weight, head.bias),
             "head-int4": lambda: CertifiedHead(head)}  # fmt: skip
    formats: dict[str, Any] = {}
    build_s: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    for name, make in build.items():
        start = time.perf_counter()
        formats[name], times[name] = make(), []
        build_s[name] = time.perf_counter() - start
    with torch.inference_mode(), decode_step():
        for n, row in enumerate(torch.linspace(0, len(hidden) - 1, steps + 2).long().tolist()):
            for name, module in formats.items():
                start = time.perf_counter()
                module(hidden[row].view(1, 1, -1))
                if n >= 2:  # two rounds of warm-up
                    times[name].append((time.perf_counter() - start) * 1e3)
        ms = {k: {"median_ms": statistics.median(t), "p90_ms": sorted(t)[int(0.9 * (len(t) - 1))]}
              for k, t in times.items()}  # fmt: skip
        before = dict(formats["head-int4"].positions)  # the greedy pass's outcomes only
        reference = torch.cat([head(hidden[i : i + 256]).argmax(-1) for i in range(0, len(hidden), 256)]).tolist()
        equal = {name: sum(int(formats[name](hidden[i].view(1, 1, -1)).argmax()) == reference[i]
                           for i in range(len(hidden))) for name in ("head-bf16", "head-int4")}  # fmt: skip
    outcomes = {k: n - before[k] for k, n in formats["head-int4"].positions.items()}
    return {"build_s": build_s, "ms_per_step": ms, "positions": len(hidden), "greedy_equal_to_float": equal,
            "head_int4_outcomes": outcomes}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny random model, 64 positions, 10 steps (CI)")
    p.add_argument("--text", type=Path, default=Path("/work/shared/data/gpl-3.txt"))
    p.add_argument("--positions", type=int, default=2000, help="positions of real text checked for greedy equality")
    p.add_argument("--steps", type=int, default=40, help="positions timed per format (round-robin)")
    p.add_argument("--out", type=Path, help="JSON result (default without --smoke: docs/bench/head-formats-*.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    name, head, hidden = hidden_states(args.smoke, args.text, 64 if args.smoke else args.positions)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    result = {"model": name, "text": args.text.name, "threads": 1, "steps_timed": 10 if args.smoke else args.steps,
              "torch": torch.__version__, "commit": git.stdout.strip()}  # fmt: skip
    result.update(measure(head, hidden, result["steps_timed"]))
    for fmt, t in result["ms_per_step"].items():
        print(f"{fmt:10s} {t['median_ms']:7.2f} ms (p90 {t['p90_ms']:.2f}), built in {result['build_s'][fmt]:.2f} s")
    print(f"greedy tokens equal to the float head's: {result['greedy_equal_to_float']} of {result['positions']}")
    print(f"head-int4 outcomes: {result['head_int4_outcomes']}")
    out = args.out or (None if args.smoke else REPO / "docs" / "bench" / "head-formats-gemma-3-270m.json")
    if out is not None:
        write_json(out, result, end="\n")
    return 0 if result["greedy_equal_to_float"]["head-int4"] == result["positions"] else 1


if __name__ == "__main__":
    sys.exit(main())
