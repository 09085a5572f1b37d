"""Everything coupled to transformers' internals: the attention hook and forward calls (the cache
layer and the model's shape are in `cache_layer.py`).

rocketkv plugs in through public seams only: a `CacheLayerMixin` subclass holding the stored
(pruned, read-only) context plus a per-question tail (`cache_layer.RocketLayer`), and an
attention function registered with `AttentionInterface` and switched on with
`set_attn_implementation` inside a context manager (`rocketkv_attention`) that restores the model
on exit. Nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .. import ops
from ..core.attention import exact_attention
from ..core.config import DecodeConfig
from ..errors import ModelLoadError
from .cache_layer import (  # noqa: F401  (empty_cache … re-exported: their callers import them from here)
    SUPPORTED_MODEL_TYPES,
    LayerSpec,
    ModelShape,
    RocketCache,
    RocketLayer,
    empty_cache,
    model_shape,
    rope_frequencies,
)
from .weights import decode_step

ATTN_NAME = "rocketkv"


@dataclass
class Reconstruction:
    """Context-reconstruction weights gathered while a teacher-forced pass runs after a context
    of `n_context` tokens (`Engine.reconstruction_scores`): queries at RoPE positions ≥
    `score_from` count. `best[layer]`: `[1, H, n_context]` float32, the largest weight any
    counted query gave each context key (full-attention layers only)."""

    n_context: int
    score_from: int
    best: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Session:
    cache: RocketCache
    shape: ModelShape
    decode: DecodeConfig | None
    capture_from: int | None = None  # capture queries at RoPE positions ≥ this
    capture_sliding: bool = False  # … in sliding-window layers too
    captured: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    hsa_from: int | None = None  # teacher forcing: queries at positions ≥ this attend as decode steps do
    reconstruct: Reconstruction | None = None  # full-attention layers record reconstruction weights
    # a question's first prefill: per full-attention layer, the re-selection scores `[B, Hkv, n_context]`
    question_scores: dict[int, torch.Tensor] | None = None


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("rocketkv_session", default=None)


class AttentionMass:
    """Attention weights that queries give the stored context, summed over each full-attention
    layer's query heads, by RoPE position (each KV head keeps its own tokens): `layers[i]`
    `[n_positions]` float32 per layer index. queries: "last" (the last query of each forward
    call: the one that predicts the next token) or "all" (every query of each call). The
    weights are exact softmax(q·Kᵀ·scaling) over every cached key the query sees, whatever
    stage 2 attended. Used by `ask --cite` (engine/attribution.py)."""

    def __init__(self, n_positions: int, device: torch.device, queries: str = "last"):
        if queries not in ("last", "all"):
            raise ValueError(f"queries must be 'last' or 'all', got {queries!r}")
        self.n_positions, self.device, self.queries = n_positions, device, queries
        self.layers: dict[int, torch.Tensor] = {}

    def add(self, layer_idx: int, query: torch.Tensor, layer: RocketLayer, spec: LayerSpec) -> None:
        """Add the weights of `query` (`[1, H, T, D]`, the last T tokens of `layer`) over its keys."""
        keys, _, positions = layer.view()  # [1, Hkv, L, D], [1, Hkv, L]
        hkv, n_ctx, length = keys.shape[1], layer.n_context, keys.shape[2]
        q = query[0].float() if self.queries == "all" else query[0, :, -1:].float()  # [H, T', D]
        h, t = q.shape[:2]
        logits = torch.einsum("kgtd,ksd->kgts", q.view(hkv, h // hkv, t, -1), keys[0].float()) * spec.scaling
        if spec.softcap is not None:
            logits = torch.tanh(logits / spec.softcap) * spec.softcap
        seen = length - t + torch.arange(t, device=keys.device)  # query t sees keys before index seen[t] + 1
        future = torch.arange(length, device=keys.device)[None, :] > seen[:, None]  # [T', L]
        weights = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)[..., :n_ctx]
        weights = weights.sum(dim=(1, 2))  # [Hkv, n_ctx]: over query heads and queries, on the stored context
        mass = self.layers.setdefault(layer_idx, torch.zeros(self.n_positions, device=self.device))
        mass.scatter_add_(0, positions[0, :, :n_ctx].reshape(-1).long(), weights.reshape(-1))


_MASS: contextvars.ContextVar[AttentionMass | None] = contextvars.ContextVar("rocketkv_mass", default=None)


@contextlib.contextmanager
def attention_mass(n_positions: int, device: torch.device, queries: str = "last") -> Iterator[AttentionMass]:
    """Inside the block, every forward call through rocketkv's attention adds its queries'
    weights over the stored context to the yielded `AttentionMass`."""
    mass = AttentionMass(n_positions, device, queries)
    token = _MASS.set(mass)
    try:
        yield mass
    finally:
        _MASS.reset(token)


@contextlib.contextmanager
def attention_mass_paused() -> Iterator[None]:
    """Inside the block no `AttentionMass` collects weights (a forward whose queries are not
    the ones asked for, such as a shared prefix run only to fill the cache)."""
    token = _MASS.set(None)
    try:
        yield
    finally:
        _MASS.reset(token)


def active_attention_mass() -> AttentionMass | None:
    """The `AttentionMass` collecting weights now (`attention_mass`), or None."""
    return _MASS.get()


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """rocketkv's attention function (registered with `AttentionInterface`).

    query: `[B, H, T, D]` after RoPE. Keys, values and positions come from the session's cache
    (the `key`/`value` arguments are views of the same buffers). Returns `[B, T, H, D]`, None.
    """
    session = _SESSION.get()
    if session is None:
        raise RuntimeError("rocketkv attention called outside rocketkv_attention()")
    spec = session.shape.layers[module.layer_idx]
    passed = kwargs.get("sliding_window")
    if (passed or None) != spec.sliding_window or (scaling is not None and abs(scaling - spec.scaling) > 1e-12):
        raise RuntimeError(
            f"layer {module.layer_idx}: transformers passed sliding_window={passed}, scaling={scaling}; "
            f"rocketkv expected {spec.sliding_window}, {spec.scaling}"
        )
    layer = session.cache.layers[module.layer_idx]
    q_pos = session.cache.query_positions
    if q_pos is None:
        raise RuntimeError("rocketkv attention called without query positions (use forward_tokens)")
    if session.capture_from is not None and (spec.sliding_window is None or session.capture_sliding):
        keep = torch.ge(q_pos, session.capture_from)
        if bool(keep.any()):
            session.captured.setdefault(module.layer_idx, []).append(query[:, :, keep].detach().float())
    if (mass := _MASS.get()) is not None and spec.sliding_window is None and layer.n_context:
        mass.add(module.layer_idx, query, layer, spec)
    keys, values, k_pos = layer.view()
    if (rec := session.reconstruct) is not None and spec.sliding_window is None:
        score_from = int((q_pos < rec.score_from).sum())
        out, best = ops.reconstruction_attention(query, keys, values, rec.n_context, score_from, spec.scaling,
                                                 spec.softcap)  # fmt: skip
        prev = rec.best.get(module.layer_idx)
        rec.best[module.layer_idx] = best if prev is None else torch.maximum(prev, best)
        return out.transpose(1, 2).contiguous(), None
    if session.question_scores is not None and spec.sliding_window is None and layer.n_context:
        out, scores = ops.question_attention(query, keys, values, k_pos, q_pos, layer.n_context, spec.scaling,
                                             spec.softcap)  # fmt: skip
        prev = session.question_scores.get(module.layer_idx)
        session.question_scores[module.layer_idx] = scores if prev is None else prev + scores
        return out.transpose(1, 2).contiguous(), None
    dec = session.decode
    hsa = dec if dec is not None and spec.sliding_window is None and dec.uses_hsa(layer.n_context) else None
    if hsa is not None and keys.dtype != query.dtype:  # `Decoder.select_working_set` keeps HSA's float
        raise RuntimeError(f"layer {module.layer_idx}: a {keys.dtype} working set attended by stage-2 HSA")
    if hsa is not None and query.shape[2] == 1:
        out = _hsa_step(query, keys, values, layer, hsa, spec)
    elif hsa is not None and session.hsa_from is not None and bool((q_pos >= session.hsa_from).any()):
        out = _teacher_forced(query, keys, values, k_pos, q_pos, layer, hsa, spec, session.hsa_from)
    elif query.shape[2] == 1 and spec.sliding_window is None and spec.softcap is None:
        out = exact_decode_attention(query, keys, values, spec.scaling)
    elif (query.shape[2] == 1 and spec.softcap is None and keys.device.type == "cpu"
          and (start := window_start(k_pos, q_pos, spec)) is not None):  # fmt: skip
        out = exact_decode_attention(query, keys[:, :, start:], values[:, :, start:], spec.scaling)
    else:
        if layer.n_context == 0:  # ingest: positions are shared by all heads
            k_pos = k_pos[:, :1]
        if (spec.sliding_window is not None and query.shape[2] > 1  # a prefill: a GPU decode step never reads back
                and (start := hidden_keys(k_pos, q_pos, spec.sliding_window))):  # fmt: skip
            keys, values, k_pos = keys[:, :, start:], values[:, :, start:], k_pos[..., start:]
        out = exact_attention(query, keys, values, k_pos, q_pos, spec.scaling, spec.sliding_window, spec.softcap)
    return out.transpose(1, 2).contiguous(), None


def decode_attention_is_exact(cache: RocketCache) -> bool:
    """Whether a decode step's attention, as `_attention` would run it now, is exact decode
    attention in every layer (over all its keys, or a sliding window's) with nothing else
    recorded: False outside `rocketkv_attention`, with a collector active (captured queries,
    reconstruction or question scores, an `AttentionMass`), with stage-2 HSA in some layer, or a
    logit soft-cap. Used by `model/captured.py` to run the step it compiles only where it computes
    what `_attention` computes."""
    session = _SESSION.get()
    if session is None or session.cache is not cache or _MASS.get() is not None:
        return False
    if session.capture_from is not None or session.reconstruct is not None or session.question_scores is not None:
        return False
    dec = session.decode
    return not any(
        spec.softcap is not None or (dec is not None and spec.sliding_window is None and dec.uses_hsa(layer.n_context))
        for spec, layer in zip(session.shape.layers, cache.layers, strict=True)
    )


def _hsa_step(query, keys, values, layer: RocketLayer, dec: DecodeConfig, spec: LayerSpec) -> torch.Tensor:
    """One decode step: HSA over the stored context, the sinks and the tail attended exactly."""
    pmin, pmax = layer.context_pages(dec.page_size)
    out, _ = ops.hsa_context_decode(query, keys, values, pmin, pmax, layer.n_context, dec.topk, dec.page_size,
                                    dec.n_score_dims, dec.n_sink_tokens, spec.scaling, spec.softcap)  # fmt: skip
    return out


def _teacher_forced(query, keys, values, k_pos, q_pos, layer, dec, spec, hsa_from: int) -> torch.Tensor:
    """A forward over several tokens where those at positions ≥ `hsa_from` attend exactly as the
    decode step at their position would (each seeing the tail up to itself): teacher forcing that
    equals step-by-step decode. The others (the question) attend exactly, as in prefill."""
    t = query.shape[2]
    outs = []
    first = int((q_pos < hsa_from).sum())
    if first:
        exact = exact_attention(query[:, :, :first], keys, values, k_pos, q_pos[:first], spec.scaling,
                                spec.sliding_window, spec.softcap)  # fmt: skip
        outs.append(exact)
    n_before = layer.length - t  # keys before this forward's tokens
    for i in range(first, t):
        visible = n_before + i + 1
        outs.append(_hsa_step(query[:, :, i : i + 1], keys[:, :, :visible], values[:, :, :visible], layer, dec, spec))
    return torch.cat(outs, dim=2)


WINDOW_SLICE_MIN_KEYS = 1024
"""`hidden_keys` slices a sliding-window layer's keys only when at least this many lead the
buffer unseen: a long question's later chunks (the window is a few hundred tokens, the tail
behind it thousands). Slicing changes the attention kernel's summation blocks (float rounding),
so a short question, which hides at most its framing's few dozen, is computed as before."""


def hidden_keys(key_positions: torch.Tensor, query_positions: torch.Tensor, window: int) -> int:
    """How many keys at the front of a sliding-window layer's buffer no query sees, in every KV
    head (0 when fewer than `WINDOW_SLICE_MIN_KEYS`): exact attention over the rest equals it over
    all of them (those keys are masked for every query, `core.attention.position_mask`: q − window
    < k ≤ q), and costs the window and the queries' own tokens, not the whole tail.

    key_positions `[B, Hkv, S]` or `[B, 1, S]` int64; query_positions `[T]` int64."""
    if key_positions.shape[-1] < WINDOW_SLICE_MIN_KEYS:
        return 0
    seen = key_positions > query_positions.min() - window  # [B, Hkv, S]: visible to some query (none is future)
    leading = int((seen.cumsum(-1) == 0).sum(-1).min())  # unseen keys before each head's first seen one
    return leading if leading >= WINDOW_SLICE_MIN_KEYS else 0


def window_start(key_positions: torch.Tensor, query_position: torch.Tensor, spec: LayerSpec) -> int | None:
    """For one decode step in a sliding-window layer: the index from which every key of every KV
    head is inside the window (q − window < k ≤ q, `core.attention.position_mask`) while none
    before it is, or None when the visible keys are not such a common suffix of the buffer.

    key_positions `[B, Hkv, S]`, query_position `[1]`. The layers rocketkv builds keep a sliding
    window's tokens in position order, the same for every head, followed by the tail, so the
    window's start moves forward one token per step and the answer is a slice: exact attention
    over it needs no mask. Used on the CPU only (on a GPU its host reads would stall each step)."""
    assert spec.sliding_window is not None
    q = query_position.view(1, 1, 1)
    visible = (key_positions > q - spec.sliding_window) & (key_positions <= q)  # [B, Hkv, S]
    hidden = (~visible).sum(-1)  # [B, Hkv]
    start = int(hidden.max())
    if start >= visible.shape[-1] or int(hidden.min()) != start or not bool(visible[..., start:].all()):
        return None
    return start


def exact_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Exact attention of one new token `[B, H, 1, D]` over every cached key `[B, Hkv, S, D]`: all
    are in its past, so no mask. Returns `[B, H, 1, D]` in the query's dtype.

    On a GPU this is SDPA's fused decode kernel. On a CPU it is one matrix product per KV head for
    the scores and one grouped product for the values, the G = H / Hkv query heads of a GQA group
    multiplied by their KV head at once: SDPA's CPU kernel reads each KV head once per query head,
    and the keys and values of a decode step are read from memory, not cache (docs/performance.md,
    "Decode step"), and the scores are one product per KV head (`ops.cpu.key_logits`).
    Half-precision keys keep SDPA on a CPU too: a bfloat16 matmul would round the logits
    themselves (a step of 0.25 at a logit of 44), where SDPA keeps its scores in float32. Keys
    and values in another dtype than the query (a bfloat16 working set, `Engine.working_set_dtype`)
    take the query rounded to theirs and give the output back in the query's.
    `tests/test_step.py` compares both with `core.attention.exact_attention`.
    """
    b, h, _, d = query.shape
    hkv = keys.shape[1]
    if keys.device.type == "cpu" and query.dtype != keys.dtype:  # a bfloat16 working set
        # enable_gqa=True whatever H / Hkv (1 is a grouping too): `h != hkv` would be a SymBool, which
        # SDPA refuses, once the captured step (`model/captured.py`) compiles head counts symbolically
        out = F.scaled_dot_product_attention(query.to(keys.dtype), keys, values, scale=scaling, enable_gqa=True)
        return out.to(query.dtype)
    if keys.device.type != "cpu" or keys.dtype not in (torch.float32, torch.float64) or query.dtype != keys.dtype:
        return F.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=h != hkv)
    scores = ops.cpu.key_logits(query.view(b, hkv, h // hkv, d), keys)  # [B, Hkv, G, S]
    probs = torch.softmax(scores.mul_(scaling), dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(b, h, 1, values.shape[-1])


@contextlib.contextmanager
def rocketkv_attention(
    model: Any,
    cache: RocketCache,
    shape: ModelShape,
    decode: DecodeConfig | None = None,
    capture_from: int | None = None,
    hsa_from: int | None = None,
    reconstruct: Reconstruction | None = None,
    capture_sliding: bool = False,
    question: bool = False,
    question_scores: dict[int, torch.Tensor] | None = None,
) -> Iterator[_Session]:
    """Run `model` with rocketkv's attention over `cache` inside the block; restore it afterwards.

    decode: stage-2 settings for single-token steps (None = exact attention everywhere).
    capture_from: record full-attention layers' queries at positions ≥ this (stage-1 window);
        they appear in the yielded session's `captured[layer_idx]` as `[B, H, t, D]` float32 pieces
        (after RoPE); capture_sliding: sliding-window layers' queries too.
    hsa_from: teacher forcing, see `_teacher_forced`. reconstruct: full-attention layers attend
        through `ops.reconstruction_attention` and gather its weights into this record.
    question: a question's first prefill after the stored context (the tail holds only its
        tokens): full-attention layers attend through `ops.question_attention` and leave each
        layer's re-selection scores in the session's `question_scores[layer_idx]`, added to
        `question_scores` (the scores of the question's tokens prefilled before, not modified).
    """
    AttentionInterface.register(ATTN_NAME, _attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    session = _Session(cache=cache, shape=shape, decode=decode, capture_from=capture_from, hsa_from=hsa_from,
                       reconstruct=reconstruct, capture_sliding=capture_sliding,
                       question_scores=dict(question_scores or {}) if question else None)  # fmt: skip
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)
        model.set_attn_implementation(previous)


def attending(model: Any, session: _Session) -> bool:
    """Whether `session` (yielded by `rocketkv_attention`) is still the one `model` attends with: a
    generator that decodes inside the block and yields between steps finds, when resumed, another
    answer's session there if one was decoded while it was paused (two streams read in turn)."""
    return _SESSION.get() is session and model.config._attn_implementation == ATTN_NAME


@torch.inference_mode()
def forward_tokens(
    model: Any, cache: RocketCache, input_ids: torch.Tensor, positions: torch.Tensor, n_logits: int = 1
) -> torch.Tensor:
    """Run `input_ids` `[1, T]` at RoPE positions `positions` `[T]` int64 over `cache`.

    Must run inside `rocketkv_attention`. Only the last `n_logits` positions' logits are computed.
    Returns:
        `[1, V]` float32 logits of the last position (`[n_logits, V]` when n_logits > 1).
    Raises:
        ModelLoadError: a transformers version that ignored rocketkv's cache.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or positions.shape != (input_ids.shape[1],):
        raise ValueError(f"forward_tokens wants input_ids [1, T] and positions [T], got {tuple(input_ids.shape)}, "
                         f"{tuple(positions.shape)}")  # fmt: skip
    cache.query_positions = positions
    before = cache.layers[0].length
    out = model(input_ids=input_ids, position_ids=positions.unsqueeze(0), cache=cache, use_cache=True,
                logits_to_keep=n_logits)  # fmt: skip
    if cache.layers[0].length == before:  # an older transformers ignores `cache=` and would answer wrongly
        import transformers

        raise ModelLoadError(
            f"transformers {transformers.__version__} did not use rocketkv's cache",
            "install a supported version: pip install 'transformers>=5.24,<5.30'",
        )
    return out.logits[:, -1].float() if n_logits == 1 else out.logits[0].float()


class PlainDecoder:
    """Plain transformers over its own `DynamicCache`: the full-attention baseline `bench` times.

    `prefill(input_ids [1, T])` runs the whole prompt in one call; `decode_one_token(token)` one
    step. Both return the next greedy token id.
    """

    def __init__(self, model: Any):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> int:
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def decode_one_token(self, token: int) -> int:
        ids = torch.tensor([[token]], device=self.model.device)
        with decode_step():  # the same decode weights as rocketkv's own steps
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())
