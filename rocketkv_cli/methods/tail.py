"""SnapKV++ with the tail window: the default stage-1 method (RocketKV §3.2, SnapKV §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.config import auto_pool_kernel_size
from .base import LayerPrefill, Stage1Method, register

if TYPE_CHECKING:
    import torch


@register
@dataclass(frozen=True)
class TailWindow(Stage1Method):
    """Observation scores of the document's last `window_size` queries on its keys, max-pooled
    (`pool_kernel_size` tokens, odd; 0 = the `auto` rule by length); each KV head keeps the top
    (prompt_budget − first − W) plus the last W tokens and the first `n_first_tokens` tokens
    (attention sinks, the framing, the document's opening: titles and instructions)."""

    name = "tail"
    summary = "SnapKV++, attention of the document's last W queries"
    observation = "tail"

    window_size: int
    pool_kernel_size: int
    n_first_tokens: int = 0

    def kernel(self, n_context_tokens: int) -> int:
        """The pooling kernel in tokens for a document of `n_context_tokens` (`auto` resolved)."""
        return self.pool_kernel_size or auto_pool_kernel_size(n_context_tokens)  # as PrefillConfig.pool_kernel

    def scores(self, layer: LayerPrefill) -> torch.Tensor:
        return layer.observation_scores(type(self).observation or "tail", self.window_size)  # [1, Hkv, n]

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        from .. import ops

        kernel = self.kernel(layer.n_context_tokens)
        return ops.snapkv_select(self.scores(layer), prompt_budget, self.window_size, kernel, self.n_first_tokens)
