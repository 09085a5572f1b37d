"""Prepared LM heads: `--weights head-int4`'s int4 copy and error-bound coefficients
(`CertifiedHead.prepared()`) read back from where an earlier load kept them (the loader's `kept`:
`store.prepared.PreparedTensors` under the rocketkv home), so that a fresh process reads them
(~0.1 s) instead of quantizing and bounding the head again (~1 s on Gemma 3 270M's
`[262144, 640]` head).

The key: the weight files' sha256 (`loading.weights_file_digest`), the head's dtype (the bounds
hold for those float weights), torch's version and the CPU capability torch dispatches to (the
int4 kernel's packed layout is torch's own). What is read back is checked by the store (its
digest) and again here (names, shapes, dtypes): the certificate's proof rests on these bounds.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .heads import CertifiedHead


class KeptTensors(Protocol):
    """Where prepared tensors are kept (`store.prepared.PreparedTensors`)."""

    def read(self, key: str) -> dict[str, torch.Tensor] | None: ...

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> None: ...


def head_key(weights_digest: str, dtype: torch.dtype) -> str:
    """The key of a model's prepared int4 head: its weight files' digest, the dtype its float head
    was loaded in, torch's version and the CPU capability."""
    capability = torch.backends.cpu.get_cpu_capability()
    return f"head-int4:{weights_digest}:{dtype}:torch {torch.__version__}:{capability}"


def certified_head(head: nn.Linear, weights_digest: str | None, kept: KeptTensors | None) -> CertifiedHead:
    """`CertifiedHead(head)`, its int4 copy and bounds read from `kept` when a load of the same
    weight files (`weights_digest`) kept them there, else computed and kept (nothing is kept for
    an in-memory model, `weights_digest` None, or without `kept`). Raises ValueError where
    `Int4Linear` cannot pack `head`."""
    if weights_digest is None or kept is None:
        return CertifiedHead(head)
    key = head_key(weights_digest, head.weight.dtype)
    found = kept.read(key)
    if found is not None:
        try:
            return CertifiedHead(head, prepared=found)
        except ValueError:
            pass  # kept for other shapes: compute it again below
    built = CertifiedHead(head)
    kept.write(key, built.prepared())
    return built
