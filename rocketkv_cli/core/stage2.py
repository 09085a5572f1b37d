"""Stage 2 — hybrid sparse attention (HSA) for one decode step (docs/algorithm.md §3). Pure torch reference.

Keys are grouped in consecutive pages of `page_size` tokens with an element-wise min and max per
page. Per step and KV head: choose the `n_score_dims` largest dims of Σ_g|q_g|, score pages with
the sign trick (max where Σ_g q_g[i] > 0, else min), soften with a SparQ-style temperature, weight
by token count, average over the GQA group, keep whole pages up to `topk` tokens, then run exact
attention over the selected tokens only. RocketKV paper §3.4–3.5 (after SparQ / Quest).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def page_summaries(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the keys of each page.

    Args:
        keys: `[B, Hkv, S, D]`. page_size: tokens per page; the last page may be partial.
    Returns:
        (page_min, page_max), each `[B, Hkv, P, D]` with P = ceil(S / page_size), keys' dtype.
    """
    b, hkv, s, d = keys.shape
    n_pages = -(-s // page_size)
    pad = n_pages * page_size - s
    if pad:  # pad by repeating the last key: min/max of the partial page are unchanged
        keys = torch.cat([keys, keys[:, :, -1:].expand(b, hkv, pad, d)], dim=2)
    paged = keys.view(b, hkv, n_pages, page_size, d)
    return paged.amin(dim=3), paged.amax(dim=3)


def update_page_summaries(
    page_min: torch.Tensor, page_max: torch.Tensor, keys: torch.Tensor, start: int, page_size: int
) -> None:
    """Recompute, in place, the pages touched by keys from token `start` on (the update on append).

    Pages are consecutive from token 0, so after appending tokens `[start, S)` only the pages from
    `start // page_size` on change; those are rebuilt from `keys` (exact, same as a full rebuild).

    Args:
        page_min/page_max: `[B, Hkv, P_cap, D]` buffers, P_cap ≥ ceil(S / page_size).
        keys: `[B, Hkv, S, D]`, all keys so far. start: first new token, 0 ≤ start ≤ S.
    """
    s = keys.shape[2]
    first = start // page_size
    n_pages = -(-s // page_size)
    assert page_min.shape[2] >= n_pages and page_max.shape == page_min.shape and 0 <= start <= s
    if n_pages > first:
        pmin, pmax = page_summaries(keys[:, :, first * page_size :], page_size)  # [B, Hkv, n_pages - first, D]
        page_min[:, :, first:n_pages] = pmin
        page_max[:, :, first:n_pages] = pmax


def page_token_counts(n_tokens: int, page_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Tokens in each page: `[P]` float32 (page_size everywhere but a partial last page)."""
    n_pages = -(-n_tokens // page_size)
    counts = torch.full((n_pages,), float(page_size), device=device)
    counts[-1] = n_tokens - (n_pages - 1) * page_size
    return counts


def page_scores(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, counts: torch.Tensor, n_score_dims: int
) -> torch.Tensor:
    """Approximate attention mass of each page, averaged over the GQA group, in float32.

    The sign trick is computed as two matrix-vector products, q⁺·maxᵀ + q⁻·minᵀ, where q⁺ (q⁻)
    keeps the chosen dims whose group sum is positive (not positive): the same sum as gathering
    max/min on the chosen dims, without materialising a `[P, r]` gather.

    Args:
        query: `[B, H, 1, D]` decode query. page_min/page_max: `[B, Hkv, P, D]`. counts: `[P]`.
        n_score_dims: r, head dims used.
    Returns:
        `[B, Hkv, P]` float32; each row sums to 1.
    """
    b, h, t, d = query.shape
    hkv, n_pages = page_min.shape[1], page_min.shape[2]
    assert t == 1 and page_max.shape == page_min.shape == (b, hkv, n_pages, d) and counts.shape == (n_pages,)
    q = query.float().reshape(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    dims = q.abs().sum(dim=2).topk(n_score_dims, dim=-1).indices  # [B, Hkv, r]
    chosen = torch.zeros(b, hkv, d, dtype=torch.bool, device=q.device).scatter_(-1, dims, True)
    positive = q.sum(dim=2) > 0  # [B, Hkv, D]
    q_chosen = q * chosen.unsqueeze(2)  # [B, Hkv, G, D]
    q_pos = q_chosen * positive.unsqueeze(2)
    approx = torch.matmul(q_pos, page_max.float().transpose(-1, -2)) + torch.matmul(
        q_chosen - q_pos, page_min.float().transpose(-1, -2)
    )  # [B, Hkv, G, P]
    temperature = torch.sqrt(d * q_chosen.abs().sum(-1) / q.abs().sum(-1).clamp_min(1e-30))  # [B, Hkv, G]
    logits = approx / temperature.clamp_min(1e-30).unsqueeze(-1) + counts.log()
    return torch.softmax(logits, dim=-1).mean(dim=2)


def select_pages(scores: torch.Tensor, topk: int, page_size: int) -> torch.Tensor:
    """Token indices of the best pages, whole pages only, at most `topk` tokens (≥ 1 page).

    Args:
        scores: `[B, Hkv, P]`. topk: tokens. page_size: tokens per page.
    Returns:
        `[B, Hkv, N_sel]` int64 ascending, N_sel = pages × page_size; indices of a partial last
        page may reach past the last token (`sparse_attention` masks those).
    """
    n_pages = scores.shape[-1]
    n_sel_pages = min(n_pages, max(1, topk // page_size))
    pages = scores.topk(n_sel_pages, dim=-1, sorted=False).indices.sort(dim=-1).values  # [B, Hkv, Psel]
    offsets = torch.arange(page_size, device=scores.device)
    return (pages.unsqueeze(-1) * page_size + offsets).flatten(2)  # [B, Hkv, Psel*page_size]


def sparse_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention of each query head over its KV head's selected tokens only.

    Args:
        query: `[B, H, 1, D]`. keys/values: `[B, Hkv, S, D]`. indices: `[B, Hkv, N_sel]` int64
            (entries ≥ S are ignored). scaling, softcap: as the layer's attention.
    Returns:
        `[B, H, 1, D]` in the query dtype.
    """
    b, h, _, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    n_sel = indices.shape[-1]
    valid = indices < s  # [B, Hkv, N_sel]
    # one flat index_select per tensor (rows of [B*Hkv*S, D]) is much cheaper than a 4-D gather
    idx = indices.clamp_max(s - 1)
    k_sel = _select_rows(keys, idx).view(b, hkv, n_sel, d)  # [B, Hkv, N_sel, D]
    v_sel = _select_rows(values, idx).view(b, hkv, n_sel, values.shape[-1])
    q = query.reshape(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    logits = torch.matmul(q, k_sel.transpose(-1, -2)).float() * scaling  # [B, Hkv, G, N_sel]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(v_sel.dtype)
    out = torch.matmul(probs, v_sel)  # [B, Hkv, G, Dv]
    return out.view(b, h, 1, -1)


def _select_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows `indices` `[B, Hkv, N]` of `x` `[B, Hkv, S, D]` as `[B*Hkv*N, D]`.

    Uses one flat `index_select` over a 2-D view of `x`'s storage (x may be a slice of a larger
    buffer: heads need not be adjacent), far cheaper on CPU than a 4-D `gather`.
    """
    b, hkv, s, d = x.shape
    if x.stride(3) != 1 or x.stride(2) != d or x.stride(1) % d or x.stride(0) % d:
        x = x.contiguous()
    rs0, rs1 = x.stride(0) // d, x.stride(1) // d
    n_rows = (b - 1) * rs0 + (hkv - 1) * rs1 + s
    rows = x.as_strided((n_rows, d), (d, 1))
    base = (
        torch.arange(b, device=x.device).view(b, 1, 1) * rs0 + torch.arange(hkv, device=x.device).view(1, hkv, 1) * rs1
    )
    return rows.index_select(0, (indices + base).reshape(-1))


def hsa_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    topk: int,
    page_size: int,
    n_score_dims: int,
    scaling: float,
    softcap: float | None = None,
    score_pages: Callable[..., torch.Tensor] | None = None,
    attend: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One HSA decode step for one layer (RocketKV §3.5; docs/algorithm.md). Exact attention when S ≤ topk.

    Args:
        query: `[B, H, 1, D]`. keys/values: `[B, Hkv, S, D]`. page_min/page_max: `[B, Hkv, P, D]`
            summaries of `keys` (P = ceil(S / page_size)). topk, page_size, n_score_dims: budgets
            (tokens, tokens, dims). scaling, softcap: the layer's.
        score_pages, attend: implementations of `page_scores` and `sparse_attention` (default
            these references; `ops.hsa_decode` passes the dispatched ones). The page top-k is
            `select_pages` on every backend.
    Returns:
        (output `[B, H, 1, D]`, selected token indices `[B, Hkv, N_sel]` int64).
    """
    score_pages = score_pages or page_scores
    attend = attend or sparse_attention
    s = keys.shape[2]
    if s <= topk:
        indices = torch.arange(s, device=keys.device).expand(keys.shape[0], keys.shape[1], s)
    else:
        counts = page_token_counts(s, page_size, keys.device)
        scores = score_pages(query, page_min, page_max, counts, n_score_dims)  # [B, Hkv, P]
        indices = select_pages(scores, topk, page_size)  # [B, Hkv, N_sel]
    return attend(query, keys, values, indices, scaling, softcap), indices


def context_selection(
    query: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    n_context: int,
    n_tokens: int,
    topk: int,
    page_size: int,
    n_score_dims: int,
    n_sink_tokens: int,
    score_pages: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The tokens one HSA decode step attends when a question's tail follows the stored context.

    HSA chooses among the stored context only (tokens [0, n_context), summarised by `page_min`/
    `page_max` `[B, Hkv, P, D]`, P = ceil(n_context / page_size)): the best pages up to `topk`
    tokens by the sign-trick scores (docs/algorithm.md §3). Always attended exactly, besides: the
    pages holding the first `n_sink_tokens` tokens (attention sinks) and the whole tail [n_context,
    n_tokens) — the question and the tokens decoded so far. No token appears twice.

    Args:
        query: `[B, H, 1, D]`. n_tokens: keys in the layer (context + tail).
    Returns:
        `[B, Hkv, N_sel]` int64 indices; entries ≥ n_tokens are padding (ignored by attention).
    """
    b, hkv = page_min.shape[:2]
    dev = page_min.device
    n_pages = page_min.shape[2]
    n_sink_pages = min(n_pages, -(-n_sink_tokens // page_size)) if n_sink_tokens else 0
    tail = torch.arange(n_context, n_tokens, device=dev).expand(b, hkv, n_tokens - n_context)
    if n_context <= topk + n_sink_pages * page_size:
        ctx = torch.arange(n_context, device=dev).expand(b, hkv, n_context)
        return torch.cat([ctx, tail], dim=-1)
    counts = page_token_counts(n_context, page_size, dev)
    scores = (score_pages or page_scores)(query, page_min, page_max, counts, n_score_dims)  # [B, Hkv, P]
    scores[..., :n_sink_pages] = -1.0  # chosen below whatever their score: not twice
    chosen = select_pages(scores, topk, page_size)  # [B, Hkv, N] (may reach past the context)
    chosen = torch.where(chosen < n_context, chosen, torch.full_like(chosen, n_tokens))  # pad, not the tail
    sinks = torch.arange(min(n_sink_pages * page_size, n_context), device=dev).expand(b, hkv, -1)
    return torch.cat([sinks, chosen, tail], dim=-1)
