"""rocketkv's files on disk besides their format: output checks, temporary files and folders whose
names say who made them, the clean-up of those whose maker is gone, and checkpoint folders.
Standard library only (no torch), so that the command line can check paths before anything heavy
is imported.

A write goes to `.rocketkv-<pid>-<host>-<random>.tmp` beside its target and is renamed into place
(`format._atomic_write`); a process killed with SIGKILL (or a machine that lost power) cannot
remove it. A later run that writes into the same directory removes such files when they are
stale: the pid they name is no longer running on this host (or, as pids are reused, the file is
untouched for REUSED_PID_AFTER_S), or — made on another host sharing the directory, or by an
older rocketkv whose names carry no pid — untouched for STALE_AFTER_S. Only files of that exact
pattern owned by the current user are touched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError

TEMP_PREFIX = ".rocketkv-"
TEMP_SUFFIX = ".tmp"
STALE_AFTER_S = 24 * 3600.0  # untouched this long, a file whose maker cannot be checked is abandoned
REUSED_PID_AFTER_S = 7 * 24 * 3600.0  # a live pid this old is another process that reused it
# .rocketkv-<pid>-<host>-<random>.tmp (this version); .rocketkv-<random>.tmp (0.1.0: age only)
_TEMP_NAME = re.compile(r"^\.rocketkv-(?:(\d+)-([0-9a-f]{8})-)?[A-Za-z0-9_]+\.tmp$")
_DIR_NAME = re.compile(r"^rocketkv-(\d+)-([0-9a-f]{8})-[A-Za-z0-9_]+$")


def check_target(target: Path, force: bool) -> Path:
    """Refuse an output path rocketkv must not write (also called before a long ingest starts).

    Returns the target's directory. Raises OutputError: a directory, an existing file without
    `force`, a special file (device, FIFO, socket), or a missing directory.
    """
    if target.is_dir() and not target.is_symlink():
        raise OutputError(f"output path {target} is a directory", "give a file name with -o")
    if (target.exists() or target.is_symlink()) and not force:
        raise OutputError(f"{target} already exists", "pass --force to replace it")
    if target.exists() and not target.is_symlink() and not target.is_file():
        raise OutputError(f"{target} is not a regular file; rocketkv will not replace it", "choose another -o")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"output directory {parent} does not exist", f"create it first: mkdir -p {parent}")
    return parent


def host_tag() -> str:
    """8 hex digits naming this host (a pid means something only on the host that issued it)."""
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def owner_prefix() -> str:
    """`<pid>-<host>-`: the part of a temporary name that identifies its maker."""
    return f"{os.getpid()}-{host_tag()}-"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a process of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


def _stale(owner: tuple[str | None, ...], mtime: float, now: float) -> bool:
    """Whether a temporary file or folder whose name says `owner` = (pid, host tag), both None
    for a 0.1.0 name, and last modified at `mtime` is left from a run that is gone."""
    pid, host = owner
    age = now - mtime
    if pid is None or host != host_tag():
        return age > STALE_AFTER_S  # no pid, or another host's: only age can tell
    if int(pid) == os.getpid():
        return False
    return not pid_alive(int(pid)) or age > REUSED_PID_AFTER_S


def stale_temp_files(directory: Path) -> list[Path]:
    """rocketkv temp files in `directory` whose maker is gone (see the module docstring)."""
    now, found = time.time(), []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and _stale(match.groups(), st.st_mtime, now):
            found.append(Path(entry.path))
    return found


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Remove `stale_temp_files(directory)`; returns those removed (best effort: a file that
    cannot be removed is left, and so is anything that is not rocketkv's)."""
    removed = []
    for path in stale_temp_files(directory):
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def make_temp_file(directory: Path) -> tuple[int, str]:
    """A new, empty temp file in `directory` named for this process: (fd, path). Raises OSError."""
    return tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX + owner_prefix(), suffix=TEMP_SUFFIX)


def probe_writable(directory: Path) -> None:
    """Create and remove one temp file in `directory`: the check a write will pass, made before
    any long work. Raises OSError (EACCES for a read-only directory, ENOENT, EROFS …)."""
    fd, path = make_temp_file(directory)
    os.close(fd)
    os.unlink(path)


def make_scratch_dir() -> Path:
    """A private folder under the system temp directory named for this process (for work kept
    on disk but not wanted afterwards); stale ones of earlier, killed runs are removed first."""
    base = Path(tempfile.gettempdir())
    now = time.time()
    try:
        entries = list(os.scandir(base))
    except OSError:
        entries = []
    for entry in entries:
        match = _DIR_NAME.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _stale(match.groups(), st.st_mtime, now):
            shutil.rmtree(entry.path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix="rocketkv-" + owner_prefix(), dir=base))


# ---- checkpoint folders (`checkpoints.Checkpoints` writes them) --------------------------------

CHECKPOINT_SUFFIX = ".segments"
OWNER_FILE = "owner"


def checkpoint_folder(target: Path) -> Path:
    """The hidden folder beside `target` holding the checkpointed segments of an ingest into it."""
    return target.parent / f".{target.name}{CHECKPOINT_SUFFIX}"


def claim_folder(folder: Path) -> None:
    """Record this process as the one writing into `folder` (see `abandoned_checkpoints`)."""
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {host_tag()}\n")


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


def _owner_running(owner: Path) -> bool:
    """Whether the process named in a folder's owner file is running (on this host; a folder
    owned on another host counts as running: it cannot be checked from here)."""
    try:
        pid, host = owner.read_text().split()
        return host != host_tag() or pid_alive(int(pid))
    except (OSError, ValueError):
        return False
