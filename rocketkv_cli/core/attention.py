"""Exact attention with the mask derived from RoPE positions (pure torch, no transformers).

Pruned caches keep each token's original position, and each KV head keeps its own tokens, so the
causal and sliding-window masks are computed from positions, per KV head, never from indices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask of the keys each query may see.

    Args:
        query_positions: `[T]` int64 RoPE positions of the queries.
        key_positions: `[B, Hk, S]` int64 positions of the keys (Hk = n_kv_heads, or 1 when shared).
        sliding_window: window in tokens (key visible iff q − window < k ≤ q), or None.
    Returns:
        `[B, Hk, T, S]` bool, True = attend.
    """
    assert query_positions.dim() == 1 and key_positions.dim() == 3
    q = query_positions.view(1, 1, -1, 1)
    k = key_positions.unsqueeze(2)
    mask = k <= q  # [B, Hk, T, S]
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def exact_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention of `query` over `keys`/`values`, masked by positions (GQA-aware).

    Args:
        query: `[B, H, T, D]` (after RoPE).
        keys, values: `[B, Hkv, S, D]` with H a multiple of Hkv (query head h uses KV head h // G).
        key_positions: `[B, Hkv, S]` or `[B, 1, S]` (shared by all heads) int64.
        query_positions: `[T]` int64.
        scaling: the layer's attention scaling (Gemma: query_pre_attn_scalar**-0.5).
        sliding_window: tokens, or None for full attention.
        softcap: logit soft-capping (Gemma 2), or None.
    Returns:
        `[B, H, T, D]` in the query dtype. Keys and values in another floating dtype (a bfloat16
        working set) are attended with the query rounded to theirs, as a decode step attends them.
    """
    if keys.dtype != query.dtype:
        return exact_attention(query.to(keys.dtype), keys, values, key_positions, query_positions, scaling,
                               sliding_window, softcap).to(query.dtype)  # fmt: skip
    b, h, t, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    assert keys.shape == (b, hkv, s, d) and values.shape[:3] == (b, hkv, s), (query.shape, keys.shape)
    assert key_positions.shape[-1] == s and query_positions.shape == (t,)
    g = h // hkv
    mask = position_mask(query_positions, key_positions, sliding_window)  # [B, Hk, T, S]
    if softcap is None:
        if mask.shape[1] != 1:
            mask = mask.repeat_interleave(g, dim=1)  # [B, H, T, S]
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=g > 1)
    q = query.reshape(b, hkv, g * t, d)  # query heads of a group share the KV head
    logits = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling  # [B, Hkv, G*T, S]
    logits = torch.tanh(logits / softcap) * softcap
    logits = logits.view(b, hkv, g, t, s).masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(values.dtype).view(b, hkv, g * t, s)
    return torch.matmul(probs, values).view(b, h, t, d)
