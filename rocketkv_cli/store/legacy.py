"""Reading `.kv` files of format v1 (one segment) and v2 (segments), as rocketkv 0.1.0 wrote them.

The whole payload is read into private memory and its digest (every tensor's name, dtype, shape
and bytes, in name order) checked on exactly those bytes before any tensor is used.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..core.cache import AnyCache, CacheInfo, CompressedKVCache, LayerKV, SegmentedKVCache
from ..errors import CacheFormatError
from .header import CacheFile, is_count, tensor_from
from .metadata import bounded, parse_budgets, positions_ok, segment_info, token_ids_ok

SEGMENT_FIELDS = ("n_context_tokens", "start_token", "budgets", "ids_sha256")


def read_legacy(f: CacheFile, header: dict, info: CacheInfo, rebuild: str) -> AnyCache:
    """The cache of a v1/v2 file whose header and metadata are already validated.

    Raises CacheFormatError: tensors that disagree with the metadata or their digest."""
    meta, shown = header["metadata"], f.shown
    version = info.format_version or 1
    entries = _segment_entries(meta, version, info.n_context_tokens, shown, rebuild)
    n_layers = info.identity.n_layers
    if len(header["tensors"]) > 4 * n_layers * len(entries):
        raise CacheFormatError(f"{shown}: tensors do not match n_layers={n_layers}", rebuild)
    prefixes = [""] if version == 1 else [f"segments.{j}." for j in range(len(entries))]
    expected = {f"{p}layers.{i}.{kind}" for p in prefixes for i in range(n_layers)
                for kind in ("keys", "values", "positions")}  # fmt: skip
    ids_names = {f"{p}token_ids" for p in prefixes}  # optional in v1, required in v2
    names = set(header["tensors"])
    if not expected <= names <= expected | ids_names or (version > 1 and not ids_names <= names):
        raise CacheFormatError(f"{shown}: tensors do not match n_layers={n_layers}", rebuild)
    payload = f.read(header["base"], header["base"] + header["payload"], rebuild)  # private copy
    tensors = {name: tensor_from(payload, header["tensors"][name]["data_offsets"][0], header["tensors"][name])
               for name in sorted(names)}  # fmt: skip
    if payload_digest(tensors) != meta["payload_sha256"]:
        raise CacheFormatError(f"{shown} is damaged (payload digest mismatch)", rebuild)
    parts = []
    for j, (prefix, entry) in enumerate(zip(prefixes, entries)):
        part_info = info if version == 1 else segment_info(info, j, entry)
        layers = tuple(_layer(tensors, f"{prefix}layers.{i}.", part_info) for i in range(n_layers))
        ids = tensors.get(f"{prefix}token_ids")
        if any(layer is None for layer in layers) or not token_ids_ok(ids, part_info, version > 1):
            where = f"segment {j} " if version > 1 else ""
            raise CacheFormatError(f"{shown}: {where}layer tensors disagree with the metadata", rebuild)
        parts.append(CompressedKVCache(part_info, layers, token_ids=ids))  # type: ignore[arg-type]
    if version == 1:
        return parts[0]
    return SegmentedKVCache(info=info, segments=tuple(parts))


def payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    """The v1/v2 payload digest: sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _segment_entries(meta: dict, version: int, n_ctx: int, path: str, rebuild: str) -> list[dict]:
    """The per-segment records of a v2 file (validated), or one record for a v1 file."""
    if version == 1:
        return [{"n_context_tokens": n_ctx}]
    try:
        entries = json.loads(meta.get("segments", ""))
        if not isinstance(entries, list) or not 2 <= len(entries) <= 1 << 20:
            raise ValueError("segments")
        start = 0
        for e in entries:
            if not isinstance(e, dict) or set(e) != set(SEGMENT_FIELDS) or not isinstance(e["ids_sha256"], str):
                raise ValueError("segment entry")
            if not (is_count(e["n_context_tokens"]) and is_count(e["start_token"])):
                raise ValueError("segment entry")
            if e["n_context_tokens"] < 1 or e["start_token"] < start:
                raise ValueError("segment entry")
            parse_budgets(e["budgets"])
            start = e["start_token"]
        if sum(e["n_context_tokens"] for e in entries) != n_ctx:
            raise ValueError("segment lengths")
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CacheFormatError(f"{path}: malformed metadata (segments)", rebuild) from exc
    return entries


def _layer(tensors: dict, prefix: str, info: CacheInfo) -> LayerKV | None:
    """One layer's `LayerKV` (`[1, Hkv, S, D]`, `[1, Hkv, S]`), or None when its tensors disagree
    with the metadata (shapes, dtype, positions) or hold a key or value that is no number within
    `metadata.MAX_STORED_ABS` (NaN, inf: answered as blank tokens)."""
    k, v, pos = (tensors[f"{prefix}{kind}"] for kind in ("keys", "values", "positions"))
    n_kv, head_dim = info.identity.n_kv_heads, info.identity.head_dim
    ok = (
        k.dim() == 3 and k.shape[0] == n_kv and k.shape[2] == head_dim and v.shape == k.shape
        and k.dtype == v.dtype and str(k.dtype).removeprefix("torch.") == info.dtype and pos.dtype == torch.int64
        and positions_ok(pos, n_kv, k.shape[1], info.n_context_tokens) and bounded(k) and bounded(v)
    )  # fmt: skip
    return LayerKV(k.unsqueeze(0), v.unsqueeze(0), pos.unsqueeze(0)) if ok else None
