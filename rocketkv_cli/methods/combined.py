"""Two signals in one ranking: the tail window's attention and context reconstruction's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import LayerPrefill, register
from .tail import TailWindow

if TYPE_CHECKING:
    import torch


@register
@dataclass(frozen=True)
class Combined(TailWindow):
    """Each key scored by the larger of its two shares: of the attention the document's last
    `window_size` queries give (SnapKV++, RocketKV §3.2) and of the context-reconstruction scores
    (KVzip §3, `Engine.reconstruction_scores`), each divided by its own sum over the KV head's
    tokens so that neither scale dominates; then SnapKV++'s pooling and selection (the first tokens
    and the last W kept). A token either signal ranks high is kept: the tail window's recency and
    the re-reading's coverage of the whole text. Costs reconstruction's ingest time."""

    name = "combined"
    summary = "the larger share of the tail window's attention and of context reconstruction's (both ingest passes)"
    observation = "combined"
    capture = "reconstruct"

    def scores(self, layer: LayerPrefill) -> torch.Tensor:
        """`[1, Hkv, n]` float32: per KV head, max(tail / Σ tail, reconstruction / Σ reconstruction).

        Raises:
            ValueError: the prefill did not compute reconstruction scores (`Engine.prefill(reconstruct=True)`).
        """
        if layer.reconstruction is None:
            raise ValueError("context reconstruction scores were not computed (Engine.prefill(reconstruct=True))")
        return combine_shares(layer.observation_scores("tail", self.window_size), layer.reconstruction)


def combine_shares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise max of each score's share of its row: `[..., n]` non-negative float32 each, the
    same shape; a row summing to 0 contributes shares of 0. Returns `[..., n]` float32.

    Raises:
        ValueError: the shapes differ.
    """
    if a.shape != b.shape:
        raise ValueError(f"scores to combine must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    share_a = a / a.sum(-1, keepdim=True).clamp_min(1e-30)
    share_b = b / b.sum(-1, keepdim=True).clamp_min(1e-30)
    return share_a.float().maximum(share_b.float())
