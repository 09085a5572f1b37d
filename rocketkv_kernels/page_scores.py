"""Stage-2 approximate page scoring from page min/max on the chosen dims (docs/algorithm.md §3 steps 1–3).

RocketKV §3.5 (after SparQ and Quest): for the G query heads of one KV head, score each page by
Σ_i q_g[i]·bound[page, i] over the `n_score_dims` chosen dims i, where bound is the page max when
Σ_g q_g[i] > 0 and the page min otherwise (the sign trick), so only one of min/max and only the
chosen dims are read. Logits are divided by the SparQ temperature τ_g, weighted by the page token
count, soft-maxed over pages per head and averaged over the group.

Kernel 1 (grid: KV heads × page blocks) writes the logits of all G heads of a group and each
block's max and exp-sum; kernel 2 (same grid) merges the block statistics and writes the group
average. The chosen dims come from `torch.topk` on the host (D values per KV head, negligible).
Reference: `rocketkv_cli.core.stage2.page_scores`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import block_dim, check_device, check_dtype, check_head_dim, check_last_dim_contiguous


@triton.jit
def _page_logits_kernel(
    q, pmin, pmax, counts, dims, logits, blk_m, blk_l,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_pp, HKV, P, NUM_BLOCKS,
    G: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    i_bh, i_p = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // HKV).to(tl.int64), i_bh % HKV
    o_g, o_d, o_r = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_R)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_g, m_r, m_p = o_g < G, o_r < R, o_p < P
    p_q = q + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh
    b_abs_all = tl.sum(tl.abs(tl.load(p_q + o_d[None, :], mask=m_g[:, None] & (o_d < D)[None, :], other=0.0)), 1)
    b_dims = tl.load(dims + i_bh * R + o_r, mask=m_r, other=0)  # [BLOCK_R] chosen dims
    b_qc = tl.load(p_q + b_dims[None, :], mask=m_g[:, None] & m_r[None, :], other=0.0).to(tl.float32)  # [G, R]
    b_tau = tl.sqrt(D * tl.sum(tl.abs(b_qc), 1) / tl.maximum(b_abs_all.to(tl.float32), 1e-30))
    b_tau = tl.maximum(b_tau, 1e-30)  # [BLOCK_G]
    b_pos = tl.sum(b_qc, 0) > 0  # [BLOCK_R] sign of the group sum: max where positive, else min
    p_off = i_b * stride_pb + i_h * stride_ph + o_p[:, None] * stride_pp + b_dims[None, :]
    m_pr = m_p[:, None] & m_r[None, :]
    b_max = tl.load(pmax + p_off, mask=m_pr & b_pos[None, :], other=0.0)
    b_min = tl.load(pmin + p_off, mask=m_pr & ~b_pos[None, :], other=0.0)
    b_bound = (b_max + b_min).to(tl.float32)  # [BLOCK_P, BLOCK_R], one of the two is 0
    b_s = tl.dot(b_qc, tl.trans(b_bound), input_precision="ieee")  # [BLOCK_G, BLOCK_P]
    b_cnt = tl.load(counts + o_p, mask=m_p, other=1.0)
    b_s = b_s / b_tau[:, None] + tl.log(b_cnt)[None, :]
    b_s = tl.where(m_p[None, :], b_s, float("-inf"))
    tl.store(logits + (i_bh * G + o_g)[:, None] * P + o_p[None, :], b_s, mask=m_g[:, None] & m_p[None, :])
    b_m = tl.max(b_s, 1)
    b_l = tl.sum(tl.exp(b_s - b_m[:, None]), 1)
    tl.store(blk_m + (i_bh * NUM_BLOCKS + i_p) * BLOCK_G + o_g, b_m)
    tl.store(blk_l + (i_bh * NUM_BLOCKS + i_p) * BLOCK_G + o_g, b_l)


@triton.jit
def _page_softmax_mean_kernel(
    logits, blk_m, blk_l, out, P, NUM_BLOCKS,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    i_bh, i_p = tl.program_id(0), tl.program_id(1)
    o_g = tl.arange(0, BLOCK_G)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_g, m_p = o_g < G, o_p < P
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i_k in range(0, NUM_BLOCKS):
        b_m = tl.maximum(b_m, tl.load(blk_m + (i_bh * NUM_BLOCKS + i_k) * BLOCK_G + o_g))
    b_l = tl.zeros([BLOCK_G], tl.float32)
    for i_k in range(0, NUM_BLOCKS):
        i_blk = (i_bh * NUM_BLOCKS + i_k) * BLOCK_G + o_g
        b_l += tl.load(blk_l + i_blk) * tl.exp(tl.load(blk_m + i_blk) - b_m)
    b_s = tl.load(logits + (i_bh * G + o_g)[:, None] * P + o_p[None, :], mask=m_g[:, None] & m_p[None, :],
                  other=float("-inf"))  # fmt: skip
    b_prob = tl.exp(b_s - tl.where(m_g, b_m, 0.0)[:, None]) / tl.where(m_g, b_l, 1.0)[:, None]
    b_prob = tl.where(m_g[:, None], b_prob, 0.0)
    tl.store(out + i_bh * P + o_p, tl.sum(b_prob, 0) / G, mask=m_p)


def page_scores_triton(
    query: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    counts: torch.Tensor,
    n_score_dims: int,
    block_p: int = 64,
) -> torch.Tensor:
    """Approximate attention mass of each page, averaged over the GQA group, in float32 (Triton).

    Same contract as `rocketkv_cli.core.stage2.page_scores` (docs/algorithm.md §3 steps 1–3, RocketKV §3.5).

    Args:
        query: `[B, H, 1, D]` decode query. page_min/page_max: `[B, Hkv, P, D]` (last dim
            contiguous; may be views of larger buffers). counts: `[P]` float32 tokens per page.
        n_score_dims: r ∈ [1, D], head dims used. block_p: pages per program.
    Returns:
        `[B, Hkv, P]` float32; each row sums to 1.
    Raises:
        ValueError: non-CUDA tensors outside the interpreter, mismatched shapes, a dtype or head
            dim that is not supported, or n_score_dims outside [1, D].
    """
    op = "page_scores_triton"
    b, h, t, d = query.shape
    hkv, n_pages = page_min.shape[1], page_min.shape[2]
    if t != 1 or h % hkv or page_min.shape != (b, hkv, n_pages, d) or page_max.shape != page_min.shape:
        raise ValueError(
            f"{op}: expected query [B, H, 1, D] and page_min/page_max [B, Hkv, P, D], got "
            f"{tuple(query.shape)}, {tuple(page_min.shape)}, {tuple(page_max.shape)}"
        )
    if counts.shape != (n_pages,) or n_pages == 0:
        raise ValueError(f"{op}: expected counts [P={n_pages}] with P > 0, got {tuple(counts.shape)}")
    if not 1 <= n_score_dims <= d:
        raise ValueError(f"{op}: n_score_dims must be in [1, {d}], got {n_score_dims}")
    check_device(op, query, page_min, page_max, counts)
    check_head_dim(op, "query", d)
    for name, x in (("query", query), ("page_min", page_min), ("page_max", page_max)):
        check_dtype(op, name, x)
        check_last_dim_contiguous(op, name, x)
    if page_min.stride() != page_max.stride():
        raise ValueError(
            f"{op}: page_min and page_max must share strides, got {page_min.stride()}, {page_max.stride()}"
        )
    g = h // hkv
    if g > 64:
        raise ValueError(f"{op}: GQA group {g} (query {tuple(query.shape)}, pages {tuple(page_min.shape)}) exceeds 64")
    q = query.float()  # [B, H, 1, D]; tiny
    dims = q.view(b, hkv, g, d).abs().sum(2).topk(n_score_dims, dim=-1).indices  # [B, Hkv, r]
    dims = dims.to(torch.int32).contiguous()
    counts = counts.float().contiguous()
    block_g, block_r = block_dim(g), block_dim(n_score_dims)
    n_blocks = triton.cdiv(n_pages, block_p)
    f32 = dict(device=query.device, dtype=torch.float32)
    logits = torch.empty(b * hkv, g, n_pages, **f32)
    blk_m = torch.empty(b * hkv, n_blocks, block_g, **f32)
    blk_l = torch.empty(b * hkv, n_blocks, block_g, **f32)
    out = torch.empty(b, hkv, n_pages, **f32)
    grid = (b * hkv, n_blocks)
    _page_logits_kernel[grid](
        q, page_min, page_max, counts, dims, logits, blk_m, blk_l,
        q.stride(0), q.stride(1), page_min.stride(0), page_min.stride(1), page_min.stride(2), hkv, n_pages, n_blocks,
        G=g, D=d, R=n_score_dims, BLOCK_G=block_g, BLOCK_D=block_dim(d), BLOCK_R=block_r, BLOCK_P=block_p,
    )  # fmt: skip
    _page_softmax_mean_kernel[grid](logits, blk_m, blk_l, out, n_pages, n_blocks, G=g, BLOCK_G=block_g, BLOCK_P=block_p)
    return out
