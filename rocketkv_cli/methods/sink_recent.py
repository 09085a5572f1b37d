"""A StreamingLLM-style baseline: attention sinks plus the most recent tokens, nothing scored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import LayerPrefill, Stage1Method, register

if TYPE_CHECKING:
    import torch


@register
@dataclass(frozen=True)
class SinkRecent(Stage1Method):
    """The first `n_sink_tokens` tokens plus the most recent ones, the same kept count as SnapKV++
    (a baseline for `rocketkv eval`; StreamingLLM §3)."""

    name = "sink_recent"
    summary = "baseline: the first n_sink_tokens plus the most recent tokens (no scoring)"
    selection = "sink_recent"
    eval_options = {"n_sink_tokens": "n_sink_tokens"}
    eval_exact = True
    eval_key = "sink"

    n_sink_tokens: int

    def scores(self, layer: LayerPrefill) -> None:
        return None

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        from ..core.stage1 import sink_recent_select

        n_kv = layer.keys.shape[1]
        return sink_recent_select(layer.n_context_tokens, prompt_budget, self.n_sink_tokens, n_kv, layer.keys.device)
