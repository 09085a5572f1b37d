"""What `rocketkv inspect` shows of a `.kv` file: sizes, storage, kept tokens, budgets, metadata."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.cache import AnyCache, CompressedKVCache, full_kv_bytes
from ..core.config import PrefillConfig
from .format import _load, all_segments, verify_file

INT_FIELDS = ("format_version", "n_layers", "n_kv_heads", "head_dim", "n_context_tokens")
JSON_FIELDS = ("config", "budgets", "layer_windows", "segments", "kv_storage")


def describe(path: str | Path) -> dict:
    """Validate every byte of the file at `path` and describe it (bytes, tokens).

    Keys: cache, file_bytes, full_kv_bytes (the unpruned KV of the same document in the model's
    dtype), kv_bytes (keys + values as stored, scales included), kv_dtype, kv_bytes_per_token
    (kv_bytes / n_context_tokens), kept_tokens_per_layer (summed over segments), layer_budgets
    ("uniform" or "adaptive", as `ingest --json` reports it), n_full_attention_layers, n_segments,
    every metadata entry (numbers as ints, JSON entries parsed; `kv_storage` as the reader took
    it, plus `sink_dtypes`, the dtypes its sink tokens are stored in), and for a segmented file
    `segments` (per-segment records).
    Raises:
        CacheFormatError: as `load_cache`, or any damaged byte.
    """
    p = Path(path)
    _, meta = _load(p, str(path))
    cache = verify_file(p)
    parts = all_segments(cache)
    ident = cache.info.identity
    elem = {"float64": 8, "float32": 4}.get(cache.info.dtype, 2)
    full = sum(full_kv_bytes(part.n_context_tokens, ident.layer_windows, ident.n_kv_heads, ident.head_dim, elem)
               for part in parts)  # fmt: skip
    kept = kept_tokens_per_layer(cache)
    kv_bytes = sum(_kv_bytes(part) for part in parts)
    info = {
        "cache": str(path),
        "file_bytes": p.stat().st_size,
        "full_kv_bytes": full,
        "kv_bytes": kv_bytes,
        "kv_dtype": cache.info.storage.kv_dtype,
        "kv_bytes_per_token": kv_bytes / cache.n_context_tokens,
        "kept_tokens_per_layer": kept,
        "n_full_attention_layers": len(ident.full_layers),
        "n_segments": len(parts),
        **{k: v for k, v in meta.items() if k not in JSON_FIELDS},
        **{k: json.loads(meta[k]) for k in ("config", "budgets", "layer_windows")},
    }
    # the config names layer_budgets only when it is not the default
    info["layer_budgets"] = info["config"].get("layer_budgets", PrefillConfig.layer_budgets)
    if "kv_storage" in meta:  # as the reader understood it (a float file's sink count reads as 0)
        info["kv_storage"] = cache.info.storage.to_dict()
        sink_dtypes = sorted({str(spec[0]).removeprefix("torch.") for part in parts
                              for name, spec in (_specs(part) or {}).items() if ".sinks." in name})  # fmt: skip
        info["kv_storage"]["sink_dtypes"] = sink_dtypes
    if len(parts) > 1:
        info["segments"] = json.loads(meta["segments"])
    for key in INT_FIELDS:
        info[key] = int(info[key])
    return info


def _specs(part: CompressedKVCache) -> dict | None:
    return getattr(part, "specs", None)


def kept_tokens_per_layer(cache: AnyCache) -> list[int]:
    """Tokens kept per KV head in each layer, summed over segments; read from the file's header
    for a lazily loaded cache (no payload is read)."""
    parts = all_segments(cache)
    return [sum(_kept(part)[i] for part in parts) for i in range(cache.info.identity.n_layers)]


def _kept(part: CompressedKVCache) -> list[int]:
    specs = _specs(part)
    if specs is None:
        return [layer.n_kept_tokens for layer in part.layers]
    return [specs[f"layers.{i}.positions"][1][1] for i in range(part.info.identity.n_layers)]


def _kv_bytes(part: CompressedKVCache) -> int:
    specs = _specs(part)
    if specs is None:
        return part.kv_bytes
    total = 0
    for name, (dtype, shape) in specs.items():
        if not name.endswith(".positions"):
            n = dtype.itemsize
            for d in shape:
                n *= d
            total += n
    return total
