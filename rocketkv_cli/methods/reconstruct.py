"""Context reconstruction (KVzip §3): keys scored while the model re-reads the document."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import LayerPrefill, register
from .tail import TailWindow

if TYPE_CHECKING:
    import torch


@register
@dataclass(frozen=True)
class Reconstruction(TailWindow):
    """Each key scored by the attention it gets while the model re-reads the whole document after
    a "repeat the text" request, teacher-forced over the full cache (`Engine.reconstruction_scores`;
    2.5–2.8× the tail window's ingest time), then SnapKV++'s pooling and selection (the first
    tokens and the last W kept)."""

    name = "reconstruct"
    summary = (
        "context reconstruction, attention while the model re-reads the document (KVzip; 2.5-2.8x the ingest time)"
    )
    observation = "reconstruct"
    capture = "reconstruct"
    eval_options = {"pool_kernel_size": "reconstruct_pool_kernel"}

    def scores(self, layer: LayerPrefill) -> torch.Tensor:
        """`[1, Hkv, n]` float32 reconstruction scores.

        Raises:
            ValueError: the prefill did not compute them (`Engine.prefill(reconstruct=True)`).
        """
        if layer.reconstruction is None:
            raise ValueError("context reconstruction scores were not computed (Engine.prefill(reconstruct=True))")
        return layer.reconstruction  # [1, Hkv, n]
