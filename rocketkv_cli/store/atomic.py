"""Atomic, no-clobber writes of rocketkv's files: a temporary file in the target's directory,
fsynced and renamed into place (the directory fsynced too), so an interrupted write leaves the old
file or none; an existing target is replaced only with `force`; a symlink at the target is
replaced, never written through. Standard library only (no torch): the command line checks
output paths with these functions before anything heavy is imported.

The temporary file is `.rocketkv-<pid>-<host>-<random>.tmp`. A process killed with SIGKILL (or a
machine that lost power) cannot remove it, so a later write into the same directory removes such
files when they are stale (`remove_stale_temp_files`): the pid they name is no longer running on
this host (or, as pids are reused, the file is untouched for REUSED_PID_AFTER_S), or — made on
another host sharing the directory, or by rocketkv 0.1.0 whose names carry no pid — untouched for
STALE_AFTER_S. Only files of that exact pattern owned by the current user are touched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import OutputError

TEMP_PREFIX = ".rocketkv-"
TEMP_SUFFIX = ".tmp"
STALE_AFTER_S = 24 * 3600.0  # untouched this long, a file whose maker cannot be checked is abandoned
REUSED_PID_AFTER_S = 7 * 24 * 3600.0  # a live pid this old is another process that reused it
# .rocketkv-<pid>-<host>-<random>.tmp (this version); .rocketkv-<random>.tmp (0.1.0: age only)
_TEMP_NAME = re.compile(r"^\.rocketkv-(?:(\d+)-([0-9a-f]{8})-)?[A-Za-z0-9_]+\.tmp$")


def check_target(target: Path, force: bool, flag: str = "-o") -> Path:
    """Refuse an output path rocketkv must not write (also called before a long ingest starts).

    flag: the option that named it, for the hints (`-o`, `--json`). Returns the target's
    directory. Raises OutputError: a directory, an existing file without
    `force`, a special file (device, FIFO, socket), or a missing directory.
    """
    if target.is_dir() and not target.is_symlink():
        raise OutputError(f"output path {target} is a directory", f"give a file name with {flag}")
    system = next((p for p in (Path(os.path.abspath(target)), Path(os.path.realpath(target)))
                   if p.parts[1:2] in (("proc",), ("sys",)) or (p.parts[1:2] == ("dev",) and len(p.parts) == 3)),
                  None)  # /dev/stdout, /dev/sda; a file on the /dev/shm tmpfs is a file  # fmt: skip
    if system is not None:  # /dev/stdout is a link that --force would replace (as root), not a stream to write
        raise OutputError(f"{target} is a system path ({system}); rocketkv writes to a file of its own",
                          f"name a file, e.g. {flag} {'doc.kv' if flag == '-o' else 'report.json'}")  # fmt: skip
    if (target.exists() or target.is_symlink()) and not force:
        raise OutputError(f"{target} already exists", "pass --force to replace it")
    if target.exists() and not target.is_symlink() and not target.is_file():
        raise OutputError(f"{target} is not a regular file; rocketkv will not replace it", f"choose another {flag}")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:  # `mkdir -p` would fail there
            raise OutputError(f"output directory {parent} cannot exist: {blocking} is a file", f"choose another {flag}")
        raise OutputError(f"output directory {parent} does not exist", f"create it first: mkdir -p {parent}")
    return parent


def atomic_write(target: Path, force: bool, write: Callable[[BinaryIO], object], flag: str = "-o") -> Path:
    """Write through `write(file)` into a temporary file beside `target`, fsync, then rename.
    flag: as `check_target`'s.

    The temporary file is named for this process (`make_temp_file`); stale ones left in the
    directory by killed runs are removed first (`remove_stale_temp_files`)."""
    parent = check_target(target, force, flag)
    remove_stale_temp_files(parent)
    try:
        fd, tmp = make_temp_file(parent)
    except OSError as exc:
        raise OutputError(
            f"cannot write in {parent}: {exc.strerror}", f"choose a writable directory with {flag}"
        ) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would stop sharing the cache
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, target)  # replaces a symlink itself, never the file it points to
        else:
            os.link(tmp, target)  # atomic no-clobber: fails if the target appeared meanwhile
            os.unlink(tmp)
    except FileExistsError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"{target} already exists", "pass --force to replace it") from exc
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {target}: {exc.strerror}") from exc
        raise
    try:  # make the rename durable; best effort (some filesystems refuse fsync on directories)
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large (a damaged owner file)
        return False
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


def is_stale(owner: tuple[str | None, ...], mtime: float, now: float) -> bool:
    """Whether a temporary file or folder whose name says `owner` = (pid, host tag), both None
    for a 0.1.0 name, and last modified at `mtime` is left from a run that is gone."""
    pid, host = owner
    age = now - mtime
    if pid is None or host != host_tag():
        return age > STALE_AFTER_S  # no pid, or another host's: only age can tell
    if int(pid) == os.getpid():
        return False
    return not pid_alive(int(pid)) or age > REUSED_PID_AFTER_S


def stale_entries(directory: Path, name: re.Pattern[str], is_kind: Callable[[int], bool]) -> list[Path]:
    """Entries of `directory` named by `name` (groups: maker pid, host tag), of the kind `is_kind`
    accepts (`stat.S_ISREG`, `stat.S_ISDIR`: symlinks are never followed), owned by this user,
    whose maker is gone (`is_stale`). An unreadable directory or entry is skipped."""
    now, found = time.time(), []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = name.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if is_kind(st.st_mode) and st.st_uid == os.getuid() and is_stale(match.groups(), st.st_mtime, now):
            found.append(Path(entry.path))
    return found


def stale_temp_files(directory: Path) -> list[Path]:
    """rocketkv temp files in `directory` whose maker is gone (see the module docstring)."""
    return stale_entries(directory, _TEMP_NAME, stat.S_ISREG)


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
