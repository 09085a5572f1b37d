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


def key_logits(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`query @ keysᵀ` per KV head: query `[B, Hkv, R, D]` (the R query rows that share a KV
    head), keys `[B, Hkv, S, D]` → logits `[B, Hkv, R, S]` in their dtype, as `torch.matmul(query,
    keys.transpose(-1, -2))`. One `mm` per (batch, KV head) instead: on a CPU torch's batched
    product over the keys' transpose streamed them 1.4× (decode, R = 3) to 2.3× (a question, R =
    114) slower on SmolLM2's shapes (docs/performance.md, "Scores one KV head at a time").
    Raises ValueError: shapes that do not match."""
    b, hkv, r, d = query.shape
    if keys.dim() != 4 or tuple(keys.shape[:2]) != (b, hkv) or keys.shape[3] != d:
        raise ValueError(f"query {tuple(query.shape)} and keys {tuple(keys.shape)} do not match")
    out = query.new_empty(b, hkv, r, keys.shape[2])  # [B, Hkv, R, S]
    for i in range(b):
        for j in range(hkv):
            torch.mm(query[i, j], keys[i, j].t(), out=out[i, j])
    return out


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


def question_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_context: int, scaling: float,
    softcap: float | None = None, max_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A question's first prefill in one full-attention layer, and its re-selection scores, from
    one pass over the stored context (docs/algorithm.md §4): `ops.question_attention`'s fast path.

    Layout: keys/values `[B, Hkv, L, D]` hold the stored context (`n_context` tokens, every one
    before every query) then the tail in position order, whose last T tokens are the queries'
    own: query `[B, H, T, D]` (after RoPE). The context part needs no mask and the tail part a
    causal one over a few tokens; each is a softmax of its own (the context's is the
    re-selection score itself: softmax over the stored keys only, `core.stage1.question_scores`),
    and the attention output is their log-sum-exp merge, so the logits over the context are
    computed once, where the reference builds an `[B, H, T, L]` mask for attention and computes
    the same logits again for the scores. Query rows go in blocks of `max_elements` logits.
    Computed in float32 whatever the inputs' dtype.
    Returns: (output `[B, H, T, D]` in the query's dtype, scores `[B, Hkv, n_context]` float32).
    Raises:
        ValueError: shapes that do not match, or a tail shorter than the queries.
    """
    b, h, t, d = query.shape
    hkv, total = keys.shape[1], keys.shape[2]
    tail = total - n_context
    if keys.shape != (b, hkv, total, d) or values.shape[:3] != (b, hkv, total) or h % hkv or not 0 < n_context:
        raise ValueError(f"query {tuple(query.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}, "
                         f"context {n_context} do not match")  # fmt: skip
    if tail < t:
        raise ValueError(f"a tail of {tail} tokens cannot hold {t} queries")
    g = h // hkv
    q = query.float().reshape(b, hkv, g * t, d) * scaling  # [B, Hkv, G*T, D]: a group's heads share the KV head
    kc, vc = keys[:, :, :n_context].float(), values[:, :, :n_context].float()
    kt, vt = keys[:, :, n_context:].float().transpose(-1, -2), values[:, :, n_context:].float()
    # row r of a group is query r % T, at tail index tail - T + r % T: it sees tail keys up to itself
    own = torch.arange(g * t, device=keys.device) % t + (tail - t)  # [G*T]
    hidden = torch.arange(tail, device=keys.device).view(1, tail) > own.view(-1, 1)  # [G*T, tail]
    scores = torch.zeros(b, hkv, 1, n_context, dtype=torch.float32, device=keys.device)
    out = torch.empty(b, hkv, g * t, values.shape[-1], dtype=torch.float32, device=keys.device)
    rows = max(1, max_elements // max(1, b * hkv * total))
    for start in range(0, g * t, rows):
        end = min(g * t, start + rows)
        block = q[:, :, start:end]
        lc, lt = key_logits(block, kc), torch.matmul(block, kt)  # [B, Hkv, r, n_context], [B, Hkv, r, tail]
        if softcap is not None:
            lc, lt = torch.tanh(lc / softcap) * softcap, torch.tanh(lt / softcap) * softcap
        lt.masked_fill_(hidden[start:end], float("-inf"))
        mc, mt = lc.amax(-1, keepdim=True), lt.amax(-1, keepdim=True)  # [B, Hkv, r, 1] each
        ec, et = lc.sub_(mc).exp_(), lt.sub_(mt).exp_()  # in place: the logits are not needed again
        sc, st = ec.sum(-1, keepdim=True), et.sum(-1, keepdim=True)
        scores += torch.matmul((1.0 / sc).transpose(-1, -2), ec)  # Σ_rows softmax over the context
        top = torch.maximum(mc, mt)
        wc, wt = (mc - top).exp(), (mt - top).exp()
        out[:, :, start:end] = (torch.matmul(ec, vc) * wc + torch.matmul(et, vt) * wt) / (sc * wc + st * wt)
    return out.view(b, h, t, -1).to(query.dtype), scores.view(b, hkv, n_context)
