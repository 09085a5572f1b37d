"""The model as rocketkv sees it, and the cache layer it plugs into transformers.

`model_shape` reads each layer's kind (full or sliding-window attention), scaling and soft-cap
and the head geometry from a loaded model (`ModelShape`); `rope_frequencies` its RoPE
frequencies. `RocketLayer` is a `CacheLayerMixin` holding the stored (pruned, read-only) context
plus a per-question tail in static buffers; `RocketCache` is the transformers `Cache` of them.
The attention function that reads these layers is in `hf.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from .. import ops
from ..core.cache import tensor_bytes
from ..errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")


@dataclass(frozen=True)
class LayerSpec:
    """Static facts of one attention layer."""

    scaling: float
    sliding_window: int | None  # tokens, None = full attention
    softcap: float | None


@dataclass(frozen=True)
class ModelShape:
    """What rocketkv needs to know of a decoder: per-layer specs and head geometry."""

    model_type: str
    layers: tuple[LayerSpec, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_context_tokens: int

    @property
    def full_layers(self) -> list[int]:
        return [i for i, spec in enumerate(self.layers) if spec.sliding_window is None]


def model_shape(model: Any) -> ModelShape:
    """Read layer kinds, scaling and head geometry from a loaded causal LM.

    Raises:
        ModelLoadError: an architecture outside `SUPPORTED_MODEL_TYPES`.
    """
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {cfg.model_type!r}; rocketkv supports {', '.join(SUPPORTED_MODEL_TYPES)}",
            "choose a model of a supported architecture with --model",
        )
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_types = {v.get("rope_type") for v in rope.values() if isinstance(v, dict)} | {rope.get("rope_type")}
    if rope_types & {"dynamic", "longrope"}:
        raise ModelLoadError(
            f"RoPE type {sorted(t for t in rope_types if t)} changes frequencies with the sequence length, which "
            "chunked prefill would get wrong",
            "use a model with default, linear, llama3 or yarn RoPE",
        )
    attn_modules = [layer.self_attn for layer in model.model.layers]
    specs = []
    for module in attn_modules:
        if hasattr(module, "sliding_window") or hasattr(module, "is_sliding"):
            window = getattr(module, "sliding_window", None)
            if window is None and getattr(module, "is_sliding", False):
                window = cfg.sliding_window
        else:  # Mistral, Phi-3: every layer gets config.sliding_window (transformers passes it per call)
            window = getattr(cfg, "sliding_window", None)
        specs.append(
            LayerSpec(
                scaling=float(module.scaling),
                sliding_window=int(window) if window else None,
                softcap=getattr(module, "attn_logit_softcapping", None),
            )
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelShape(
        model_type=cfg.model_type,
        layers=tuple(specs),
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        max_context_tokens=int(cfg.max_position_embeddings),
    )


def rope_frequencies(model: Any, head_dim: int) -> list[torch.Tensor | None]:
    """Each decoder layer's RoPE frequencies `[head_dim / 2]` float32 (radians per token), read
    from the model's rotary embedding (`inv_freq`, or Gemma 3's `{layer_type}_inv_freq`); None for
    a layer whose rotary embedding is not found or rotates only part of the head. Used by integer
    storage to quantize keys before RoPE (`core.quant.rope_rotate`); a wrong or missing one only
    costs precision, never correctness (the rotation is undone, to float32 rounding)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    layer_types = getattr(model.config, "layer_types", None)
    out: list[torch.Tensor | None] = []
    for i in range(len(model.model.layers)):
        freqs = None
        if rotary is not None:
            name = (
                f"{layer_types[i]}_inv_freq"
                if layer_types and hasattr(rotary, f"{layer_types[i]}_inv_freq")
                else "inv_freq"
            )
            freqs = getattr(rotary, name, None)
        ok = isinstance(freqs, torch.Tensor) and freqs.shape == (head_dim // 2,) and bool(torch.isfinite(freqs).all())
        out.append(freqs.detach().float().cpu() if ok else None)  # type: ignore[union-attr]
    return out


class RocketLayer(CacheLayerMixin):
    """One layer's KV cache: a stored context (read-only) followed by an appendable tail.

    Buffers: keys/values `[B, Hkv, capacity, D]`, positions `[B, Hkv, capacity]` int64 (original
    RoPE positions; each KV head may hold other tokens). `n_context` tokens are the stored part;
    `crop_to_context()` drops the tail (the per-question tokens) without touching the context.
    """

    is_croppable = True
    keys: torch.Tensor  # never None here: buffers are made in __init__
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, extra_tokens: int):
        super().__init__()
        b, hkv, s, d = keys.shape
        assert values.shape[:3] == (b, hkv, s) and positions.shape == (b, hkv, s), (keys.shape, positions.shape)
        cap = s + max(extra_tokens, 1)
        self.keys = keys.new_empty(b, hkv, cap, d)
        self.values = values.new_empty(b, hkv, cap, values.shape[-1])
        self.positions = positions.new_empty(b, hkv, cap)
        self.keys[:, :, :s] = keys
        self.values[:, :, :s] = values
        self.positions[:, :, :s] = positions
        self.length = s
        self.n_context = s
        self.is_initialized = True
        self._context_pages: tuple[int, torch.Tensor, torch.Tensor] | None = None
        # while a working set is selected: the stored context's buffers, token count and pages
        self._stored: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Any] | None = None
        self._working: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # a working set's buffers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # buffers are allocated in __init__

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> None:
        """Append `[B, Hkv, T, D]` keys/values at RoPE positions `[T]`, growing buffers if needed."""
        t = key_states.shape[2]
        if self.length + t > self.keys.shape[2]:
            grow = max(t, self.keys.shape[2] // 2)
            self.keys = torch.cat([self.keys, self.keys.new_empty(*self.keys.shape[:2], grow, self.keys.shape[3])], 2)
            self.values = torch.cat(
                [self.values, self.values.new_empty(*self.values.shape[:2], grow, self.values.shape[3])], 2
            )
            self.positions = torch.cat([self.positions, self.positions.new_empty(*self.positions.shape[:2], grow)], 2)
        end = self.length + t
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.positions[:, :, self.length : end] = positions.view(1, 1, t)
        self.length = end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("RocketLayer is updated through RocketCache.update, which supplies positions")

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Current keys `[B, Hkv, L, D]`, values, positions `[B, Hkv, L]` (views, no copy)."""
        n = self.length
        return self.keys[:, :, :n], self.values[:, :, :n], self.positions[:, :, :n]

    def context_pages(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page min/max `[B, Hkv, P, D]` of the stored context's keys (P = ceil(n_context /
        page_size)), built once: the context never changes while questions come and go."""
        if self._context_pages is None or self._context_pages[0] != page_size:
            pmin, pmax = ops.page_summaries(self.keys[:, :, : self.n_context], page_size)
            self._context_pages = (page_size, pmin, pmax)
        return self._context_pages[1], self._context_pages[2]

    def keep_last(self, n_tokens: int) -> None:
        """Keep only the last `n_tokens` (sliding-window layers during chunked prefill)."""
        if self.length <= n_tokens:
            return
        start = self.length - n_tokens
        for buf in (self.keys, self.values, self.positions):
            buf[:, :, :n_tokens] = buf[:, :, start : self.length].clone()
        self.length = n_tokens
        self.n_context = min(self.n_context, n_tokens)
        self._context_pages = None

    def select_context(self, kept: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Narrow the stored context to the tokens `kept` (`[B, Hkv, P]` int64 ascending indices
        into it, per KV head), the tail moved up behind them: a question's working set
        (re-selection). The working set is gathered into buffers of its own (reused from one
        question to the next), so the stored context is neither copied nor written;
        `crop_to_context()` switches back to it. dtype: the working set's keys and values are
        held in it (rounded once, here; the tokens appended later are rounded as they come);
        None = the stored context's dtype.

        Raises:
            ValueError: `kept` does not fit the layer's batch, KV heads or context.
        """
        b, hkv, p = kept.shape
        n, end = self.n_context, self.length
        if (b, hkv) != tuple(self.keys.shape[:2]) or p > n:
            raise ValueError(f"kept indices {tuple(kept.shape)} do not fit a context of {n} tokens")
        cap = p + self.keys.shape[2] - n  # the room for a tail the buffers had
        dtype = dtype or self.keys.dtype
        work = self._working
        if self._stored is not None or work is None or work[0].shape[2] < cap or work[0].dtype != dtype:
            work = (self.keys.new_empty(b, hkv, cap, self.keys.shape[3], dtype=dtype),  # fresh buffers
                    self.values.new_empty(b, hkv, cap, self.values.shape[3], dtype=dtype),
                    self.positions.new_empty(b, hkv, cap))  # fmt: skip
        for dst, src in zip(work, (self.keys, self.values, self.positions)):
            take_rows(src, kept, out=dst[:, :, :p])
            dst[:, :, p : p + end - n] = src[:, :, n:end]
        if self._stored is None:
            self._stored = (self.keys, self.values, self.positions, n, self._context_pages)
        self.keys, self.values, self.positions = work
        self.n_context, self.length = p, p + end - n
        self._context_pages = None

    def crop_to_context(self, keep_tail: int = 0) -> None:
        """Drop the tail: the cache is back to the stored context (all of it, after a
        `select_context`, whose buffers are kept for the next question), followed by the first
        `keep_tail` tail tokens (a prefix every question shares, appended before any
        `select_context`: the stored buffers still hold it).
        Raises ValueError: `keep_tail` outside [0, the room for a tail]."""
        if self._stored is not None:
            self._working = (self.keys, self.values, self.positions)
            self.keys, self.values, self.positions, self.n_context, self._context_pages = self._stored
            self._stored = None
        if not 0 <= keep_tail <= self.keys.shape[2] - self.n_context:
            raise ValueError(f"cannot keep {keep_tail} tail tokens after a context of {self.n_context}")
        self.length = self.n_context + keep_tail

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor this layer holds: its buffers, and while a working set is selected the
        stored context's (and its pages); a working set's buffers kept for the next question."""
        held = [self.keys, self.values, self.positions]
        pages, stored, working = self._context_pages, self._stored, self._working  # each read once: another
        # thread (a server's /health) may call this while a job swaps them
        for p in (pages, stored[4] if stored is not None else None):
            if p is not None:
                held += p[1:]
        if stored is not None:
            held += stored[:3]
        if working is not None:
            held += working
        return held

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1


def take_rows(buffer: torch.Tensor, kept: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`buffer[b, h, kept[b, h, i]]` for every i: rows `[B, Hkv, P, ...]` of a buffer `[B, Hkv, C, ...]`
    by indices `[B, Hkv, P]` int64 (< C), as one `index_select` of whole rows (a `gather` with an
    expanded index reads it element by element). out: `[B, Hkv, P, ...]` whose `out[b, h]` are
    contiguous (a working set's buffers, sliced along P): the rows are written there, one
    `index_select` per KV head, with no temporary (a question's re-selection gathers ~160 MB on
    SmolLM2; a temporary and its copy doubled that); an `out` of another dtype takes each head's
    rows converted, through one head's temporary."""
    if out is not None and buffer.device.type != "cpu":  # one launch, not one per KV head
        return out.copy_(take_rows(buffer, kept))
    if out is not None:
        for i in range(kept.shape[0]):
            for h in range(kept.shape[1]):
                if out.dtype == buffer.dtype:
                    torch.index_select(buffer[i, h], 0, kept[i, h], out=out[i, h])
                else:
                    out[i, h].copy_(torch.index_select(buffer[i, h], 0, kept[i, h]))
        return out
    b, hkv, c = buffer.shape[:3]
    base = torch.arange(b * hkv, device=buffer.device).view(b, hkv, 1) * c  # [B, Hkv, 1]: each head's first row
    rows = buffer.reshape(b * hkv * c, -1).index_select(0, (kept + base).flatten())
    return rows.view(*kept.shape, *buffer.shape[3:])


class RocketCache(Cache):
    """A transformers `Cache` of `RocketLayer`s; `query_positions` `[T]` is set before each forward."""

    layers: list[RocketLayer]  # type: ignore[assignment]  # only RocketLayers, never other kinds

    def __init__(self, layers: list[RocketLayer]):
        super().__init__(layers=list(layers))
        self.query_positions: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        layer.append(key_states, value_states, self.query_positions)
        keys, values, _ = layer.view()
        return keys, values

    @property
    def nbytes(self) -> int:
        """Bytes of memory the layers' buffers hold (`RocketLayer.buffers`, each storage once)."""
        return tensor_bytes(t for layer in self.layers for t in layer.buffers())

    def crop_to_context(self, keep_tail: int = 0) -> None:
        """Every layer back to its stored context plus its first `keep_tail` tail tokens."""
        for layer in self.layers:
            layer.crop_to_context(keep_tail)


def empty_cache(model: Any, shape: ModelShape, n_tokens: int) -> RocketCache:
    """A cache with no context, room for `n_tokens` per layer, on the model's device and dtype."""
    p = next(model.parameters())
    layers = []
    for spec in shape.layers:
        room = n_tokens if spec.sliding_window is None else min(n_tokens, spec.sliding_window + 4096)
        z = torch.empty(1, shape.n_kv_heads, 0, shape.head_dim, device=p.device, dtype=p.dtype)
        layers.append(RocketLayer(z, z, torch.empty(1, shape.n_kv_heads, 0, dtype=torch.long, device=p.device), room))
    return RocketCache(layers)
