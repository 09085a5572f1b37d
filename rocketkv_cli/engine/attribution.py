"""The scores that citations are built from: how much attention an answer paid each stored token.

While an answer is decoded, every full-attention layer adds the attention weights that the query
producing each answer token gives the stored tokens (`model.hf.AttentionMass`: exact softmax
weights over every cached key, summed over query heads, by RoPE position); the answer loop
(`answer.Answerer`) captures them and hands the scores below to a `Citer`, which turns them into
passages of the source (`api/citations.py`).

Scores (`token_scores`): per layer, the answer's weights are normalised to sum to 1 and divided
by those a generic question gives (`baseline_mass`: every query of `prompts/probe.txt`, prefilled
after the document), then averaged over layers: attention *this* answer pays a token beyond what
any question pays it. Without the baseline, SmolLM2's citations were the same few passages
whatever the question (docs/citations.md compares the two).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.cache import CompressedKVCache
from ..model.hf import AttentionMass, attention_mass
from ..model.templates import read_prompt

Citer = Callable[[torch.Tensor, torch.Tensor], tuple[Any, ...]]
"""Turns an answer's (scores, share), `[n_context_tokens]` each by stored position
(`token_scores`), into its citations, best first (`api.citations.citer`)."""


def baseline_mass(engine, decoder, cache: CompressedKVCache) -> AttentionMass:
    """The attention a generic question (`prompts/probe.txt`) gives the stored context: every
    query of its prefill over `decoder` (then reset to the stored context)."""
    decoder.reset()
    with attention_mass(cache.n_context_tokens, engine.loaded.device, queries="all") as base:
        try:
            with decoder.attention():
                decoder.prefill(engine.question_ids(read_prompt("probe.txt")))
        finally:
            decoder.reset()
    return base


def _normalised(mass: AttentionMass, layers: list[int]) -> torch.Tensor:
    m = torch.stack([mass.layers[i].float().cpu() for i in layers])  # [L_full, n]
    return m / m.sum(dim=1, keepdim=True).clamp(min=1e-30)


def token_scores(answer: AttentionMass, baseline: AttentionMass | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, share) `[n]` each: the ranking score of every stored position (see the module
    docstring; without a baseline, the mean normalised weight) and the answer's mean normalised
    weight (for the passages' shares)."""
    layers = sorted(answer.layers)
    if not layers:  # no full-attention layer saw the context
        zero = torch.zeros(answer.n_positions)
        return zero, zero
    p = _normalised(answer, layers)
    share = p.mean(dim=0)
    if baseline is None or sorted(baseline.layers) != layers:
        return share, share
    eps = 0.5 / answer.n_positions  # half a uniform weight: rarely attended tokens do not explode
    return (p / (_normalised(baseline, layers) + eps)).mean(dim=0), share
