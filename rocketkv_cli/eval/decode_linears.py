"""A decode step's bfloat16 linears timed with two kernels side by side: `F.linear` (the reference)
and `model.linears.bf16_matvec` (what `Bf16Linear` runs for one row on a CPU), for
`benchmarks/decode_linears.py`."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from ..model.linears import Bf16Linear, bf16_matvec


def step_weights(model: Any) -> list[torch.Tensor]:
    """The bfloat16 weights `[out, in]` one decode step of a Llama-layout `model` multiplies, in
    order, joined as `DecodeStep` joins them: per layer q/k/v, o, gate/up, down; then the LM head."""
    weights: list[torch.Tensor] = []
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for parts in ([at.q_proj, at.k_proj, at.v_proj], [at.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]):
            linears: list[torch.nn.Module] = [Bf16Linear(p) for p in parts]
            one = Bf16Linear.join(linears) if len(linears) > 1 else linears[0]
            assert isinstance(one, Bf16Linear)  # join returns one of its class for parts of that class
            weights.append(one.weight_bf16)
    weights.append(Bf16Linear(model.lm_head).weight_bf16)
    return weights


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
