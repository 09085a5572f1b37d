"""rocketkv's folders on disk: the checkpoint folder beside an ingest's target (which process
owns it, and which ones were abandoned by ingests that are gone), and private scratch folders.
Standard library only (no torch), so that the command line can report what killed ingests left
behind before anything heavy is imported.
"""

from __future__ import annotations

import fcntl
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


_CLAIMS: dict[Path, int] = {}  # folder → its owner file's descriptor, locked while this process writes there


def claim_folder(folder: Path) -> None:
    """Record this process as the one writing into `folder` (see `abandoned_checkpoints`), and hold
    an exclusive lock on its owner file until `release_folder` (or the process's end: a killed or
    crashed ingest leaves no lock behind, whatever host or pid it had). Claiming a folder this
    process holds does nothing.
    Raises OutputError: another process holds it (an ingest into the same file is running)."""
    if folder in _CLAIMS:
        return
    path = folder / OWNER_FILE
    if path.is_symlink():
        path.unlink()  # a link planted in its place is removed, never written through
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # a hard link planted there: never written through
        os.close(fd)
        path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: an ingest into the same file runs now
        os.close(fd)
        target = folder.parent / folder.name[1 : -len(CHECKPOINT_SUFFIX)]
        pid = _owner_pid(path)
        hint = "wait for it to finish (or stop it: a rerun resumes it), then run this again"
        raise OutputError(
            f"another rocketkv ingest{f' (pid {pid})' if pid else ''} is writing {target} now", hint
        ) from None
    try:
        same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        same = False
    if not same:  # the ingest that held it removed its folder meanwhile (`Checkpoints.release`): make it again
        os.close(fd)
        folder.mkdir(exist_ok=True)
        return claim_folder(folder)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {host_tag()}\n".encode(), 0)
    _CLAIMS[folder] = fd


def release_folder(folder: Path) -> None:
    """Let another process claim `folder` (an ingest that ended, finished or failed)."""
    fd = _CLAIMS.pop(folder, None)
    if fd is not None:
        os.close(fd)


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


def _owner(owner: Path) -> tuple[int, str] | None:
    """(pid, host tag) an owner file names; None: unreadable or malformed."""
    try:
        pid, host = owner.read_text().split()
        return int(pid), host
    except (OSError, ValueError):
        return None


def _owner_pid(owner: Path) -> int | None:
    """The pid an owner file names (None: unreadable)."""
    named = _owner(owner)
    return None if named is None else named[0]


def _owner_running(owner: Path) -> bool:
    """Whether the process named in a folder's owner file is running (on this host; a folder
    owned on another host counts as running: it cannot be checked from here)."""
    named = _owner(owner)
    return named is not None and (named[1] != host_tag() or pid_alive(named[0]))
