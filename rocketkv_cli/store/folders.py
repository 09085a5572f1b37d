"""rocketkv's folders on disk: the checkpoint folder beside an ingest's target (which process
owns it, and which ones were abandoned by ingests that are gone), and private scratch folders.
Standard library only (no torch), so that the command line can report what killed ingests left
behind before anything heavy is imported.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from .atomic import host_tag, owner_prefix, pid_alive, stale_entries

_DIR_NAME = re.compile(r"^rocketkv-(\d+)-([0-9a-f]{8})-[A-Za-z0-9_]+$")


def make_scratch_dir() -> Path:
    """A private folder under the system temp directory named for this process (for work kept
    on disk but not wanted afterwards); stale ones of earlier, killed runs are removed first."""
    base = Path(tempfile.gettempdir())
    for stale in stale_entries(base, _DIR_NAME, stat.S_ISDIR):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix="rocketkv-" + owner_prefix(), dir=base))


CHECKPOINT_SUFFIX = ".segments"
OWNER_FILE = "owner"


def checkpoint_folder(target: Path) -> Path:
    """The hidden folder beside `target` holding the checkpointed segments of an ingest into it."""
    return target.parent / f".{target.name}{CHECKPOINT_SUFFIX}"


def claim_folder(folder: Path) -> None:
    """Record this process as the one writing into `folder` (see `abandoned_checkpoints`).
    Raises OutputError: another process that is running writes into it."""
    path = folder / OWNER_FILE
    if not path.is_symlink() and _owner_running(path) and _owner_pid(path) != os.getpid():
        target = folder.parent / folder.name[1 : -len(CHECKPOINT_SUFFIX)]
        raise OutputError(f"another rocketkv ingest (pid {_owner_pid(path)}) is writing {target} now",
                          "wait for it to finish (or stop it: its rerun resumes), then run this again")  # fmt: skip
    path.unlink(missing_ok=True)  # a link planted in its place is removed, never written through
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {host_tag()}\n")


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
        names = sorted(e.name for e in os.scandir(directory) if e.name.startswith("."))
    except OSError:
        return []
    for name in names:
        folder = directory / name
        if not name.endswith(CHECKPOINT_SUFFIX) or len(name) <= 1 + len(CHECKPOINT_SUFFIX):
            continue
        if folder.is_symlink() or not folder.is_dir() or _owner_running(folder / OWNER_FILE):
            continue
        try:
            files = [p.stat() for p in folder.iterdir() if p.is_file()]
            segments = len(list(folder.glob("*.kv")))
            modified = max([st.st_mtime for st in files] + [folder.stat().st_mtime])
        except OSError:
            continue
        target = directory / name[1 : -len(CHECKPOINT_SUFFIX)]
        found.append(AbandonedCheckpoints(folder, target, segments, sum(st.st_size for st in files), modified))
    return found


def _owner_pid(owner: Path) -> int | None:
    """The pid an owner file names (None: unreadable)."""
    try:
        return int(owner.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _owner_running(owner: Path) -> bool:
    """Whether the process named in a folder's owner file is running (on this host; a folder
    owned on another host counts as running: it cannot be checked from here)."""
    try:
        pid, host = owner.read_text().split()
        return host != host_tag() or pid_alive(int(pid))
    except (OSError, ValueError):
        return False
