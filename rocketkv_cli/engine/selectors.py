"""Stage-1 methods: one small class per way of choosing the tokens a layer keeps.

Every selector gets the same `LayerPrefill` (one exact document prefill: the layer's keys, their
positions, the captured observation queries) and a prompt budget, and returns the kept indices,
so one prefill can feed every method and budget (`Engine.compress`). Scores go through the
kernel dispatch (`rocketkv_cli.ops`), exactly as at ingest. To add a method: a class with
`select`, and a branch in `selector_for`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .. import ops
from ..core.config import PrefillConfig, auto_pool_kernel_size
from ..core.stage1 import sink_recent_select


@dataclass
class LayerPrefill:
    """One full-attention layer after the document prefill.

    keys, values: `[1, Hkv, n + n_probe, D]` (the probe's after the document's), positions
    `[1, Hkv, n + n_probe]` int64. queries: `[1, H, n + n_probe − capture_from, D]` float32, the
    queries at positions capture_from … n + n_probe − 1. scaling, softcap: the layer's attention.
    Observation scores are memoised per (observation, window size), shared by budgets and kernels.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    n_context_tokens: int
    n_probe_tokens: int
    capture_from: int
    scaling: float
    softcap: float | None
    reconstruction: torch.Tensor | None = None  # [1, Hkv, n] context-reconstruction scores, when computed
    _scores: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def observation_scores(self, observation: str, window_size: int) -> torch.Tensor:
        """`[1, Hkv, n]` float32: attention mass of the last `window_size` document queries (plus
        the probe's, for "probe") on the document's keys (RocketKV §3.2, SnapKV §3)."""
        key = (observation, window_size)
        if key not in self._scores:
            n = self.n_context_tokens
            probe = self.n_probe_tokens if observation == "probe" else 0
            start = max(0, n - window_size)
            if start < self.capture_from:
                raise ValueError(f"window of {window_size} tokens starts before the captured queries")
            q = self.queries[:, :, start - self.capture_from : n + probe - self.capture_from]  # [1, H, W(+probe), D]
            q_pos = torch.arange(start, n + probe, device=self.keys.device)
            assert q.shape[2] == q_pos.shape[0], (q.shape, q_pos.shape)
            k = self.keys[:, :, : n + probe]  # a tail observation never sees the probe's keys
            scores = ops.observation_scores(q, k, q_pos, self.positions[0, 0, : n + probe], self.scaling,
                                            self.softcap)  # fmt: skip
            self._scores[key] = scores[..., :n]
        return self._scores[key]


class Selector(Protocol):
    """A stage-1 method: which `prompt_budget` tokens of a layer each KV head keeps."""

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        """Kept token indices `[1, Hkv, prompt_budget]` int64, ascending, for n > prompt_budget."""
        ...

    def scores(self, layer: LayerPrefill) -> torch.Tensor | None:
        """The raw scores `select` ranks `[1, Hkv, n]` float32 (before pooling), or None when it
        ranks nothing (adaptive layer budgets need them)."""
        ...


@dataclass(frozen=True)
class SnapKVSelector:
    """SnapKV++ (RocketKV §3.2): observation scores, max-pooled (kernel in tokens, odd; 0 = the
    `auto` rule by length), top (prompt_budget − first − W) plus the last W tokens, plus the first
    `n_first_tokens` tokens (sinks, framing, the document's opening: titles and instructions)."""

    window_size: int
    pool_kernel_size: int
    observation: str = "tail"
    n_first_tokens: int = 0

    def kernel(self, n_context_tokens: int) -> int:
        return self.pool_kernel_size or auto_pool_kernel_size(n_context_tokens)

    def scores(self, layer: LayerPrefill) -> torch.Tensor:
        return layer.observation_scores(self.observation, self.window_size)  # [1, Hkv, n]

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        kernel = self.kernel(layer.n_context_tokens)
        return ops.snapkv_select(self.scores(layer), prompt_budget, self.window_size, kernel, self.n_first_tokens)


@dataclass(frozen=True)
class ReconstructionSelector:
    """Context reconstruction (KVzip §3; `Engine.reconstruction_scores`): each key scored by the
    attention it gets while the model re-reads the document after a "repeat the text" request,
    then SnapKV++'s pooling and selection (first tokens and the last W kept)."""

    window_size: int
    pool_kernel_size: int
    n_first_tokens: int = 0

    def scores(self, layer: LayerPrefill) -> torch.Tensor:
        if layer.reconstruction is None:
            raise ValueError("context reconstruction scores were not computed (Engine.prefill(reconstruct=True))")
        return layer.reconstruction  # [1, Hkv, n]

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        kernel = self.pool_kernel_size or auto_pool_kernel_size(layer.n_context_tokens)
        return ops.snapkv_select(self.scores(layer), prompt_budget, self.window_size, kernel, self.n_first_tokens)


@dataclass(frozen=True)
class SinkRecentSelector:
    """A StreamingLLM-style baseline: the first `n_sink_tokens` plus the most recent tokens."""

    n_sink_tokens: int

    def scores(self, layer: LayerPrefill) -> None:
        return None

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        n_kv = layer.keys.shape[1]
        return sink_recent_select(layer.n_context_tokens, prompt_budget, self.n_sink_tokens, n_kv, layer.keys.device)


def selector_for(cfg: PrefillConfig) -> Selector:
    """The selector a configuration names (`cfg.selection`)."""
    if cfg.selection == "sink_recent":
        return SinkRecentSelector(cfg.n_sink_tokens)
    if cfg.observation == "reconstruct":
        return ReconstructionSelector(cfg.window_size, cfg.pool_kernel_size, cfg.n_first_tokens)
    return SnapKVSelector(cfg.window_size, cfg.pool_kernel_size, cfg.observation, cfg.n_first_tokens)


def pool_kernel_of(cfg: PrefillConfig, n_context_tokens: int) -> int:
    """The pooling kernel recorded for a cache built with `cfg` (the `auto` rule resolved)."""
    return cfg.pool_kernel_size or auto_pool_kernel_size(n_context_tokens)
