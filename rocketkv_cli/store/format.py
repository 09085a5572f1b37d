"""The `.kv` cache file (docs/file-format.md): safetensors tensors + string metadata, validated on load.

The only place where a `CompressedKVCache` / `SegmentedKVCache` becomes bytes and strings, and
back: the entry points `save_cache`, `load_cache`, `read_metadata` and `verify_file`, which
dispatch by format version. What every version shares is below them: the safetensors framing and
header parser in `header.py`, the metadata ↔ `CacheInfo` conversion and its digest in
`metadata.py`. Formats v3–v5 are written by `v3.py` (v4, or v5 for allocated key bits) and read by
`v3_read.py`, v1/v2 files by `legacy.py`. Files are read into private memory (never
memory-mapped) and the digest is checked on exactly the bytes that are then used, so a file
changed or truncated under a reader gives a `CacheFormatError`, never a wrong answer or a signal.
Nothing read from a file is checked with `assert`.
"""

from __future__ import annotations

from pathlib import Path

from ..core.cache import AnyCache, CompressedKVCache, SegmentedKVCache
from ..errors import CacheFormatError
from .header import FORMAT_VERSION, MAX_HEADER_BYTES, CacheFile, parse_header, rebuild_hint, version_for
from .legacy import payload_digest, read_legacy
from .metadata import REQUIRED_METADATA, all_segments, metadata_digest, metadata_info
from .v3 import FileSegment, write_v3
from .v3_read import read_v3

__all__ = [  # the names callers import from here (the format's entry points)
    "FORMAT_VERSION", "MAX_HEADER_BYTES", "SegmentedKVCache", "all_segments", "load_cache", "metadata_digest",
    "metadata_info", "payload_digest", "read_metadata", "save_cache", "verify_file", "version_for",
]  # fmt: skip


def load_cache(path: str | Path, lazy: bool = False) -> AnyCache:
    """Load and validate a `.kv` file of any version (format, header bounds, shapes, digests).

    A one-segment v3/v4 file is read and verified now unless `lazy` (then, like every segment of a
    segmented v3/v4 file, its KV is read and verified when first used). Model compatibility is
    checked separately (`ModelIdentity.mismatch`). One segment gives a `CompressedKVCache`, several
    a `SegmentedKVCache`.
    Raises:
        CacheFormatError: not a rocketkv cache, newer format, truncated, damaged, inconsistent.
    """
    return _load(Path(path), str(path), lazy)[0]


def read_metadata(path: str | Path) -> dict[str, str]:
    """The validated string metadata of a `.kv` file. Raises CacheFormatError."""
    return _load(Path(path), str(path))[1]


def _load(p: Path, shown: str, lazy: bool = True) -> tuple[AnyCache, dict[str, str]]:
    if not p.is_file():
        raise CacheFormatError(f"cache file not found: {shown}", f"build one with: rocketkv ingest DOC -o {shown}")
    f = CacheFile(p, shown)
    header = parse_header(f, "give a .kv file written by: rocketkv ingest DOC -o FILE.kv")
    meta = header["metadata"]
    rebuild = rebuild_hint(meta, p)
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise CacheFormatError(f"{shown}: metadata lacks {', '.join(missing)}", rebuild)
    if not all(isinstance(v, str) for v in meta.values()) or metadata_digest(meta) != meta["metadata_sha256"]:
        raise CacheFormatError(f"{shown} is damaged (metadata digest mismatch)", rebuild)
    info = metadata_info(meta, shown, rebuild)
    if (info.format_version or 0) >= 3:
        cache = read_v3(f, header, info, rebuild)
        if not lazy and isinstance(cache, CompressedKVCache):
            cache.layers  # noqa: B018  (read and check the KV now)
        f.close()  # a lazy read reopens it
        return cache, meta
    cache = read_legacy(f, header, info, rebuild)
    f.close()
    return cache, meta


def save_cache(cache: AnyCache, path: str | Path, force: bool = False) -> Path:
    """Write `cache` (one or several segments) atomically to `path` in the current format (v4).

    Raises:
        OutputError: target exists without `force`, is a directory or special file, its directory
            is missing or not writable, or the header would be too large.
    """
    return write_v3(cache, Path(path), force)


def verify_file(path: str | Path) -> AnyCache:
    """`load_cache`, then read and check every segment's KV bytes now (not lazily): the file reads
    back whole. Returns the cache (its segments read again lazily on use). Raises CacheFormatError."""
    cache = load_cache(path, lazy=True)
    for seg in all_segments(cache):
        if isinstance(seg, FileSegment):
            seg.check()  # reads, checks the digest and every tensor against the metadata
        else:  # a legacy file's segment: read whole
            seg.layers  # noqa: B018
            seg.release()
    return cache
