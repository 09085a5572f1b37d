"""How stage 1 splits its budget over the full-attention layers: uniform, or adaptive by score mass."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import LayerPrefill, Stage1Method

if TYPE_CHECKING:
    from ..core.config import PrefillConfig


def layer_budgets(layers: list, cfg: PrefillConfig, method: Stage1Method, n_stored: int) -> dict[int, int]:
    """Tokens per KV head each full-attention layer stores, by layer index.

    layers: the prefill's layers (a `LayerPrefill` for each full-attention layer; others skipped).
    For `cfg.layer_budgets == "uniform"` (or a document of at most `n_stored` tokens) every layer
    stores `n_stored` (an empty map); for "adaptive", the same total (`n_stored` × layers) split
    by where `method`'s scores put each layer's attention mass (`core.stage1.allocate_layer_budgets`;
    docs/algorithm.md §2, step 5), never below the observation window plus the first tokens.

    Raises:
        ValueError: adaptive budgets with a method that scores nothing (`scores` returns None).
    """
    from ..core.stage1 import allocate_layer_budgets

    full = {i: layer for i, layer in enumerate(layers) if isinstance(layer, LayerPrefill)}
    if cfg.layer_budgets == "uniform" or not full:
        return {}
    if next(iter(full.values())).n_context_tokens <= n_stored:
        return {}
    scores = [method.scores(layer) for layer in full.values()]
    if any(s is None for s in scores):
        raise ValueError("adaptive layer budgets need a selector that scores tokens")
    counts = allocate_layer_budgets([s for s in scores if s is not None], n_stored, cfg.window_size,
                                    cfg.n_first_tokens)  # fmt: skip
    return dict(zip(full, counts))
