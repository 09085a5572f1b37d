"""Compile every Triton kernel ahead of time for an NVIDIA target, without a GPU (CPU only).

The interpreter (`TRITON_INTERPRET=1`, used by the tests) checks numerics but not what only the
GPU compiler rejects (tl.dot shape rules, type mismatches, shared-memory limits). This script
builds each kernel, for representative shapes and dtypes, down to a cubin for sm_90 (H100/H200)
with the ptxas shipped in the triton wheel. Uses Triton's `ASTSource`/`triton.compile` (3.x API).

    env -u TRITON_INTERPRET python benchmarks/compile_check.py [--arch 90] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: kernels defined under the interpreter cannot be compiled")

import triton  # noqa: E402
from rocketkv_cli.kernels import observation_scores as ob  # noqa: E402
from rocketkv_cli.kernels import page_scores as ps  # noqa: E402
from rocketkv_cli.kernels import page_summaries as pm  # noqa: E402
from rocketkv_cli.kernels import sparse_attention as sa  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def build(fn, types: dict, consts: dict, target: GPUTarget) -> None:
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=target,
                   options=dict(num_warps=4, num_stages=3))  # fmt: skip


def cases():
    for dt, ieee in (("bf16", False), ("fp16", False), ("fp32", True)):
        for g, d in ((4, 128), (7, 64), (4, 256), (1, 60), (3, 64)):
            bg, bd = pow2(g), pow2(d)
            attn = {"q": f"*{dt}", "k": f"*{dt}", "v": f"*{dt}", "idx": "*i64", "o_part": "*fp32", "m_part": "*fp32",
                    "l_part": "*fp32", "out": f"*{dt}", "scaling": "fp32", "softcap": "fp32"}  # fmt: skip
            for softcap in (False, True):
                consts = dict(G=g, D=d, BLOCK_G=bg, BLOCK_D=bd, BLOCK_N=64 if d <= 128 else 32, SOFTCAP=softcap,
                              IEEE=ieee, UPCAST=False)  # fmt: skip
                yield f"sparse split {dt} G{g} D{d} softcap={softcap}", sa._sparse_attention_split_kernel, attn, consts
            yield (
                f"sparse merge {dt} G{g} D{d}",
                sa._sparse_attention_merge_kernel,
                attn,
                dict(G=g, D=d, BLOCK_G=bg, BLOCK_D=bd),
            )
            pages = {"q": "*fp32", "pmin": f"*{dt}", "pmax": f"*{dt}", "counts": "*fp32", "dims": "*i32",
                     "logits": "*fp32", "blk_m": "*fp32", "blk_l": "*fp32", "out": "*fp32"}  # fmt: skip
            r = min(d, 60)
            yield (
                f"page logits {dt} G{g} D{d}",
                ps._page_logits_kernel,
                pages,
                dict(G=g, D=d, R=r, BLOCK_G=bg, BLOCK_D=bd, BLOCK_R=pow2(r), BLOCK_P=64),
            )
            yield f"page softmax G{g}", ps._page_softmax_mean_kernel, pages, dict(G=g, BLOCK_G=bg, BLOCK_P=64)
            yield f"page min/max {dt} D{d}", pm._page_minmax_kernel, {"k": f"*{dt}", "pmin": f"*{dt}",
                                                                      "pmax": f"*{dt}"}, dict(
                D=d, BLOCK_P=16, BLOCK_D=pow2(d, 1))  # fmt: skip
            window = {
                "q": "*fp32",
                "k": f"*{dt}",
                "qpos": "*i64",
                "kpos": "*i64",
                "part_m": "*fp32",
                "part_l": "*fp32",
                "lse": "*fp32",
                "scores": "*fp32",
                "scaling": "fp32",
                "softcap": "fp32",
            }
            consts = dict(W=32, G=g, D=d, BLOCK_M=16 if d > 128 else 32, BLOCK_N=32, BLOCK_D=bd, SOFTCAP=g == 7)
            yield f"window stats {dt} G{g} D{d}", ob._window_stats_kernel, window, consts
            yield f"window scores {dt} G{g} D{d}", ob._window_scores_kernel, window, consts
    yield "max pool 63", ob._max_pool_kernel, {"x": "*fp32", "y": "*fp32"}, dict(KERNEL=63, BLOCK=256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    p.add_argument("--smoke", action="store_true", help="one shape and dtype per kernel (CI)")
    args = p.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failed, seen = 0, set()
    t0 = time.perf_counter()
    for label, fn, types, consts in cases():
        if args.smoke and fn in seen:
            continue
        seen.add(fn)
        try:
            build(fn, types, consts, target)
        except Exception as exc:  # report every failing kernel, not only the first
            failed += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:2000]}")
    print(f"{'FAILED' if failed else 'OK'}: {failed} failures, sm_{target.arch}, {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
