"""Tensors a model prepares once and keeps: `--weights head-int4`'s int4 LM head and its bounds
(`model/prepared.py`), one safetensors file per key in a folder of the rocketkv home.

A file holds its key and the sha256 of its tensors (names, dtypes, shapes, bytes) in its
metadata; a file whose format, key or digest differ is treated as absent, never trusted, so a
damaged file costs a recomputation and is then written again. Writes are atomic
(`store.atomic.atomic_write`); a folder that cannot be written only costs the recomputation.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..errors import OutputError
from .atomic import atomic_write

FORMAT = "rocketkv.prepared v1"


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes())
    return h.hexdigest()


class PreparedTensors:
    """Named tensors kept in `folder`, one file per key (`<sha256 of key>.safetensors`)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"

    def read(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors written under `key`, copied into memory (a file changed later cannot reach
        them); None when missing, unreadable, or not exactly what was written for `key`."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path(key)), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("key") != key:
                    return None
                tensors = {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118 (no iteration)
        except (OSError, SafetensorError, ValueError, RuntimeError):
            return None
        return tensors if tensors_digest(tensors) == meta.get("sha256") else None

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` under `key` (replacing what was there); a failure to write is ignored."""
        from safetensors.torch import save

        meta = {"format": FORMAT, "key": key, "sha256": tensors_digest(tensors)}
        data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path(key), True, lambda f: f.write(data))
        except (OSError, OutputError):
            pass
