"""The LM head alone per decode step in each head format, side by side in one process, and
whether `head-int4`'s greedy tokens are the float head's on real text.

    python benchmarks/head_formats.py            # gemma-3-270m, 2,000 positions of the GPL, 1 thread
    python benchmarks/head_formats.py --smoke    # a tiny random Gemma, seconds (CI)

Hidden states come from one prefill forward over the document's first `--positions` tokens
(after the final norm: what the head reads in a decode step). Three heads over the same float
weights: `float` (the model's `nn.Linear`, float32), `head-bf16` (`RefinedHead` over a
`Bf16Linear`: bfloat16 ranking, top 64 recomputed in float32) and `head-int4` (`CertifiedHead`
over an `Int4Linear`: int4 ranking, top 64 recomputed, the certificate, widening or the float
head where it cannot certify). Timing: one position per call inside `decode_step()`, the formats
in turn on the same position (round-robin, so a busy machine slows each alike), `--steps`
positions spread over the text, median (and p90) per format. Then every position, one at a
time as decode runs them: each format's greedy token against the float head's, and
`head-int4`'s outcomes (certified in the top 64, certified after widening, float head). The
result is printed and written as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import platform
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
DEFAULT_TEXT = Path("/work/shared/data/gpl-3.txt")
DEFAULT_OUT = REPO / "docs" / "bench" / "head-formats-gemma-3-270m.json"


def hidden_states(smoke: bool, text: Path, positions: int) -> tuple[str, nn.Linear, torch.Tensor]:
    """(model name, its LM head, hidden states `[positions, H]` after the final norm)."""
    if smoke:
        from transformers import AutoModelForCausalLM, Gemma3TextConfig

        torch.manual_seed(0)
        cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                               sliding_window=16, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
        ids = torch.randint(2, cfg.vocab_size, (1, positions))
        name = "tiny random Gemma 3 (V=4096, H=128)"
    else:
        from rocketkv_cli.model.loading import load_model

        loaded = load_model("gemma-3-270m", device="cpu", weights="float")
        model, name = loaded.model, "gemma-3-270m"
        ids = loaded.tokenizer(text.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, :positions]
    with torch.inference_mode():
        hidden = model.model(ids).last_hidden_state[0]  # [T, H], after the final norm
    return name, model.lm_head, hidden


def heads(float_head: nn.Linear) -> tuple[dict[str, nn.Module], dict[str, float]]:
    """The three heads over `float_head`'s weights (the tied embedding: no float copy), and the
    seconds each took to build (what `--weights` adds to a model's load)."""
    build = {"float": lambda: float_head, "head-bf16": lambda: RefinedHead(Bf16Linear(float_head), float_head.weight,
                                                                          float_head.bias),
             "head-int4": lambda: CertifiedHead(float_head)}  # fmt: skip
    formats, seconds = {}, {}
    for name, make in build.items():
        start = time.perf_counter()
        formats[name] = make()
        seconds[name] = time.perf_counter() - start
    return formats, seconds


def time_heads(formats: dict[str, nn.Module], hidden: torch.Tensor, steps: int) -> dict[str, dict[str, float]]:
    """Median and p90 ms per call `{format: {"median_ms", "p90_ms"}}` of each head on one position
    `[1, 1, H]`, round-robin over `steps` positions spread over `hidden` `[T, H]`."""
    times: dict[str, list[float]] = {name: [] for name in formats}
    rows = torch.linspace(0, len(hidden) - 1, steps + 2).long().tolist()
    with torch.inference_mode(), decode_step():
        for n, row in enumerate(rows):
            x = hidden[row].view(1, 1, -1)
            for name, head in formats.items():
                start = time.perf_counter()
                head(x)
                if n >= 2:  # the first two rounds warm up
                    times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": statistics.median(t), "p90_ms": sorted(t)[int(0.9 * (len(t) - 1))]}
            for name, t in times.items()}  # fmt: skip


def greedy_agreement(formats: dict[str, nn.Module], hidden: torch.Tensor) -> dict[str, Any]:
    """Each format's greedy token against the float head's at every position of `hidden` `[T, H]`
    (one position per call, as decode runs them), and `head-int4`'s certificate outcomes."""
    certified = formats["head-int4"]
    assert isinstance(certified, CertifiedHead)
    before = dict(certified.positions)
    with torch.inference_mode():
        reference = torch.cat([formats["float"](hidden[i : i + 256]).argmax(-1) for i in range(0, len(hidden), 256)])
        equal = {}
        with decode_step():
            for name in ("head-bf16", "head-int4"):
                tokens = [int(formats[name](hidden[i].view(1, 1, -1)).argmax()) for i in range(len(hidden))]
                equal[name] = sum(int(a == b) for a, b in zip(tokens, reference.tolist(), strict=True))
    outcomes = {k: certified.positions[k] - before[k] for k in certified.positions}
    return {"positions": len(hidden), "greedy_equal_to_float": equal, "head_int4_outcomes": outcomes,
            "head_int4_certified_share": (outcomes["topk"] + outcomes["widened"]) / len(hidden)}  # fmt: skip


def commit() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return run.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny random model, 64 positions, 10 steps (CI)")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--positions", type=int, default=2000, help="positions of real text checked for greedy equality")
    p.add_argument("--steps", type=int, default=40, help="positions timed per format (round-robin)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (--smoke: not written unless given)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    positions, steps = (64, 10) if args.smoke else (args.positions, args.steps)
    name, float_head, hidden = hidden_states(args.smoke, args.text, positions)
    formats, build_s = heads(float_head)
    result: dict[str, Any] = {"model": name, "text": args.text.name, "threads": args.threads, "steps_timed": steps,
                              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                              "commit": commit(), "build_s": build_s}  # fmt: skip
    result["ms_per_step"] = time_heads(formats, hidden, steps)
    result.update(greedy_agreement(formats, hidden))
    base = result["ms_per_step"]["float"]["median_ms"]
    for fmt, t in result["ms_per_step"].items():
        print(f"{fmt:10s} {t['median_ms']:7.2f} ms (p90 {t['p90_ms']:.2f}; {base / t['median_ms']:.2f}x float)")
    print(f"greedy tokens equal to the float head's: {result['greedy_equal_to_float']} of {result['positions']}")
    print(f"head-int4 outcomes: {result['head_int4_outcomes']}, certified {result['head_int4_certified_share']:.4f}")
    if result["greedy_equal_to_float"]["head-int4"] != result["positions"]:
        print("head-int4 differs from the float head: the certificate is wrong", file=sys.stderr)
        return 1
    if not args.smoke or "--out" in (argv if argv is not None else sys.argv):
        write_json(args.out, result, end="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
