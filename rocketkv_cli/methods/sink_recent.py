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
        n_kv = layer.keys.shape[1]
        return sink_recent_select(layer.n_context_tokens, prompt_budget, self.n_sink_tokens, n_kv, layer.keys.device)


def sink_recent_select(
    n_tokens: int, prompt_budget: int, n_sink_tokens: int, n_kv_heads: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Indices a sink + recent-window baseline keeps (StreamingLLM-style, no scoring).

    The first `n_sink_tokens` tokens (at most half the budget) plus the most recent ones, so that
    `prompt_budget` tokens are kept; the same set for every KV head.
    Args:
        n_tokens: S, document tokens. prompt_budget, n_sink_tokens: tokens.
    Returns:
        `[1, Hkv, min(S, prompt_budget)]` int64, ascending.
    """
    import torch

    if n_tokens <= prompt_budget:
        kept = torch.arange(n_tokens, device=device)
    else:
        sinks = min(n_sink_tokens, prompt_budget // 2)
        recent = torch.arange(n_tokens - (prompt_budget - sinks), n_tokens, device=device)
        kept = torch.cat([torch.arange(sinks, device=device), recent])
    out = kept.expand(1, n_kv_heads, kept.shape[0]).contiguous()  # [1, Hkv, N]
    assert out.shape == (1, n_kv_heads, min(n_tokens, prompt_budget))
    return out
