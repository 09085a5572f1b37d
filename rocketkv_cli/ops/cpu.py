"""CPU fast paths of torch references (docs/algorithm.md §6): each equals its reference in
`core/` to float32 rounding (`tests/test_ops_cpu.py` compares them) and is chosen by
`rocketkv_cli.ops` for CPU tensors under `ROCKETKV_KERNELS=auto`; `torch` keeps the reference.
"""

from __future__ import annotations

import torch

from ..core.stage1 import check_reconstruction_shapes

# torch's fused CPU attention kernel, which also returns each query's log-sum-exp (a private op;
# without it, or when it fails, the reference runs).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_available() -> bool:
    """Whether this torch has the fused CPU attention op `reconstruction_attention` needs."""
    return _FLASH is not None


def reconstruction_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_context: int,
    score_from: int,
    scaling: float,
    query_chunk_tokens: int = 256,
    key_block_tokens: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`core.stage1.reconstruction_attention` without softcapping, for CPU tensors: the same
    attention output `[B, H, T, D]` and context-reconstruction weights `[B, H, n_context]` float32.

    The reference materialises every query's logits over every key, `[G·256, L]` per KV head at a
    time (over 100 MB per layer at 32K tokens), and makes six passes over them (scale, mask,
    softmax, the product with the values, the max): on a CPU these passes, not the arithmetic, are
    its cost. Here the output and each query's log-sum-exp λ_q come from torch's fused CPU
    attention kernel, in two calls merged by their log-sum-exps: the L − T keys before the
    appended tokens, which every query sees, and the last T keys, causally. The weights are then
    max_q exp(s_qk − λ_q) = exp(max_q (s_qk − λ_q)), with s_qk − λ_q the product of
    [q·scaling, −λ_q] and [k, 1] (one matmul of D + 1 dimensions), computed for blocks of
    `key_block_tokens` keys × `query_chunk_tokens` queries so that each block's logits stay in
    the CPU's caches while their max is taken. Measured: 2× faster than the reference on
    SmolLM2's heads (9 query heads, 3 KV heads, D=64) at 3.7K context tokens, 1.6× faster ingest
    with context reconstruction (docs/performance.md, "Ingest").

    Args and shapes as the reference's (queries `[B, H, T, D]` with T ≥ 1, keys and values
    `[B, Hkv, L, D]` of one head size, L − T ≥ n_context, 0 ≤ score_from ≤ T). Raises ValueError on
    shapes that do not match, and
    RuntimeError when the fused op is missing (`flash_available`).
    """
    check_reconstruction_shapes(queries, keys, values, n_context, score_from, same_head_size=True)
    b, h, t, d = queries.shape
    hkv, length = keys.shape[1], keys.shape[2]
    if _FLASH is None:
        raise RuntimeError("this torch has no fused CPU attention op (_scaled_dot_product_flash_attention_for_cpu)")
    g = h // hkv
    q, k, v = queries.float(), keys.float(), values.float()  # [B, H, T, D], [B, Hkv, L, D]
    k_heads = k.repeat_interleave(g, dim=1) if g > 1 else k  # [B, H, L, D]: the op has no GQA
    v_heads = v.repeat_interleave(g, dim=1) if g > 1 else v
    seen = length - t  # keys every query sees (the context and anything before the appended tokens)
    out, lse = _FLASH(q, k_heads[:, :, seen:], v_heads[:, :, seen:], 0.0, True, scale=scaling)[:2]  # causal tail
    if seen:
        out_seen, lse_seen = _FLASH(q, k_heads[:, :, :seen], v_heads[:, :, :seen], 0.0, False, scale=scaling)[:2]
        total = torch.logaddexp(lse, lse_seen)  # [B, H, T]
        out = out * (lse - total).exp().unsqueeze(-1) + out_seen * (lse_seen - total).exp().unsqueeze(-1)
        lse = total
    best = torch.full((b, hkv, g, n_context), float("-inf"), device=k.device)
    ones = k.new_ones(b, hkv, 1, n_context)
    k_aug = torch.cat([k[:, :, :n_context].transpose(-1, -2), ones], dim=2)  # [B, Hkv, D + 1, n]
    for start in range(score_from, t, query_chunk_tokens):
        stop = min(t, start + query_chunk_tokens)
        c = stop - start
        q_aug = torch.cat([q[:, :, start:stop] * scaling, -lse[:, :, start:stop, None]], dim=-1)  # [B, H, c, D + 1]
        q_aug = q_aug.reshape(b, hkv, g * c, d + 1)  # query heads are kv-major
        for first in range(0, n_context, key_block_tokens):
            last = min(n_context, first + key_block_tokens)
            z = torch.matmul(q_aug, k_aug[..., first:last]).view(b, hkv, g, c, last - first)  # s − λ
            torch.maximum(best[..., first:last], z.amax(dim=3), out=best[..., first:last])
    weights = best.exp() if score_from < t else torch.zeros_like(best)
    return out.to(queries.dtype), weights.view(b, h, n_context)


def question_scores(
    question_queries: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None = None,
    max_elements: int = 1 << 24,
) -> torch.Tensor:  # fmt: skip
    """`core.stage1.question_scores` for CPU tensors: `[B, H, T, D]` × `[B, Hkv, S, D]` → `[B, Hkv, S]`
    float32, the attention mass each stored key gets from the question's queries, summed over the
    question's tokens and each GQA group's query heads (docs/algorithm.md §4).

    Every stored key precedes the question, so nothing is masked and each query's softmax over
    the S keys is independent of the others: one pass per block of query rows (logits, softmax,
    sum; `max_elements` logits at a time, 64 MB, with the softmax's and softcap's temporaries 3-4x
    that; the keys are read as float32 whole), where the reference, written for a causal
    observation window, builds a mask and computes every logit twice (a log-sum-exp pass, then the
    weights) (on SmolLM2's GPL cache with every token stored, the serve loop's first token went
    from 2.40 to 1.74 s with this path: docs/serve.md).
    """
    b, h, t, d = question_queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    if keys.shape != (b, hkv, s, d) or h % hkv:
        raise ValueError(f"queries {tuple(question_queries.shape)} and keys {tuple(keys.shape)} do not match")
    g = h // hkv
    # [B, Hkv, G*T, D]: a group's heads share the key head; scaled here, not the G*T*S logits
    q = question_queries.float().reshape(b, hkv, g * t, d) * scaling
    k = keys.float().transpose(-1, -2)  # [B, Hkv, D, S]
    rows = max(1, max_elements // max(1, b * hkv * s))
    scores = torch.zeros(b, hkv, s, dtype=torch.float32, device=keys.device)
    for start in range(0, g * t, rows):
        logits = torch.matmul(q[:, :, start : start + rows], k)  # [B, Hkv, rows, S]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        scores += torch.softmax(logits, dim=-1).sum(dim=2)
    return scores
