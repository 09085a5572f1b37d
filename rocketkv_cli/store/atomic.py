"""Atomic, no-clobber writes of rocketkv's files: a temporary file in the target's directory,
fsynced and renamed into place (the directory fsynced too), so an interrupted write leaves the old
file or none; an existing target is replaced only with `force`; a symlink at the target is
replaced, never written through."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import OutputError


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


def atomic_write(target: Path, force: bool, write: Callable[[BinaryIO], object]) -> Path:
    """Write through `write(file)` into a temporary file beside `target`, fsync, then rename."""
    parent = check_target(target, force)
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".rocketkv-", suffix=".tmp")
    except OSError as exc:
        raise OutputError(f"cannot write in {parent}: {exc.strerror}", "choose a writable directory with -o") from exc
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
