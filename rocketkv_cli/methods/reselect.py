"""Per-question re-selection (docs/algorithm.md §4): SnapKV++ again at answer time, with the
question's own queries as the observation window, over a file that stores more than one
question's working set (`ingest --store-budget`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.config import auto_pool_kernel_size

if TYPE_CHECKING:
    import torch

    from ..core.cache import CompressedKVCache


@dataclass(frozen=True)
class Reselection:
    """Two-level budgets: each question keeps `prompt_budget` of the stored tokens per KV head,
    chosen by SnapKV++ scores of its own queries, max-pooled over `pool_kernel_size` stored tokens
    (odd; 1 = no pooling). The stored first `n_first_tokens` and last `window_size` tokens stay in
    every working set, as at ingest. All in tokens.

    Raises:
        ValueError: a budget, window or kernel that is not a positive integer, an even kernel, or a
            negative `n_first_tokens`.
    """

    prompt_budget: int
    window_size: int
    pool_kernel_size: int
    n_first_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_budget", "window_size", "pool_kernel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.pool_kernel_size % 2 == 0:
            raise ValueError(f"pool_kernel_size must be odd, got {self.pool_kernel_size}")
        if isinstance(self.n_first_tokens, bool) or not isinstance(self.n_first_tokens, int) or self.n_first_tokens < 0:
            raise ValueError(f"n_first_tokens must be a non-negative integer, got {self.n_first_tokens!r}")

    @classmethod
    def for_cache(cls, cache: CompressedKVCache) -> Reselection | None:
        """The re-selection a cache asks for: None unless it was stored with a store budget. Pooling
        follows the `auto` rule on the largest stored count (pooling runs over stored tokens, which
        are sparser than the document's)."""
        cfg, prompt_budget = cache.info.config, cache.info.budgets.prompt_budget
        if cfg.store_budget is None:
            return None
        kernel = auto_pool_kernel_size(max(layer.n_kept_tokens for layer in cache.layers))
        return cls(prompt_budget, cfg.window_size, kernel, cfg.n_first_tokens)  # select_kept_tokens fits them

    def keep(self, scores: torch.Tensor) -> torch.Tensor:
        """The working set from the question's scores of the stored keys `[1, Hkv, S]` float32 (S >
        prompt_budget): the attention its queries give them (softmax over the stored keys, summed
        over each GQA group's query heads and the question's tokens: `ops.question_attention`),
        max-pooled and ranked as SnapKV++ at ingest (RocketKV §3.2). Returns indices `[1, Hkv,
        prompt_budget]` int64, ascending."""
        from .. import ops

        return ops.snapkv_select(scores, self.prompt_budget, self.window_size, self.pool_kernel_size,
                                 self.n_first_tokens)  # fmt: skip


def reselection_for(cache: CompressedKVCache) -> Reselection | None:
    """`Reselection.for_cache(cache)`: the per-question re-selection a cache asks for, or None."""
    return Reselection.for_cache(cache)
