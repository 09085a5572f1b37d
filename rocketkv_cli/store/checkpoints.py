"""Checkpoints of a segmented ingest: each finished segment as a one-segment `.kv` file in a hidden folder
beside the target, so that an interrupted ingest resumes where it stopped.

The folder also names the process writing into it (`folders.claim_folder`: pid and host), so that a
folder whose ingest is gone for good can be told from one in use (`folders.abandoned_checkpoints`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..core.cache import CacheInfo, CompressedKVCache
from ..errors import CacheFormatError, OutputError
from .folders import AbandonedCheckpoints, abandoned_checkpoints, checkpoint_folder, claim_folder, release_folder
from .format import load_cache, save_cache, verify_file

__all__ = ["AbandonedCheckpoints", "Checkpoints", "abandoned_checkpoints", "same_build"]


class Checkpoints:
    """Finished segments of an ingest into `target`, in `.TARGET.segments/` beside it.

    A checkpoint is reused only when it was built the same way (`same_build`: model identity,
    dtype, configuration, segment position and token ids' sha256), so a changed document or
    option re-prefills from the first differing segment.
    """

    def __init__(self, target: Path):
        """Raises OutputError: the folder's name is taken by a symbolic link or a file (checkpoints
        are written only into a folder of rocketkv's own, never through a link planted there)."""
        self.dir = checkpoint_folder(target)
        self._claimed = False
        self._check_folder()

    def _check_folder(self) -> None:
        """Raises OutputError: the folder's name is a symbolic link or not a folder."""
        if self.dir.is_symlink() or (self.dir.exists() and not self.dir.is_dir()):
            what = "a symbolic link" if self.dir.is_symlink() else "not a folder"
            raise OutputError(f"the checkpoint folder {self.dir} is {what}; rocketkv writes an ingest's "
                              "checkpoints only into a folder of its own", f"remove {self.dir}")  # fmt: skip

    def _path(self, index: int) -> Path:
        return self.dir / f"{index:06d}.kv"

    def load(self, index: int, expected: CacheInfo) -> CompressedKVCache | None:
        """Checkpoint `index` when it exists, reads back whole and matches `expected`; else None."""
        path = self._path(index)
        if not path.is_file():
            return None
        try:
            part = verify_file(path)  # every byte checked now: a damaged checkpoint is redone, not used
        except CacheFormatError:  # e.g. the machine died mid-write of an older rocketkv: redo it
            return None
        if not isinstance(part, CompressedKVCache) or part.token_ids is None:
            return None
        return part if same_build(part.info, expected) else None

    def claim(self) -> None:
        """Make the folder and record this process as its writer, before the first segment's
        prefill: a second ingest into the same file, started while this one runs, is refused at
        once (both prefilled every segment before one of them failed).

        Raises OutputError: the folder cannot be created or written, or another running ingest
        writes into it."""
        try:
            self.dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the checkpoint folder {self.dir}: {exc.strerror}",
                              "choose a writable output directory, or remove what is in the way") from exc  # fmt: skip
        self._check_folder()
        if not self._claimed:  # this process now owns the folder (see `abandoned_checkpoints`)
            claim_folder(self.dir)
            self._claimed = True

    def save(self, index: int, part: CompressedKVCache) -> CompressedKVCache:
        """Write `part` and return it read back lazily from disk (its tensors leave RAM).

        Raises OutputError: the folder cannot be created or written."""
        self.claim()  # again before each write: a link planted during the prefill is refused too
        save_cache(part, self._path(index), force=True)
        loaded = load_cache(self._path(index), lazy=True)
        if not isinstance(loaded, CompressedKVCache):
            raise CacheFormatError(f"checkpoint {self._path(index)} did not read back as one segment")
        return loaded

    def release(self) -> None:
        """Give up the claim (`claim`): the ingest ended, finished or failed. A folder this process
        made that holds no finished segment (an ingest stopped during its first) goes too: there
        is nothing in it to resume, and `inspect` and `ingest` would name it as unfinished work."""
        if self._claimed and self.count() == 0:  # still ours: no other ingest can be writing into it
            shutil.rmtree(self.dir, ignore_errors=True)
        release_folder(self.dir)
        self._claimed = False

    def remove(self) -> None:
        """Delete the folder (the ingest's file is written), holding the claim while it does, so
        that no other ingest can have started writing into it; one left by an earlier run (an
        ingest that wrote no segment this time) is claimed first. A folder another running ingest
        holds is its own: left alone."""
        if not self._claimed and self.dir.is_dir():
            try:
                self.claim()
            except OutputError:
                return
        shutil.rmtree(self.dir, ignore_errors=True)
        self.release()

    def count(self) -> int:
        return len(list(self.dir.glob("*.kv"))) if self.dir.is_dir() else 0


def same_build(a: CacheInfo, b: CacheInfo) -> bool:
    """Whether two segment caches were built from the same tokens, model and settings."""
    return (a.identity == b.identity and a.dtype == b.dtype and a.config == b.config and a.segment == b.segment
            and a.document_sha256 == b.document_sha256 and a.storage == b.storage
            and a.weights == b.weights)  # fmt: skip
