"""Checkpoints of a segmented ingest: each finished segment as a v1 `.kv` file in a hidden folder
beside the target, so that an interrupted ingest resumes where it stopped.

The folder also names the process writing into it (`owner`: pid and host), so that a folder
whose ingest is gone for good can be told from one in use (`abandoned_checkpoints`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..core.cache import CacheInfo, CompressedKVCache
from ..errors import CacheFormatError, OutputError
from .format import load_cache, save_cache
from .tempfiles import host_tag, pid_alive

FOLDER_SUFFIX = ".segments"
OWNER_FILE = "owner"


class Checkpoints:
    """Finished segments of an ingest into `target`, in `.TARGET.segments/` beside it.

    A checkpoint is reused only when it was built the same way (`same_build`: model identity,
    dtype, configuration, segment position and token ids' sha256), so a changed document or
    option re-prefills from the first differing segment.
    """

    def __init__(self, target: Path):
        self.dir = target.parent / f".{target.name}{FOLDER_SUFFIX}"
        self._claimed = False

    def _path(self, index: int) -> Path:
        return self.dir / f"{index:06d}.kv"

    def load(self, index: int, expected: CacheInfo) -> CompressedKVCache | None:
        """Checkpoint `index` when it exists, reads back whole and matches `expected`; else None."""
        path = self._path(index)
        if not path.is_file():
            return None
        try:
            part = load_cache(path)
        except CacheFormatError:  # e.g. the machine died mid-write of an older rocketkv: redo it
            return None
        if not isinstance(part, CompressedKVCache) or part.token_ids is None:
            return None
        return part if same_build(part.info, expected) else None

    def save(self, index: int, part: CompressedKVCache) -> CompressedKVCache:
        """Write `part` and return it memory-mapped from disk (its tensors leave RAM).

        Raises OutputError: the folder cannot be created or written."""
        try:
            self.dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the checkpoint folder {self.dir}: {exc.strerror}",
                              "choose a writable output directory, or remove what is in the way") from exc  # fmt: skip
        if not self._claimed:  # this process now owns the folder (see `abandoned_checkpoints`)
            (self.dir / OWNER_FILE).write_text(f"{os.getpid()} {host_tag()}\n")
            self._claimed = True
        save_cache(part, self._path(index), force=True)
        loaded = load_cache(self._path(index))
        if not isinstance(loaded, CompressedKVCache):
            raise CacheFormatError(f"checkpoint {self._path(index)} did not read back as one segment")
        return loaded

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def count(self) -> int:
        return len(list(self.dir.glob("*.kv"))) if self.dir.is_dir() else 0


def same_build(a: CacheInfo, b: CacheInfo) -> bool:
    """Whether two segment caches were built from the same tokens, model and settings."""
    return (a.identity == b.identity and a.dtype == b.dtype and a.config == b.config and a.segment == b.segment
            and a.document_sha256 == b.document_sha256)  # fmt: skip


@dataclass(frozen=True)
class AbandonedCheckpoints:
    """A checkpoint folder whose ingest is not running: `n_segments` finished segments (`n_bytes`
    on disk, last written at `modified`, seconds since the epoch) of an ingest into `target`."""

    folder: Path
    target: Path
    n_segments: int
    n_bytes: int
    modified: float


def abandoned_checkpoints(directory: Path) -> list[AbandonedCheckpoints]:
    """Checkpoint folders in `directory` that no running ingest owns (their owner's pid is gone
    from this host, or they name none), in name order. A rerun of the same ingest resumes from
    them; nothing else uses them."""
    found = []
    try:
        folders = sorted(p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(FOLDER_SUFFIX))
    except OSError:
        return []
    for folder in folders:
        if folder.is_symlink() or not folder.is_dir() or len(folder.name) <= 1 + len(FOLDER_SUFFIX):
            continue
        if _owner_running(folder / OWNER_FILE):
            continue
        try:
            files = [p.stat() for p in folder.iterdir() if p.is_file()]
            segments = len(list(folder.glob("*.kv")))
            modified = max([st.st_mtime for st in files] + [folder.stat().st_mtime])
        except OSError:
            continue
        target = directory / folder.name[1 : -len(FOLDER_SUFFIX)]
        found.append(AbandonedCheckpoints(folder, target, segments, sum(st.st_size for st in files), modified))
    return found


def _owner_running(owner: Path) -> bool:
    """Whether the process named in a folder's owner file is running (on this host; a folder
    owned on another host counts as running: it cannot be checked from here)."""
    try:
        pid, host = owner.read_text().split()
        return host != host_tag() or pid_alive(int(pid))
    except (OSError, ValueError):
        return False
