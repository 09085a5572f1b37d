"""Reading and describing a `.kv` file without a model: torch and the file format only, never
transformers, so that `rocketkv inspect` and a cache's checks before a model loads start in
about the time torch takes to import.
"""

from __future__ import annotations

from pathlib import Path

from ..core.cache import AnyCache
from ..store.checkpoints import Checkpoints
from ..store.describe import describe as store_describe
from ..store.format import load_cache
from .preflight import check_cache_file


def read_cache(path: str | Path) -> AnyCache:
    """Load and validate a `.kv` file without a model. Raises CacheFormatError."""
    check_cache_file(path)
    return load_cache(path)


def describe(path: str | Path) -> dict:
    """What a `.kv` file holds (for `inspect`), validated; no model is loaded. Raises CacheFormatError."""
    check_cache_file(path)
    return store_describe(path)


def pending_checkpoints(output: Path) -> tuple[int, Path]:
    """(count, folder) of checkpointed segments an earlier, interrupted ingest into `output` left."""
    checkpoints = Checkpoints(output)
    return checkpoints.count(), checkpoints.dir
