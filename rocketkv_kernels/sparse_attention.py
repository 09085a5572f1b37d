"""Sparse decode attention over selected tokens (docs/algorithm.md §3 step 5; RocketKV §3.5 exact attention).

Flash-decoding over a gathered selection: each program owns one KV head (all G query heads of its
GQA group share every key/value row it reads) and one split of the selection; it gathers key and
value rows by index, runs an online softmax, and writes a partial output with its running max and
sum. A second kernel merges the splits. Reference: `rocketkv_cli.core.stage2.sparse_attention`.
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
def _sparse_attention_split_kernel(
    q, k, v, idx, o_part, m_part, l_part,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_ib, stride_ih,
    S, N_SEL, HKV, SPLIT_LEN, NUM_SPLITS, scaling, softcap,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // HKV).to(tl.int64), i_bh % HKV  # int64: batch offsets can pass 2^31 elements
    o_g, o_d, o_n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    m_g, m_d = o_g < G, o_d < D
    p_q = q + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    b_q = b_q.to(tl.float32) if UPCAST else b_q.to(k.dtype.element_ty)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = i_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, N_SEL)
    p_k0 = k + i_b * stride_kb + i_h * stride_kh
    p_v0 = v + i_b * stride_vb + i_h * stride_vh
    for i_n in range(start, end, BLOCK_N):
        o_i = i_n + o_n
        m_i = o_i < end
        b_idx = tl.load(idx + i_b * stride_ib + i_h * stride_ih + o_i, mask=m_i, other=0)
        m_valid = m_i & (b_idx < S)  # indices past the cache (partial last page) are ignored
        b_idx = tl.where(m_valid, b_idx, 0)
        m_kv = m_valid[:, None] & m_d[None, :]
        b_k = tl.load(p_k0 + b_idx[:, None] * stride_ks + o_d[None, :], mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:  # Triton 3.9's interpreter multiplies bf16 blocks wrongly: float32 there
            b_k = b_k.to(tl.float32)
        if IEEE:
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = b_s * scaling  # [BLOCK_G, BLOCK_N] float32
        if SOFTCAP:  # softcap · tanh(s / softcap), tanh written with exp (portable to the interpreter)
            b_s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * b_s / softcap) + 1.0))
        b_s = tl.where(m_valid[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_m_safe)
        b_p = tl.exp(b_s - b_m_safe[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_v0 + b_idx[:, None] * stride_vs + o_d[None, :], mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
        b_p = b_p.to(b_v.dtype)  # probabilities in the values' dtype, as the reference
        if UPCAST:
            b_p, b_v = b_p.to(tl.float32), b_v.to(tl.float32)
        if IEEE:
            b_pv = tl.dot(b_p, b_v, input_precision="ieee")
        else:
            b_pv = tl.dot(b_p, b_v)
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new
    i_part = i_bh * NUM_SPLITS + i_s
    tl.store(o_part + (i_part * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :], b_acc)
    tl.store(m_part + i_part * BLOCK_G + o_g, b_m)
    tl.store(l_part + i_part * BLOCK_G + o_g, b_l)


@triton.jit
def _sparse_attention_merge_kernel(
    o_part, m_part, l_part, out, stride_ob, stride_oh, HKV, NUM_SPLITS,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i_bh = tl.program_id(0)
    i_b, i_h = (i_bh // HKV).to(tl.int64), i_bh % HKV
    o_g, o_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i_s in range(0, NUM_SPLITS):
        b_m = tl.maximum(b_m, tl.load(m_part + (i_bh * NUM_SPLITS + i_s) * BLOCK_G + o_g))
    b_m_safe = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i_s in range(0, NUM_SPLITS):
        i_part = i_bh * NUM_SPLITS + i_s
        b_w = tl.exp(tl.load(m_part + i_part * BLOCK_G + o_g) - b_m_safe)  # [BLOCK_G]
        b_l += b_w * tl.load(l_part + i_part * BLOCK_G + o_g)
        b_acc += b_w[:, None] * tl.load(o_part + (i_part * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :])
    b_o = b_acc / b_l[:, None]
    p_o = out + i_b * stride_ob + (i_h * G + o_g)[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=(o_g < G)[:, None] & (o_d < D)[None, :])


def sparse_attention_triton(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    block_n: int | None = None,
    n_splits: int | None = None,
) -> torch.Tensor:
    """Exact softmax attention of each query head over its KV head's selected tokens (Triton).

    Same contract as `rocketkv_cli.core.stage2.sparse_attention` (docs/algorithm.md §3 step 5): softmax over the
    selected keys of q·k·scaling (optionally soft-capped), in float32, times the selected values.

    Args:
        query: `[B, H, 1, D]`. keys/values: `[B, Hkv, S, D]`; only the last dim must be contiguous
            (a view of a larger cache buffer is read in place). indices: `[B, Hkv, N_sel]` int64
            (entries ≥ S are ignored). scaling, softcap: the layer's attention scaling / soft-cap.
        block_n: selected tokens per inner step (None: 64 on CUDA, 32 in the interpreter).
        n_splits: splits of the selection (None = enough programs to fill the device), merged by a
            second kernel.
    Returns:
        `[B, H, 1, D]` in the query dtype.
    Raises:
        ValueError: non-CUDA tensors outside the interpreter, unsupported dtype or head dim,
            mismatched shapes, or a last dim that is not contiguous.
    """
    op = "sparse_attention_triton"
    b, h, t, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    n_sel = indices.shape[-1]
    if t != 1 or h % hkv or keys.shape != (b, hkv, s, d) or values.shape != (b, hkv, s, d):
        raise ValueError(
            f"{op}: expected query [B, H, 1, D] and keys/values [B, Hkv, S, D] with the same D, got "
            f"{tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    if indices.shape != (b, hkv, n_sel) or indices.dtype != torch.int64 or n_sel == 0:
        raise ValueError(f"{op}: expected int64 indices [B, Hkv, N_sel>0], got {tuple(indices.shape)} {indices.dtype}")
    check_device(op, query, keys, values, indices)
    check_head_dim(op, "query", d)
    for name, x in (("query", query), ("keys", keys), ("values", values)):
        check_dtype(op, name, x)
        check_last_dim_contiguous(op, name, x)
    g = h // hkv
    if g > 64:
        raise ValueError(f"{op}: GQA group {g} (query {tuple(query.shape)}, keys {tuple(keys.shape)}) exceeds 64")
    indices = indices.contiguous()
    block_g, block_d = block_dim(g), block_dim(d)
    block_n = block_n or (64 if query.is_cuda and d <= 128 else 32)
    if n_splits is None:
        n_splits = max(1, min(triton.cdiv(n_sel, block_n), triton.cdiv(n_programs_target(keys.device), b * hkv)))
    split_len = triton.cdiv(triton.cdiv(n_sel, n_splits), block_n) * block_n
    n_splits = triton.cdiv(n_sel, split_len)
    f32 = dict(device=query.device, dtype=torch.float32)
    o_part = torch.empty(b * hkv * n_splits, block_g, block_d, **f32)
    m_part = torch.empty(b * hkv * n_splits, block_g, **f32)
    l_part = torch.empty(b * hkv * n_splits, block_g, **f32)
    out = torch.empty(b, h, 1, d, device=query.device, dtype=query.dtype)
    _sparse_attention_split_kernel[(b * hkv, n_splits)](
        query, keys, values, indices, o_part, m_part, l_part,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), indices.stride(0), indices.stride(1),
        s, n_sel, hkv, split_len, n_splits, float(scaling), float(softcap or 1.0),
        G=g, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        SOFTCAP=softcap is not None, IEEE=query.dtype == torch.float32 or not query.is_cuda, UPCAST=not query.is_cuda,
    )  # fmt: skip
    _sparse_attention_merge_kernel[(b * hkv,)](
        o_part, m_part, l_part, out, out.stride(0), out.stride(1), hkv, n_splits,
        G=g, D=d, BLOCK_G=block_g, BLOCK_D=block_d,
    )  # fmt: skip
    return out
