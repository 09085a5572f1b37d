"""A decode step's bfloat16 linears on a CPU, two kernels side by side in one process: `F.linear`
(a matrix product of one row, the reference) and `bf16_matvec` (torch's matrix-vector kernel, what
`Bf16Linear` runs for one row), and whether their outputs are equal.

    python benchmarks/decode_linears.py                  # smollm2-135m (bf16 weights), 1 thread
    python benchmarks/decode_linears.py --smoke          # a tiny random Llama, seconds (CI)

The linears are those one decode step reads, as `DecodeStep` joins them: per layer q/k/v as one,
o, gate/up as one, down; then the LM head's bfloat16 ranking copy. A random bfloat16 row per
linear (norm-sized); each round multiplies every linear once with one kernel, then with the other
(round-robin, so a machine whose load changes slows both alike); median and p90 over the rounds,
and weight bytes / median time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rocketkv_cli.eval.reports import table, write_json
from rocketkv_cli.model.linears import Bf16Linear, bf16_matvec


def step_weights(preset: str | None) -> tuple[str, list[torch.Tensor]]:
    """(model name, the bfloat16 weights `[out, in]` one decode step multiplies, in order)."""
    if preset is None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2)  # fmt: skip
        model, name = AutoModelForCausalLM.from_config(cfg).float().eval(), "tiny random Llama (H=192)"
    else:
        from rocketkv_cli.model.loading import load_model

        model, name = load_model(preset, device="cpu", weights="float").model, preset
    weights = []
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for parts in ([at.q_proj, at.k_proj, at.v_proj], [at.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]):
            linears = [Bf16Linear(p) for p in parts]
            weights.append((Bf16Linear.join(linears) if len(linears) > 1 else linears[0]).weight_bf16)
    weights.append(Bf16Linear(model.lm_head).weight_bf16)
    return name, weights


def measure(weights: list[torch.Tensor], rounds: int) -> dict:
    """Both kernels over every weight `[out, in]` (one random bfloat16 row `[in]` each), taking
    turns for `rounds` rounds after two of warm-up: per kernel the median and p90 ms of a round
    and GB/s (weight bytes / median), and how many of the outputs are equal."""
    kernels = {"F.linear (reference)": lambda w, x: F.linear(x[None], w)[0], "bf16_matvec": bf16_matvec}
    xs = [torch.randn(w.shape[1]).bfloat16() for w in weights]
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for n in range(rounds + 2):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            for w, x in zip(weights, xs, strict=True):
                kernel(w, x)
            if n >= 2:  # two rounds of warm-up
                times[name].append((time.perf_counter() - start) * 1e3)
    outs = [[kernel(w, x) for w, x in zip(weights, xs, strict=True)] for kernel in kernels.values()]
    equal = sum(int((a == b).sum()) for a, b in zip(*outs, strict=True))
    bytes_ = sum(w.numel() * 2 for w in weights)
    ms = {k: {"median_ms": statistics.median(t), "p90_ms": sorted(t)[int(0.9 * (len(t) - 1))],
              "gb_per_s": bytes_ / statistics.median(t) / 1e6} for k, t in times.items()}  # fmt: skip
    return {"ms_per_step": ms, "weight_bytes": bytes_, "outputs": sum(len(o) for o in outs[0]),
            "outputs_equal": equal}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, a few rounds (CI)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name, weights = step_weights(None if args.smoke else args.preset)
    with torch.inference_mode():
        result = measure(weights, 3 if args.smoke else args.rounds)
    result.update(model=name, threads=args.threads, torch=torch.__version__)
    ms = result["ms_per_step"]
    base = ms["F.linear (reference)"]["median_ms"]
    rows = [(k, f"{v['median_ms']:.2f} ({v['p90_ms']:.2f})", f"{v['gb_per_s']:.1f}", f"{base / v['median_ms']:.2f}×")
            for k, v in ms.items()]  # fmt: skip
    print(f"{name}: {len(weights)} linears, {result['weight_bytes'] / 1e6:.0f} MB of bfloat16 weights, "
          f"{args.threads} thread(s)")  # fmt: skip
    print("\n".join(table(["kernel", "ms per step (p90)", "GB/s", "vs F.linear"], rows, align="-rrr")))
    print(f"outputs equal: {result['outputs_equal']} of {result['outputs']}")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
