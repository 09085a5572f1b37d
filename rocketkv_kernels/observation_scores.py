"""Stage-1 observation-window scoring and max-pooling (docs/algorithm.md §2 steps 2–4; SnapKV §3, RocketKV §3.2).

score[k] = Σ_{g, w} softmax_k(q_{g,w}·K·scaling, causal)[k] for the G·W window queries of one KV
head, in float32. Two passes over the keys, never holding `[H, W, S]` in global memory:
kernel 1 (grid: KV heads × row blocks × key splits) keeps an online max and exp-sum per query
row and writes one pair per split; the host merges them into a log-sum-exp per row
(`[B, Hkv, G·W]`); kernel 2 (grid: KV heads × key blocks) recomputes each logit block, turns it
into probabilities with that log-sum-exp and sums the rows, writing `[B, Hkv, S]` scores. The
pooling kernel runs right after: stride-1 max over `kernel_size` neighbours, same length.
References: `rocketkv_cli.core.stage1.observation_scores` and `pool_scores`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (
    block_dim,
    check_device,
    check_dtype,
    check_head_dim,
    check_last_dim_contiguous,
    n_programs_target,
)


@triton.jit
def _window_queries(q, o_m, m_m, i_b, i_h, stride_qb, stride_qh, stride_qw,
                    W: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Window query rows o_m (row = g·W + w of KV head i_h) as float32 `[BLOCK_M, BLOCK_D]`."""
    o_d = tl.arange(0, BLOCK_D)
    p_q = q + i_b * stride_qb + (i_h * G + o_m // W)[:, None] * stride_qh + (o_m % W)[:, None] * stride_qw
    return tl.load(p_q + o_d[None, :], mask=m_m[:, None] & (o_d < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _window_logits(b_q, k, qpos, kpos, o_m, o_n, m_m, m_n, i_b, i_h, stride_kb, stride_kh, stride_ks, scaling,
                   softcap, W: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   SOFTCAP: tl.constexpr):  # fmt: skip
    """Logits `[BLOCK_M, BLOCK_N]` of window rows o_m (queries b_q) against keys o_n, causally masked."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_k = k + i_b * stride_kb + i_h * stride_kh + o_n[:, None] * stride_ks + o_d[None, :]
    b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scaling  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        b_s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * b_s / softcap) + 1.0))
    b_qpos = tl.load(qpos + o_m % W, mask=m_m, other=0)
    b_kpos = tl.load(kpos + o_n, mask=m_n, other=0)
    visible = (b_kpos[None, :] <= b_qpos[:, None]) & m_n[None, :]
    return tl.where(visible, b_s, float("-inf"))


@triton.jit
def _window_stats_kernel(
    q, k, qpos, kpos, part_m, part_l,
    stride_qb, stride_qh, stride_qw, stride_kb, stride_kh, stride_ks,
    HKV, S, SPLIT_LEN, NUM_SPLITS, ROWS_PAD, scaling, softcap,
    W: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    i_bh, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // HKV).to(tl.int64), i_bh % HKV  # int64: batch offsets can pass 2^31 elements
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < G * W
    b_q = _window_queries(q, o_m, m_m, i_b, i_h, stride_qb, stride_qh, stride_qw, W, G, D, BLOCK_D)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    start = i_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, S)
    for i_n in range(start, end, BLOCK_N):
        o_n = i_n + tl.arange(0, BLOCK_N)
        b_s = _window_logits(b_q, k, qpos, kpos, o_m, o_n, m_m, o_n < end, i_b, i_h, stride_kb, stride_kh,
                             stride_ks, scaling, softcap, W, D, BLOCK_D, SOFTCAP)  # fmt: skip
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_l = b_l * tl.exp(b_m - b_m_safe) + tl.sum(tl.exp(b_s - b_m_safe[:, None]), 1)
        b_m = b_m_new
    p_out = (i_bh * NUM_SPLITS + i_s) * ROWS_PAD + o_m
    tl.store(part_m + p_out, b_m)
    tl.store(part_l + p_out, b_l)


@triton.jit
def _window_scores_kernel(
    q, k, qpos, kpos, lse, scores,
    stride_qb, stride_qh, stride_qw, stride_kb, stride_kh, stride_ks, HKV, S, ROWS_PAD, scaling, softcap,
    W: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    i_bh, i_n = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // HKV).to(tl.int64), i_bh % HKV
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < S
    b_acc = tl.zeros([BLOCK_N], tl.float32)
    for i_m in range(0, G * W, BLOCK_M):
        o_m = i_m + tl.arange(0, BLOCK_M)
        m_m = o_m < G * W
        b_q = _window_queries(q, o_m, m_m, i_b, i_h, stride_qb, stride_qh, stride_qw, W, G, D, BLOCK_D)
        b_s = _window_logits(b_q, k, qpos, kpos, o_m, o_n, m_m, m_n, i_b, i_h, stride_kb, stride_kh, stride_ks,
                             scaling, softcap, W, D, BLOCK_D, SOFTCAP)  # fmt: skip
        b_lse = tl.load(lse + i_bh * ROWS_PAD + o_m, mask=m_m, other=0.0)
        b_p = tl.exp(b_s - b_lse[:, None])
        b_acc += tl.sum(tl.where(m_m[:, None], b_p, 0.0), 0)
    tl.store(scores + i_bh * S + o_n, b_acc, mask=m_n)


@triton.jit
def _max_pool_kernel(x, y, S, KERNEL: tl.constexpr, BLOCK: tl.constexpr):
    i_bh, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    b_y = tl.full([BLOCK], float("-inf"), tl.float32)
    for j in range(0, KERNEL):
        o_t = o_n + j - KERNEL // 2
        b_y = tl.maximum(b_y, tl.load(x + i_bh * S + o_t, mask=(o_t >= 0) & (o_t < S), other=float("-inf")))
    tl.store(y + i_bh * S + o_n, b_y, mask=o_n < S)


def observation_scores_triton(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    key_chunk_tokens: int = 8192,
) -> torch.Tensor:
    """Attention mass each key receives from the observation-window queries, per KV head (Triton).

    Same contract as `rocketkv_cli.core.stage1.observation_scores` (docs/algorithm.md §2 steps 2–3): softmax of
    q·Kᵀ·scaling (optionally soft-capped) with the causal mask from positions, in float32, summed
    over the W window queries and the G query heads of each KV head.

    Args:
        window_queries: `[B, H, W, D]` (last dim contiguous). keys: `[B, Hkv, S, D]` (last dim
            contiguous). query_positions: `[W]` int64; key_positions: `[S]` int64.
        scaling, softcap: the layer's. key_chunk_tokens: accepted for signature parity; the kernel
            splits the keys by the device's size instead.
    Returns:
        `[B, Hkv, S]` float32 scores.
    Raises:
        ValueError: non-CUDA tensors outside the interpreter, mismatched shapes, an unsupported
            dtype or head dim.
    """
    op = "observation_scores_triton"
    b, h, w, d = window_queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    if keys.shape != (b, hkv, s, d) or h % hkv or s == 0 or w == 0:
        raise ValueError(
            f"{op}: expected window_queries [B, H, W>0, D] and keys [B, Hkv, S>0, D], got "
            f"{tuple(window_queries.shape)}, {tuple(keys.shape)}"
        )
    if query_positions.shape != (w,) or key_positions.shape != (s,):
        raise ValueError(
            f"{op}: expected query_positions [{w}] and key_positions [{s}], got "
            f"{tuple(query_positions.shape)}, {tuple(key_positions.shape)}"
        )
    check_device(op, window_queries, keys, query_positions, key_positions)
    check_head_dim(op, "keys", d)
    for name, x in (("window_queries", window_queries), ("keys", keys)):
        check_dtype(op, name, x)
        check_last_dim_contiguous(op, name, x)
    g = h // hkv
    rows = g * w
    block_m, block_n, block_d = (16 if d > 128 else 32), 32, block_dim(d)
    n_row_blocks = triton.cdiv(rows, block_m)
    rows_pad = n_row_blocks * block_m
    n_splits = max(1, min(triton.cdiv(s, block_n), triton.cdiv(n_programs_target(keys.device), b * hkv * n_row_blocks)))
    split_len = triton.cdiv(triton.cdiv(s, n_splits), block_n) * block_n
    n_splits = triton.cdiv(s, split_len)
    qpos, kpos = query_positions.contiguous(), key_positions.contiguous()
    q = window_queries
    strides = (q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2))
    f32 = dict(device=keys.device, dtype=torch.float32)
    part_m = torch.empty(b * hkv, n_splits, rows_pad, **f32)
    part_l = torch.empty(b * hkv, n_splits, rows_pad, **f32)
    meta = dict(W=w, G=g, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SOFTCAP=softcap is not None)
    _window_stats_kernel[(b * hkv, n_row_blocks, n_splits)](
        q, keys, qpos, kpos, part_m, part_l, *strides,
        hkv, s, split_len, n_splits, rows_pad, float(scaling), float(softcap or 1.0), **meta,
    )  # fmt: skip
    top = part_m.amax(dim=1, keepdim=True)  # [B*Hkv, 1, rows_pad]: merge the splits' (max, sum) pairs
    top_safe = top.masked_fill(torch.isinf(top), 0.0)
    lse = (top_safe + torch.log((part_l * torch.exp(part_m - top_safe)).sum(1, keepdim=True))).squeeze(1)
    scores = torch.empty(b, hkv, s, **f32)
    _window_scores_kernel[(b * hkv, triton.cdiv(s, block_n))](
        q, keys, qpos, kpos, lse.contiguous(), scores, *strides, hkv, s, rows_pad,
        float(scaling), float(softcap or 1.0), **meta,
    )  # fmt: skip
    return scores


def pool_scores_triton(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Max-pool scores along the sequence, stride 1, same length (Triton; SnapKV clustering).

    Same contract as `rocketkv_cli.core.stage1.pool_scores` (docs/algorithm.md §2 step 4).

    Args:
        scores: `[B, Hkv, S]` float32. kernel_size: odd, in tokens (1 = no pooling).
    Returns:
        `[B, Hkv, S]` float32.
    Raises:
        ValueError: an even kernel size, a non-float32 or non-3-D input, non-CUDA tensors outside
            the interpreter.
    """
    op = "pool_scores_triton"
    if kernel_size % 2 != 1 or kernel_size < 1:
        raise ValueError(f"{op}: kernel_size must be odd and ≥ 1, got {kernel_size}")
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"{op}: expected float32 scores [B, Hkv, S], got {tuple(scores.shape)} {scores.dtype}")
    check_device(op, scores)
    if kernel_size == 1 or scores.shape[-1] == 0:
        return scores
    x = scores.contiguous()
    b, hkv, s = x.shape
    y = torch.empty_like(x)
    block = 256
    _max_pool_kernel[(b * hkv, triton.cdiv(s, block))](x, y, s, KERNEL=kernel_size, BLOCK=block)
    return y
