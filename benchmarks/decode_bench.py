"""Decode latency of rocketkv (HSA over a stage-1-sized cache) vs full attention, plus kernel bandwidth.

Run by `benchmarks/gpu_check.sh` (see there). A random-init Llama-3.1-8B-sized model in bf16 is
built directly on the GPU (weights random: decode speed does not depend on their values), and the
long-context caches are filled with random keys/values directly in rocketkv's own `RocketLayer`s
(no 128K-token prefill). Per context n and token budget t:

- full attention: every layer holds n tokens; a decode step is SDPA over all of them;
- rocketkv: every layer holds the stage-1 `prompt_budget` tokens of `derive_budgets(n, 128, t, 128)`
  (docs/algorithm.md §1) and decodes with HSA (`ops.hsa_decode`: Triton page scoring + sparse attention).

Printed: median ms per decode step of the whole model, its speedup, the ideal speedup
(weights + full KV bytes) / (weights + bytes HSA reads) of docs/performance.md, the attention-only time per layer
(HSA step vs SDPA over n), and the achieved memory bandwidth of `sparse_attention_triton` as a
fraction of the device's peak. `--smoke` runs the same code on a tiny model on CPU (kernels under
`TRITON_INTERPRET=1`) to prove the script works where no GPU is.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

from rocketkv_cli.eval.reports import write_json

# peak HBM bandwidth, bytes/s, by device-name fragment (datasheets); --peak-gbps overrides
PEAK_BW = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
           "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12,
           "L4": 0.3e12, "A10": 0.6e12, "RTX 4090": 1.008e12}  # fmt: skip
MAX_NEW = 128


def floor_ms(n_bytes: int, peak: float | None) -> float | None:
    """The bandwidth floor of a step that reads `n_bytes` (weights + the KV it attends), in ms:
    bytes ÷ the device's peak bandwidth (bytes/s); None when the peak is unknown."""
    return None if not peak else 1e3 * n_bytes / peak


def floor_note(ms: float | None) -> str:
    return "" if ms is None else f" (floor {ms:.2f} ms: bytes read / peak bandwidth)"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU under the Triton interpreter")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per setting")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth in GB/s (default: table)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.smoke:
        args.contexts, args.budgets, args.steps, args.warmup = [300, 700], [32, 64], 2, 1
    return args


def llama_config(smoke: bool):
    from transformers import LlamaConfig

    if smoke:  # same structure at toy size: GQA group 4, head_dim 128
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=128, vocab_size=1000,
                           max_position_embeddings=4096)  # fmt: skip
    # Llama-3.1-8B: 32 layers, 32 heads / 8 KV heads, head_dim 128, vocab 128,256, RoPE llama3, 128K context
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})  # fmt: skip


def build_model(smoke: bool, device, dtype):
    """Random-init model created directly on `device` in `dtype` (no fp32 copy, no host round trip)."""
    import torch
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(llama_config(smoke), attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def random_cache(shape, n_tokens: int, n_positions: int, room: int, device, dtype, seed: int):
    """A `RocketCache` of random keys/values, `n_tokens` per layer at sorted positions < n_positions."""
    import torch

    from rocketkv_cli.model.hf import RocketCache, RocketLayer

    g = torch.Generator(device=device).manual_seed(seed)
    pos = torch.linspace(0, n_positions - 1, n_tokens, device=device).long()  # kept tokens keep their positions
    pos = pos.view(1, 1, -1).expand(1, shape.n_kv_heads, -1).contiguous()
    layers = []
    for _ in shape.layers:
        kv = torch.randn(2, 1, shape.n_kv_heads, n_tokens, shape.head_dim, device=device, dtype=dtype, generator=g)
        layers.append(RocketLayer(kv[0], kv[1], pos, room))
        del kv
    return RocketCache(layers)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_s(model, shape, cache, decode, n_positions: int, steps: int, warmup: int, device) -> float:
    """Median seconds per single-token decode step over `cache` (the tail is cropped afterwards)."""
    import torch

    from rocketkv_cli.model.hf import forward_tokens, rocketkv_attention

    ids = torch.tensor([[7]], device=device)
    times = []
    with rocketkv_attention(model, cache, shape, decode=decode):
        for i in range(warmup + steps):
            sync(device)
            t0 = time.perf_counter()
            forward_tokens(model, cache, ids, torch.tensor([n_positions + i], device=device))
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    cache.crop_to_context()
    return statistics.median(times)


def bench_fn(fn, device, reps: int) -> float:
    """Median seconds of `fn()`: `triton.testing.do_bench` on CUDA, a plain loop elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_only(shape, n: int, kept: int, budgets, device, dtype, reps: int) -> dict:
    """One layer: HSA step over `kept` tokens vs SDPA over `n` tokens (same heads, random data)."""
    import torch
    import torch.nn.functional as F

    from rocketkv_cli import ops

    hkv, h, d = shape.n_kv_heads, shape.n_heads, shape.head_dim
    q = torch.randn(1, h, 1, d, device=device, dtype=dtype)
    k_full, v_full = (torch.randn(1, hkv, n, d, device=device, dtype=dtype) for _ in range(2))
    k, v = k_full[:, :, :kept], v_full[:, :, :kept]
    pmin, pmax = ops.page_summaries(k.contiguous(), budgets.page_size)
    scaling = d**-0.5
    hsa = lambda: ops.hsa_decode(q, k, v, pmin, pmax, budgets.topk, budgets.page_size, budgets.n_score_dims, scaling)
    sdpa = lambda: F.scaled_dot_product_attention(q, k_full, v_full, scale=scaling, enable_gqa=True)
    return {"hsa_ms": 1e3 * bench_fn(hsa, device, reps), "sdpa_ms": 1e3 * bench_fn(sdpa, device, reps)}


def sparse_kernel_bandwidth(shape, device, dtype, peak: float | None, smoke: bool) -> list[dict]:
    """Achieved bytes/s of `sparse_attention_triton` reading N_sel gathered K/V rows per KV head."""
    import torch
    from rocketkv_cli.kernels.sparse_attention import sparse_attention_triton

    hkv, h, d = shape.n_kv_heads, shape.n_heads, shape.head_dim
    s = 2048 if smoke else 131072
    k, v = (torch.randn(1, hkv, s, d, device=device, dtype=dtype) for _ in range(2))
    q = torch.randn(1, h, 1, d, device=device, dtype=dtype)
    rows = []
    for n_sel in [64, 256] if smoke else [128, 512, 4096, 16384, 65536]:
        idx = torch.randperm(s, device=device)[:n_sel].sort().values  # [N_sel], one selection for all heads
        idx = idx.view(1, 1, n_sel).expand(1, hkv, n_sel).contiguous()  # [1, Hkv, N_sel]
        t = bench_fn(lambda: sparse_attention_triton(q, k, v, idx, d**-0.5), device, 2)
        elem = k.element_size()
        n_bytes = hkv * n_sel * (2 * d * elem + 8) + 2 * h * d * elem  # K+V rows, indices, query and output
        rows.append({"n_sel": n_sel, "us": 1e6 * t, "gbps": n_bytes / t / 1e9,
                     "fraction_of_peak": (n_bytes / t / peak) if peak else None})  # fmt: skip
    return rows


def device_peak(device, override_gbps: float | None) -> tuple[float | None, str]:
    import torch

    if override_gbps:
        return override_gbps * 1e9, "--peak-gbps"
    if device.type != "cuda":
        return None, "cpu (no peak)"
    name = torch.cuda.get_device_name(device)
    for key, bw in PEAK_BW.items():
        if key in name:
            return bw, f"{name} datasheet"
    return None, f"{name} (unknown: pass --peak-gbps)"


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        os.environ.setdefault("ROCKETKV_KERNELS", "triton")  # exercise the kernels on CPU tensors
    import torch

    from rocketkv_cli.core.config import DecodeConfig, derive_budgets
    from rocketkv_cli.model.hf import model_shape

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
        return 1
    dtype = torch.float32 if args.smoke else torch.bfloat16
    peak, peak_src = device_peak(device, args.peak_gbps)
    t0 = time.perf_counter()
    model = build_model(args.smoke, device, dtype)
    shape = model_shape(model)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = n_params * dtype.itemsize
    build_s = time.perf_counter() - t0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"model: {n_params / 1e9:.2f}B params, {weight_bytes / 2**30:.1f} GiB, built in {build_s:.1f} s; "
        f"device {name}; peak {peak_src}"
    )
    elem = dtype.itemsize
    n_full = len(shape.full_layers)
    results = {"device": peak_src, "params": n_params, "contexts": [], "sparse_kernel": []}
    room = args.warmup + args.steps + 8
    for n in args.contexts:
        full = random_cache(shape, n, n, room, device, dtype, seed=n)
        full_s = decode_step_s(model, shape, full, None, n, args.steps, args.warmup, device)
        del full
        full_kv = 2 * n_full * shape.n_kv_heads * n * shape.head_dim * elem
        full_floor = floor_ms(weight_bytes + full_kv, peak)
        print(f"\ncontext {n}: full attention (SDPA) {1e3 * full_s:.2f} ms/token{floor_note(full_floor)}")
        row = {"context_tokens": n, "full_ms": 1e3 * full_s, "full_floor_ms": full_floor, "budgets": []}
        for t in args.budgets:
            b = derive_budgets(n, MAX_NEW, t, shape.head_dim)
            dec = DecodeConfig(topk=b.topk, page_size=b.page_size, n_score_dims=b.n_score_dims)
            cache = random_cache(shape, b.prompt_budget, n, room, device, dtype, seed=n + t)
            hsa_s = decode_step_s(model, shape, cache, dec, n, args.steps, args.warmup, device)
            del cache
            pages = math.ceil(b.prompt_budget / b.page_size)
            hsa_kv = n_full * shape.n_kv_heads * (pages * b.n_score_dims + 2 * b.topk * shape.head_dim) * elem
            ideal = (weight_bytes + full_kv) / (weight_bytes + hsa_kv)
            attn = attention_only(shape, n, b.prompt_budget, b, device, dtype, reps=3)
            entry = {"token_budget": t, "prompt_budget": b.prompt_budget, "topk": b.topk, "page_size": b.page_size,
                     "n_score_dims": b.n_score_dims, "rocketkv_ms": 1e3 * hsa_s, "speedup": full_s / hsa_s,
                     "ideal_speedup": ideal, "fraction_of_ideal": (full_s / hsa_s) / ideal,
                     "rocketkv_floor_ms": floor_ms(weight_bytes + hsa_kv, peak),
                     "attn_layer_hsa_ms": attn["hsa_ms"], "attn_layer_sdpa_ms": attn["sdpa_ms"],
                     "attn_speedup": attn["sdpa_ms"] / attn["hsa_ms"]}  # fmt: skip
            row["budgets"].append(entry)
            print(f"  budget {t:5d} (keep {b.prompt_budget}, topk {b.topk}, page {b.page_size}, "
                  f"dims {b.n_score_dims}): "
                  f"{1e3 * hsa_s:.2f} ms/token{floor_note(entry['rocketkv_floor_ms'])}, "
                  f"speedup {entry['speedup']:.2f}x (ideal {ideal:.2f}x, "
                  f"{100 * entry['fraction_of_ideal']:.0f}% of it); one layer's attention: HSA {attn['hsa_ms']:.3f} ms "
                  f"vs SDPA {attn['sdpa_ms']:.3f} ms = {entry['attn_speedup']:.1f}x")  # fmt: skip
        results["contexts"].append(row)
    print("\nsparse_attention_triton bandwidth (one layer, all KV heads; bytes = gathered K+V rows + indices):")
    for r in sparse_kernel_bandwidth(shape, device, dtype, peak, args.smoke):
        frac = f"{100 * r['fraction_of_peak']:.0f}% of peak" if r["fraction_of_peak"] else "peak unknown"
        print(f"  N_sel {r['n_sel']:6d}: {r['us']:9.1f} us, {r['gbps']:8.1f} GB/s, {frac}")
        results["sparse_kernel"].append(r)
    if args.json:
        write_json(args.json, results, indent=2, end="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
