"""Page min/max summaries of the keys: the build at ingest and the update on append (docs/algorithm.md §3).

One program per KV head and block of pages walks the `page_size` tokens of its pages and keeps an
element-wise min and max (exact: the result equals the torch reference bit for bit). The update
recomputes only the pages touched by tokens from `start` on, in place in a page buffer.
Reference: `rocketkv_cli.core.stage2.page_summaries` and `update_page_summaries`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import block_dim, check_device, check_dtype, check_head_dim, check_last_dim_contiguous


@triton.jit
def _page_minmax_kernel(
    k, pmin, pmax, stride_kb, stride_kh, stride_ks, stride_pb, stride_ph, stride_pp,
    HKV, S, FIRST_PAGE, N_PAGES, PAGE_SIZE,
    D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i_bh, i_p = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // HKV).to(tl.int64), i_bh % HKV  # int64: batch offsets can pass 2^31 elements
    o_p = FIRST_PAGE + i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_d = tl.arange(0, BLOCK_D)
    m_p, m_d = o_p < FIRST_PAGE + N_PAGES, o_d < D
    p_k = k + i_b * stride_kb + i_h * stride_kh + o_d[None, :]
    b_min = tl.full([BLOCK_P, BLOCK_D], float("inf"), tl.float32)
    b_max = tl.full([BLOCK_P, BLOCK_D], float("-inf"), tl.float32)
    for j in range(0, PAGE_SIZE):
        o_t = o_p * PAGE_SIZE + j
        m_t = (m_p & (o_t < S))[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_t[:, None] * stride_ks, mask=m_t, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
        b_min = tl.where(m_t, tl.minimum(b_min, b_k), b_min)
        b_max = tl.where(m_t, tl.maximum(b_max, b_k), b_max)
    p_out = i_b * stride_pb + i_h * stride_ph + o_p[:, None] * stride_pp + o_d[None, :]
    m_out = m_p[:, None] & m_d[None, :]
    tl.store(pmin + p_out, b_min.to(pmin.dtype.element_ty), mask=m_out)
    tl.store(pmax + p_out, b_max.to(pmax.dtype.element_ty), mask=m_out)


def _check(op: str, keys: torch.Tensor, page_size: int) -> None:
    if keys.dim() != 4 or keys.shape[2] == 0:
        raise ValueError(f"{op}: expected keys [B, Hkv, S>0, D], got {tuple(keys.shape)}")
    if page_size < 1:
        raise ValueError(f"{op}: page_size must be ≥ 1, got {page_size}")
    check_device(op, keys)
    check_dtype(op, "keys", keys)
    check_head_dim(op, "keys", keys.shape[3])
    check_last_dim_contiguous(op, "keys", keys)


def _launch(keys, page_min, page_max, first_page: int, n_pages: int, page_size: int, block_p: int = 16) -> None:
    b, hkv, s, d = keys.shape
    grid = (b * hkv, triton.cdiv(n_pages, block_p))
    _page_minmax_kernel[grid](
        keys, page_min, page_max, keys.stride(0), keys.stride(1), keys.stride(2),
        page_min.stride(0), page_min.stride(1), page_min.stride(2), hkv, s, first_page, n_pages, page_size,
        D=d, BLOCK_P=block_p, BLOCK_D=block_dim(d, 1),
    )  # fmt: skip


def page_summaries_triton(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the keys of each page (Triton; the build at ingest).

    Same contract as `rocketkv_cli.core.stage2.page_summaries` (docs/algorithm.md §3, RocketKV §3.5).

    Args:
        keys: `[B, Hkv, S, D]`, last dim contiguous. page_size: tokens per page; the last page may
            be partial.
    Returns:
        (page_min, page_max), each `[B, Hkv, P, D]` with P = ceil(S / page_size), keys' dtype.
    Raises:
        ValueError: non-CUDA keys outside the interpreter, empty keys, page_size < 1, an unsupported
            dtype or head dim.
    """
    op = "page_summaries_triton"
    _check(op, keys, page_size)
    b, hkv, s, d = keys.shape
    n_pages = triton.cdiv(s, page_size)
    page_min = torch.empty(b, hkv, n_pages, d, device=keys.device, dtype=keys.dtype)
    page_max = torch.empty_like(page_min)
    _launch(keys, page_min, page_max, 0, n_pages, page_size)
    return page_min, page_max


def update_page_summaries_triton(
    page_min: torch.Tensor, page_max: torch.Tensor, keys: torch.Tensor, start: int, page_size: int
) -> None:
    """Recompute, in place, the pages touched by keys from token `start` on (Triton; the update on append).

    Same contract as `rocketkv_cli.core.stage2.update_page_summaries`.

    Args:
        page_min/page_max: `[B, Hkv, P_cap, D]` buffers with P_cap ≥ ceil(S / page_size), last dim
            contiguous. keys: `[B, Hkv, S, D]`, all keys so far. start: first new token (0 ≤ start ≤ S).
    Raises:
        ValueError: as `page_summaries_triton`, or buffers too small / start out of range.
    """
    op = "update_page_summaries_triton"
    _check(op, keys, page_size)
    b, hkv, s, d = keys.shape
    n_pages = triton.cdiv(s, page_size)
    if page_min.shape[:2] != (b, hkv) or page_min.shape[3] != d or page_min.shape[2] < n_pages:
        raise ValueError(
            f"{op}: page buffers {tuple(page_min.shape)} cannot hold the {n_pages} pages of keys {tuple(keys.shape)}"
        )
    if page_max.shape != page_min.shape or page_max.stride() != page_min.stride() or not 0 <= start <= s:
        raise ValueError(
            f"{op}: page_max {tuple(page_max.shape)} must match page_min {tuple(page_min.shape)}, "
            f"and start {start} must be in [0, {s}]"
        )
    check_device(op, page_min, page_max)
    check_last_dim_contiguous(op, "page_min", page_min)
    first = start // page_size
    if n_pages > first:
        _launch(keys, page_min, page_max, first, n_pages - first, page_size)
