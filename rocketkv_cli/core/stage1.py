"""Stage 1 — SnapKV++ scoring, pooling and selection (docs/algorithm.md §2). Pure torch, no transformers.

Scores are computed in float32. Each KV head keeps its own token set, the same count per head of
a layer (`allocate_layer_budgets` can give layers different counts); the last `window_size` tokens
are always kept; kept tokens stay in original order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def observation_scores(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    key_chunk_tokens: int = 8192,
) -> torch.Tensor:
    """Attention mass each key receives from the observation-window queries, summed per KV head.

    softmax(q·Kᵀ·scaling) over all keys with the causal mask, in float32, summed over the W window
    queries and over the G query heads of each KV head (SnapKV §3, RocketKV §3.2, GQA-aware).
    Keys are processed in chunks with a two-pass log-sum-exp, so no `[H, W, S]` matrix is held.

    Args:
        window_queries: `[B, H, W, D]` queries after norms and RoPE.
        keys: `[B, Hkv, S, D]` keys after RoPE.
        query_positions: `[W]` int64; key_positions: `[S]` int64 (shared by all heads at ingest).
        scaling: the layer's attention scaling; softcap: logit soft-capping or None.
        key_chunk_tokens: keys per chunk (memory bound).
    Returns:
        `[B, Hkv, S]` float32 scores.
    """
    b, h, w, d = window_queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    assert keys.shape == (b, hkv, s, d) and key_positions.shape == (s,) and query_positions.shape == (w,)
    g = h // hkv
    q = window_queries.float().reshape(b, hkv, g * w, d)  # [B, Hkv, G*W, D]
    qpos = query_positions.repeat(g)  # [G*W], matching q's (g, w) order

    def chunk_logits(start: int) -> torch.Tensor:
        k = keys[:, :, start : start + key_chunk_tokens].float()
        logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, G*W, C]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        visible = key_positions[start : start + key_chunk_tokens].view(1, -1) <= qpos.view(-1, 1)
        return logits.masked_fill(~visible, float("-inf"))

    starts = range(0, s, key_chunk_tokens)
    lse = torch.full((b, hkv, g * w, 1), float("-inf"), device=keys.device)
    for start in starts:
        lse = torch.logaddexp(lse, torch.logsumexp(chunk_logits(start), dim=-1, keepdim=True))
    parts = [torch.exp(chunk_logits(start) - lse).sum(dim=2) for start in starts]  # [B, Hkv, C]
    scores = torch.cat(parts, dim=-1)
    assert scores.shape == (b, hkv, s)
    return scores


def question_scores(
    question_queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    score: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention mass a question's queries give each stored key, summed per KV head: the
    observation scores of per-question re-selection (docs/algorithm.md §4), where the question's
    own queries are the observation window (SnapKV §3 with the question known).

    Every stored key precedes the question, so no key is masked; the softmax runs over the stored
    keys only (the question's own keys are always attended, and left out of the ranking).

    Args:
        question_queries: `[B, H, T, D]` after norms and RoPE. keys: `[B, Hkv, S, D]` stored keys
            after RoPE (each KV head its own tokens). scaling, softcap: the layer's attention.
        score: the observation-score function (default `observation_scores`; `ops` passes its
            dispatched one).
    Returns:
        `[B, Hkv, S]` float32.
    """
    score = score or observation_scores
    t, s = question_queries.shape[2], keys.shape[2]
    return score(question_queries, keys, torch.ones(t, dtype=torch.long, device=keys.device),
                              torch.zeros(s, dtype=torch.long, device=keys.device), scaling, softcap)  # fmt: skip


def reconstruction_weights(
    queries: torch.Tensor,
    keys: torch.Tensor,
    n_context: int,
    scaling: float,
    softcap: float | None = None,
    query_chunk_tokens: int = 256,
) -> torch.Tensor:
    """Context-reconstruction weights (KVzip §3): per query head, the largest attention weight
    any query gives each of the first `n_context` keys.

    The T queries are those of the last T keys (a teacher-forced pass appended after the
    context): query t sees keys 0 … L − T + t (causal). softmax(q·Kᵀ·scaling) runs in float32 over
    every key a query sees; the maximum is over queries. Queries go in chunks, so no `[H, T, L]`
    matrix is held.

    Args:
        queries: `[B, H, T, D]` after norms and RoPE. keys: `[B, Hkv, L, D]` after RoPE, L ≥ T and
            L − T ≥ n_context. scaling, softcap: the layer's attention.
    Returns:
        `[B, H, n_context]` float32 (sum over each GQA group for a KV head's score).
    """
    b, h, t, d = queries.shape
    hkv, length = keys.shape[1], keys.shape[2]
    if keys.shape[0] != b or keys.shape[3] != d or length - t < n_context or h % hkv:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} do not match n={n_context}")
    g = h // hkv
    k_ctx = keys[:, :, :n_context].float().transpose(-1, -2)  # [B, Hkv, D, n]: never masked
    k_rest = keys[:, :, n_context:].float().transpose(-1, -2)  # [B, Hkv, D, L − n]: masked causally
    # max over queries of exp(logit − lse) = exp(max over queries of (logit − lse)): one exp at the end
    best = torch.full((b, hkv, g, n_context), float("-inf"), device=keys.device)
    for start in range(0, t, query_chunk_tokens):
        q = queries[:, :, start : start + query_chunk_tokens].float()  # [B, H, C, D]
        c = q.shape[2]
        q = q.reshape(b, hkv, g * c, d)  # rows in (g, c) order
        ctx = torch.matmul(q, k_ctx) * scaling  # [B, Hkv, G*C, n]
        rest = torch.matmul(q, k_rest) * scaling  # [B, Hkv, G*C, L − n]
        if softcap is not None:
            ctx, rest = torch.tanh(ctx / softcap) * softcap, torch.tanh(rest / softcap) * softcap
        last_seen = length - t + start + torch.arange(c, device=keys.device) - n_context  # [C], in rest's columns
        future = torch.arange(length - n_context, device=keys.device)[None, :] > last_seen[:, None]  # [C, L − n]
        rest = rest.view(b, hkv, g, c, -1).masked_fill(future, float("-inf")).view(b, hkv, g * c, -1)
        lse = torch.logaddexp(torch.logsumexp(ctx, dim=-1, keepdim=True), torch.logsumexp(rest, dim=-1, keepdim=True))
        ctx = (ctx - lse).view(b, hkv, g, c, n_context)  # log-weights on the context keys
        best = torch.maximum(best, ctx.amax(dim=3))
    return best.exp().view(b, h, n_context)


def check_reconstruction_shapes(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_context: int,
    score_from: int,
    same_head_size: bool = False,
) -> None:
    """Raise ValueError unless queries `[B, H, T, D]` (T ≥ 1), keys `[B, Hkv, L, D]` and values
    `[B, Hkv, L, Dv]` fit `reconstruction_attention`: H a multiple of Hkv, L − T ≥ n_context,
    0 ≤ score_from ≤ T; Dv = D too when `same_head_size` (the CPU fast path's fused op)."""
    b, h, t, d = queries.shape
    hkv, length = keys.shape[1], keys.shape[2]
    if (keys.shape[0] != b or keys.shape[3] != d or values.shape[:3] != keys.shape[:3] or t < 1
            or (same_head_size and values.shape[3] != d) or length - t < n_context or h % hkv
            or not 0 <= score_from <= t):  # fmt: skip
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} do not match n={n_context}, "
                         f"score_from={score_from}")  # fmt: skip


def reconstruction_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_context: int,
    score_from: int,
    scaling: float,
    softcap: float | None = None,
    query_chunk_tokens: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a teacher-forced pass appended after a context, and, in the same
    softmax, its context-reconstruction weights (`reconstruction_weights` for the queries from
    index `score_from` on): one pass instead of attention plus a second scoring pass.

    Args:
        queries: `[B, H, T, D]`, the tokens of the last T keys. keys, values: `[B, Hkv, L, D]`,
            L − T ≥ n_context. score_from: index of the first query that counts (earlier ones,
            the reconstruction request, attend but do not score). scaling, softcap: the layer's.
    Returns:
        (output `[B, H, T, D]` in the queries' dtype, float32 softmax as in `exact_attention`;
        weights `[B, H, n_context]` float32, zeros when no query counts).
    """
    check_reconstruction_shapes(queries, keys, values, n_context, score_from)
    b, h, t, d = queries.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = h // hkv
    k_t, v = keys.float().transpose(-1, -2), values.float()  # [B, Hkv, D, L], [B, Hkv, L, Dv]
    best = torch.zeros(b, hkv, g, n_context, device=keys.device)
    outs = []
    for start in range(0, t, query_chunk_tokens):
        q = queries[:, :, start : start + query_chunk_tokens].float()
        c = q.shape[2]
        logits = torch.matmul(q.reshape(b, hkv, g * c, d), k_t) * scaling  # [B, Hkv, G*C, L]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        last_seen = length - t + start + torch.arange(c, device=keys.device)  # [C]
        future = torch.arange(n_context, length, device=keys.device)[None, :] > last_seen[:, None]  # [C, L − n]
        logits = logits.view(b, hkv, g, c, length)
        logits[..., n_context:] = logits[..., n_context:].masked_fill(future, float("-inf"))  # the context: all seen
        weights = torch.softmax(logits, dim=-1)  # [B, Hkv, G, C, L]
        outs.append(torch.matmul(weights.view(b, hkv, g * c, length), v).view(b, hkv, g, c, -1))
        first = max(0, score_from - start)
        if first < c:
            best = torch.maximum(best, weights[:, :, :, first:, :n_context].amax(dim=3))
    out = torch.cat(outs, dim=3).view(b, h, t, -1).to(queries.dtype)
    return out, best.view(b, h, n_context)


def pool_scores(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Max-pool scores along the sequence, stride 1, same length (SnapKV clustering).

    Args:
        scores: `[B, Hkv, S]` float32. kernel_size: odd, in tokens (1 = no pooling).
    Returns:
        `[B, Hkv, S]`.
    """
    assert kernel_size % 2 == 1, kernel_size
    if kernel_size == 1:
        return scores
    pooled = F.max_pool1d(scores, kernel_size=kernel_size, stride=1, padding=kernel_size // 2)
    assert pooled.shape == scores.shape
    return pooled


def always_kept(n_tokens: int, prompt_budget: int, window_size: int, n_first: int) -> tuple[int, int]:
    """(first, window): how many leading and trailing tokens of `n_tokens` stage 1 keeps whatever
    their score, within `prompt_budget` (the window first, then the first tokens). In tokens."""
    window = min(window_size, prompt_budget, n_tokens)
    return max(0, min(n_first, prompt_budget - window, n_tokens - window)), window


def select_kept_tokens(pooled: torch.Tensor, prompt_budget: int, window_size: int, n_first: int = 0) -> torch.Tensor:
    """Indices stage 1 keeps: the first `n_first` tokens, the top (prompt_budget − first − W) of the
    rest by pooled score, and the last W tokens.

    Args:
        pooled: `[B, Hkv, S]` pooled scores.
        prompt_budget: tokens kept per KV head (window included). If S ≤ prompt_budget all are kept.
        window_size: W, always kept. n_first: leading tokens always kept (attention sinks, the
            framing and the document's first tokens); fewer when the budget leaves no room.
    Returns:
        `[B, Hkv, min(S, prompt_budget)]` int64, ascending (original order), per KV head.
    """
    b, hkv, s = pooled.shape
    if s <= prompt_budget:
        return torch.arange(s, device=pooled.device).expand(b, hkv, s).contiguous()
    first, window = always_kept(s, prompt_budget, window_size, n_first)
    n_top = prompt_budget - window - first
    # the set only (sorted below): topk's own sort of thousands of values cost 10× its selection on a CPU
    top = torch.topk(pooled[..., first : s - window], n_top, dim=-1, sorted=False).indices + first  # [B, Hkv, n_top]
    head = torch.arange(first, device=pooled.device).expand(b, hkv, first)
    tail = torch.arange(s - window, s, device=pooled.device).expand(b, hkv, window)
    kept = torch.cat([head, top, tail], dim=-1).sort(dim=-1).values
    assert kept.shape == (b, hkv, prompt_budget)
    return kept


def snapkv_select(
    scores: torch.Tensor,
    prompt_budget: int,
    window_size: int,
    kernel_size: int,
    pool: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    n_first: int = 0,
) -> torch.Tensor:
    """SnapKV++ selection from raw observation scores: pool the prefix only, then select
    (`select_kept_tokens`, with the first `n_first` tokens always kept).

    The window's own keys are always kept, so their (large) scores are excluded from pooling:
    pooled over the whole sequence they would spill into the `kernel_size // 2` prefix tokens just
    before the window and take top-k slots (SnapKV pools `scores[..., :-W]`).

    Args:
        scores: `[B, Hkv, S]` float32 from `observation_scores`. prompt_budget, window_size, kernel_size:
            tokens. pool: the pooling function (default `pool_scores`; `ops` passes its dispatched one).
            Returns: `[B, Hkv, min(S, prompt_budget)]` int64 ascending.
    """
    pool = pool or pool_scores
    s = scores.shape[-1]
    first, window = always_kept(s, prompt_budget, window_size, n_first)  # kept whatever their score:
    middle = scores[..., first : s - window]  # like the window, they stay out of the pooling
    pooled_middle = pool(middle, kernel_size) if middle.shape[-1] else middle
    pooled = torch.cat([scores[..., :first], pooled_middle, scores[..., s - window :]], dim=-1)  # [B, Hkv, S]
    return select_kept_tokens(pooled, prompt_budget, window_size, n_first)


def allocate_layer_budgets(
    scores: Sequence[torch.Tensor],
    prompt_budget: int,
    window_size: int,
    n_first: int = 0,
    min_share: float = 0.25,
) -> list[int]:
    """Per-layer prompt budgets with the total of `prompt_budget` in every layer, spent where the
    heads' attention mass is (adaptive budgets: Ada-KV's allocation, arXiv 2407.11550 §4, across
    layers; KVzip §3.3 ranks its scores across heads and layers too).

    Each head's scores of the tokens selection chooses from (after the first `n_first`, before the
    last W: those are kept anyway, as in `select_kept_tokens`) are normalised to sum to 1, the
    share of the head's attention mass on each token. The L·Hkv·m largest shares over every layer
    and head are what a budget of m = prompt_budget − first − W free slots per head and layer
    would ideally keep; a layer's count is the mean over its heads of the shares it holds (every
    head of a layer keeps the same count, so a layer stays one `[Hkv, S, D]` tensor). Counts are
    then scaled to sum to L·m exactly, each kept within [⌈min_share·m⌉, the selectable tokens],
    so no layer loses most of its uniform share to a document's reconstruction or window that did
    not anticipate a later question.

    Args:
        scores: per full-attention layer, `[1, Hkv, S]` float32 selection scores (observation or
            reconstruction), the same S in every layer. prompt_budget, window_size, n_first: tokens,
            as for `select_kept_tokens`. min_share: the smallest share of m a layer keeps, in [0, 1].
    Returns:
        per layer, its prompt budget (tokens kept per KV head, first and last tokens included); the
        sum equals `len(scores) · prompt_budget`; all `prompt_budget` when S ≤ prompt_budget.
    Raises:
        ValueError: no layers, layers of different lengths, or min_share outside [0, 1].
    """
    if not scores:
        raise ValueError("no layers to allocate budgets to")
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(f"min_share must be in [0, 1], got {min_share}")
    s = scores[0].shape[-1]
    if any(x.dim() != 3 or x.shape[0] != 1 or x.shape[-1] != s for x in scores):
        raise ValueError(f"scores must be [1, Hkv, S] with one S, got {[tuple(x.shape) for x in scores]}")
    n_layers = len(scores)
    first, window = always_kept(s, prompt_budget, window_size, n_first)
    free = prompt_budget - window - first  # m: slots chosen by score, per head and layer
    selectable = s - window - first
    if s <= prompt_budget or free <= 0:
        return [prompt_budget] * n_layers
    shares = []
    for x in scores:
        middle = x[0, :, first : s - window].float().cpu()  # [Hkv, selectable]: a small ranking, on the CPU
        shares.append(middle / middle.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    heads = torch.tensor([x.shape[0] for x in shares])
    flat = torch.cat([x.flatten() for x in shares])  # [Σ Hkv · selectable]
    if bool(flat.max() == flat.min()):  # no layer holds more mass than another (e.g. all scores 0)
        return [prompt_budget] * n_layers
    ends = torch.cumsum(heads * selectable, 0)  # flat index where each layer's shares end
    best = torch.topk(flat, min(flat.numel(), free * int(heads.sum())), sorted=False).indices
    owner = torch.bucketize(best, ends, right=True)  # layer of each chosen share (no [Σ Hkv·S] int64 map)
    ideal = torch.bincount(owner, minlength=n_layers).double() / heads.double()  # [L] mean per head
    lo, hi, target = math.ceil(min_share * free), selectable, free * n_layers
    # scale so that the clamped counts sum to the target (monotone in the scale: bisection), then
    # round down and hand the remaining slots to the largest fractions
    low, high = 0.0, float(hi) / max(float(ideal[ideal > 0].min()), 1e-9) if bool((ideal > 0).any()) else 1.0
    for _ in range(100):
        mid = (low + high) / 2
        if float((ideal * mid).clamp(lo, hi).sum()) < target:
            low = mid
        else:
            high = mid
    real = (ideal * high).clamp(lo, hi)
    counts = real.floor().long()
    for i in torch.argsort(real - counts, descending=True).tolist():
        if int(counts.sum()) >= target:
            break
        if counts[i] < hi:
            counts[i] += 1
    for i in torch.argsort(real - counts).tolist():  # the clamped sum can round above the target
        if int(counts.sum()) <= target:
            break
        if counts[i] > lo:
            counts[i] -= 1
    out = [int(c) + first + window for c in counts]
    assert sum(out) == n_layers * prompt_budget, (out, prompt_budget)
    return out


def gather_tokens(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather per-KV-head tokens.

    Args:
        tensor: `[B, Hkv, S, D]` or `[B, Hkv, S]`. indices: `[B, Hkv, N]` int64.
    Returns:
        `[B, Hkv, N, D]` or `[B, Hkv, N]`, contiguous.
    """
    if tensor.dim() == 3:
        return torch.gather(tensor, 2, indices).contiguous()
    d = tensor.shape[-1]
    return torch.gather(tensor, 2, indices.unsqueeze(-1).expand(-1, -1, -1, d)).contiguous()
