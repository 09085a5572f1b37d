"""What `rocketkv inspect` shows of a `.kv` file: sizes, kept tokens, budgets and the metadata."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.cache import CompressedKVCache, SegmentedKVCache, full_kv_bytes
from .format import _load

INT_FIELDS = ("format_version", "n_layers", "n_kv_heads", "head_dim", "n_context_tokens")
JSON_FIELDS = ("config", "budgets", "layer_windows", "segments")


def describe(path: str | Path) -> dict:
    """Validate the file at `path` and describe it (sizes in bytes, token counts in tokens).

    Keys: cache, file_bytes, full_kv_bytes (the unpruned KV of the same document in the same
    dtype), kv_bytes (keys + values kept), kept_tokens_per_layer (summed over segments),
    n_full_attention_layers, n_segments, every metadata entry (numbers as ints, JSON entries
    parsed), and for a segmented file `segments` (per-segment records).
    Raises:
        CacheFormatError: as `load_cache`.
    """
    p = Path(path)
    cache, meta = _load(p, str(path))
    parts: tuple[CompressedKVCache, ...] = cache.segments if isinstance(cache, SegmentedKVCache) else (cache,)
    ident = cache.info.identity
    elem = parts[0].layers[0].keys.element_size()
    full = sum(full_kv_bytes(part.n_context_tokens, ident.layer_windows, ident.n_kv_heads, ident.head_dim, elem)
               for part in parts)  # fmt: skip
    kept = [sum(part.layers[i].n_kept_tokens for part in parts) for i in range(ident.n_layers)]
    info = {
        "cache": str(path),
        "file_bytes": p.stat().st_size,
        "full_kv_bytes": full,
        "kv_bytes": cache.kv_bytes,
        "kept_tokens_per_layer": kept,
        "n_full_attention_layers": len(ident.full_layers),
        "n_segments": len(parts),
        **{k: v for k, v in meta.items() if k not in JSON_FIELDS},
        **{k: json.loads(meta[k]) for k in JSON_FIELDS[:3]},
    }
    if len(parts) > 1:
        info["segments"] = json.loads(meta["segments"])
    for key in INT_FIELDS:
        info[key] = int(info[key])
    return info
