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
from pathlib import Path

import torch

from rocketkv_cli.eval.decode_linears import measure, step_weights
from rocketkv_cli.eval.reports import table, write_json


def model_of(preset: str | None) -> tuple[str, torch.nn.Module]:
    """(name, model): a tiny random Llama for the smoke run, else the preset's float model."""
    if preset is None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2)  # fmt: skip
        return "tiny random Llama (H=192)", AutoModelForCausalLM.from_config(cfg).float().eval()
    from rocketkv_cli.model.loading import load_model

    return preset, load_model(preset, device="cpu", weights="float").model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, a few rounds (CI)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name, model = model_of(None if args.smoke else args.preset)
    weights = step_weights(model)
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
