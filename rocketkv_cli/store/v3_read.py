"""Reading formats v3–v5 (`read_v3`): the segments' table and ranges validated against the
metadata, each segment's token range read and verified at load, its KV range read and verified
when first used, and every stored tensor checked against the metadata (shapes, dtypes, finite
non-negative scales, positions) before a `LayerKV` is made of it. The layout is `v3.py`'s.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..core.cache import AnyCache, CacheInfo, LayerKV, SegmentedKVCache
from ..core.quant import alloc_stream_bytes
from ..core.storage import FLOAT_DTYPES, layer_part_names
from ..errors import CacheFormatError
from .header import TORCH_DTYPES, CacheFile, is_count, tensor_from
from .metadata import bounded, parse_budgets, positions_ok, segment_info, token_ids_ok
from .v3 import (
    ENTRY_FIELDS,
    LINE_RUNS,
    OFFSET_DTYPES,
    POSITION_DTYPES,
    TOKEN_FIELDS,
    FileSegment,
    _root,
    _table_digest,
    lines_from_runs,
)  # fmt: skip


def read_v3(f: CacheFile, header: dict, info: CacheInfo, rebuild: str) -> AnyCache:
    """The cache of a v3 or v4 file whose header and metadata are validated: tokens read and verified
    now, each segment's KV when first used. Raises CacheFormatError."""
    meta, shown, table = header["metadata"], f.shown, header["tensors"]
    if meta.get("tensors_sha256") != _table_digest(table):
        raise CacheFormatError(f"{shown} is damaged (tensor table digest mismatch)", rebuild)
    entries = _entries(meta, info.n_context_tokens, header["payload"], shown, rebuild)
    if meta["payload_sha256"] != _root(entries):
        raise CacheFormatError(f"{shown} is damaged (payload digest mismatch)", rebuild)
    by_segment: dict[int, dict[str, dict]] = {}
    for name, entry in table.items():
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "segments" or not parts[1].isdigit() or int(parts[1]) >= len(entries):
            raise CacheFormatError(f"{shown}: unexpected tensor {name!r}", rebuild)
        by_segment.setdefault(int(parts[1]), {})[parts[2]] = entry
    segments = []
    for j, entry in enumerate(entries):
        seg_info = info if len(entries) == 1 else segment_info(info, j, entry)
        where = f"segment {j} " if len(entries) > 1 else ""
        segments.append(_segment(f, header["base"], by_segment.get(j, {}), entry, seg_info, where, len(entries) > 1,
                                 rebuild))  # fmt: skip
    if len(segments) == 1:
        return segments[0]
    return SegmentedKVCache(info=info, segments=tuple(segments))


def _entries(meta: dict, n_ctx: int, payload: int, shown: str, rebuild: str) -> list[dict]:
    try:
        entries = json.loads(meta.get("segments", ""))
        if not isinstance(entries, list) or not 1 <= len(entries) <= 1 << 20:
            raise ValueError("segments")
        start, end = 0, 0
        for e in entries:
            if not isinstance(e, dict) or set(e) != set(ENTRY_FIELDS):
                raise ValueError("segment entry")
            if not all(isinstance(e[k], str) for k in ("ids_sha256", "kv_sha256", "tokens_sha256")):
                raise ValueError("segment entry")
            if not (is_count(e["n_context_tokens"]) and is_count(e["start_token"])) or e["n_context_tokens"] < 1:
                raise ValueError("segment entry")
            if e["start_token"] < start:
                raise ValueError("segment order")
            for part in ("kv", "tokens"):
                r = e[part]
                if not (isinstance(r, list) and len(r) == 2 and all(is_count(x) for x in r)) or r[0] != end:
                    raise ValueError("segment ranges")
                end = r[1]
            parse_budgets(e["budgets"])
            start = e["start_token"]
        if sum(e["n_context_tokens"] for e in entries) != n_ctx or end != payload:
            raise ValueError("segment lengths")
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CacheFormatError(f"{shown}: malformed metadata (segments)", rebuild) from exc
    return entries


def _read_range(f: CacheFile, base: int, rng: list[int], digest: str, what: str, rebuild: str) -> bytearray:
    """Bytes of a payload range, read privately and checked against their digest."""
    buf = f.read(base + rng[0], base + rng[1], rebuild)
    if hashlib.sha256(buf).hexdigest() != digest:
        raise CacheFormatError(f"{f.shown} is damaged ({what} digest mismatch)", rebuild)
    return buf


def _segment(f: CacheFile, base: int, names: dict[str, dict], entry: dict, info: CacheInfo, where: str,
             needs_ids: bool, rebuild: str) -> FileSegment:  # fmt: skip
    """One segment: its token tensors read and checked now, its KV behind a verified lazy loader."""
    shown = f.shown
    kv_names, tok_names = _expected_names(info)
    present = set(names) - {"kv_pad", "tokens_pad"}
    required = kv_names | ({"token_ids"} if needs_ids or info.segment is not None else set())
    if not required <= present <= kv_names | tok_names or {"kv_pad", "tokens_pad"} - set(names):
        raise CacheFormatError(f"{shown}: {where}tensors do not match the metadata", rebuild)
    for name, e in names.items():
        rng = entry["tokens"] if name in tok_names or name == "tokens_pad" else entry["kv"]
        if not rng[0] <= e["data_offsets"][0] <= e["data_offsets"][1] <= rng[1]:
            raise CacheFormatError(f"{shown}: {where}tensor {name!r} lies outside its range", rebuild)
    tok_buf = _read_range(f, base, entry["tokens"], entry["tokens_sha256"], f"{where}token", rebuild)
    tokens = {n: tensor_from(tok_buf, names[n]["data_offsets"][0] - entry["tokens"][0], names[n])
              for n in tok_names & set(names)}  # fmt: skip
    n = info.n_context_tokens
    ok = token_ids_ok(tokens.get("token_ids"), info, required="token_ids" in required)
    if LINE_RUNS in tokens:
        runs = tokens.pop(LINE_RUNS)
        lines = lines_from_runs(runs, n)
        ok = ok and lines is not None and "token_lines" not in tokens
        if lines is not None:
            tokens["token_lines"] = lines
    for name, dtype in TOKEN_FIELDS.items():
        t = tokens.get(name)
        allowed = OFFSET_DTYPES if name == "token_offsets" else (dtype,)
        ok = ok and (t is None or (t.dtype in allowed and t.shape == (n,)))
    if tokens.get("token_offsets") is not None:
        tokens["token_offsets"] = tokens["token_offsets"].to(torch.int64)
    if not ok:
        raise CacheFormatError(f"{shown}: {where}token tensors disagree with the metadata", rebuild)

    def stored() -> dict[str, torch.Tensor]:
        buf = _read_range(f, base, entry["kv"], entry["kv_sha256"], f"{where}KV", rebuild)
        return {f"{name}": tensor_from(buf, names[name]["data_offsets"][0] - entry["kv"][0], names[name])
                for name in kv_names}  # fmt: skip

    def layers() -> tuple[LayerKV, ...]:
        tensors = stored()
        out = tuple(_layer(tensors, i, info) for i in range(info.identity.n_layers))
        if any(layer is None for layer in out):
            raise CacheFormatError(f"{shown}: {where}layer tensors disagree with the metadata", rebuild)
        return out  # type: ignore[return-value]

    def check() -> None:  # what `layers` checks, without decoding the integer codes to float32
        tensors = stored()
        if not all(_checked(tensors, i, info) for i in range(info.identity.n_layers)):
            raise CacheFormatError(f"{shown}: {where}layer tensors disagree with the metadata", rebuild)

    seg = FileSegment(info, loader=layers, token_ids=tokens.get("token_ids"),
                      token_offsets=tokens.get("token_offsets"), token_lines=tokens.get("token_lines"))  # fmt: skip
    seg.stored_loader = stored
    seg.check = check
    seg.specs = {name: (_torch_dtype(names[name]["dtype"]), names[name]["shape"]) for name in kv_names}
    return seg


def _torch_dtype(st: str) -> torch.dtype:
    return TORCH_DTYPES[st]


def _expected_names(info: CacheInfo) -> tuple[set[str], set[str]]:
    parts = layer_part_names(info.storage) if info.storage.is_integer else ("keys", "values")
    kv = {f"layers.{i}.{p}" for i in range(info.identity.n_layers) for p in (*parts, "positions")}
    if (info.format_version or 0) >= 4:  # v4 stores lines as runs only
        return kv, {"token_ids", "token_offsets", LINE_RUNS}
    return kv, set(TOKEN_FIELDS)


def _layer(tensors: dict[str, torch.Tensor], i: int, info: CacheInfo) -> LayerKV | None:
    """Layer i from its stored tensors, or None when they disagree with the metadata."""
    if not _checked(tensors, i, info):
        return None
    positions = tensors[f"layers.{i}.positions"].to(torch.int64).unsqueeze(0)
    storage = info.storage
    if not storage.is_integer:
        k, v = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
        return LayerKV(k.unsqueeze(0), v.unsqueeze(0), positions)
    parts = {p: tensors[f"layers.{i}.{p}"] for p in layer_part_names(storage)}
    try:
        return LayerKV.from_stored(parts, positions, storage, info.identity.head_dim)
    except (ValueError, RuntimeError):  # anything the checks missed is still a refusal, never a crash
        return None


def _checked(tensors: dict[str, torch.Tensor], i: int, info: CacheInfo) -> bool:
    """Whether layer i's stored tensors agree with the metadata: positions, shapes, dtypes, float
    keys, values, scales, minimums and sinks finite and within `metadata.MAX_STORED_ABS`, non-negative scales,
    allocated key bits within their bytes."""
    n_kv, d, storage = info.identity.n_kv_heads, info.identity.head_dim, info.storage
    pos = tensors[f"layers.{i}.positions"]
    if pos.dtype not in POSITION_DTYPES or pos.dim() != 2:
        return False
    s = pos.shape[1]
    if not positions_ok(pos, n_kv, s, info.n_context_tokens):
        return False
    if not storage.is_integer:
        k, v = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
        want = FLOAT_DTYPES[storage.kv_dtype]
        if k.shape != (n_kv, s, d) or v.shape != (n_kv, s, d) or k.dtype != want or v.dtype != want:
            return False
        return bounded(k) and bounded(v)
    parts = {p: tensors[f"layers.{i}.{p}"] for p in layer_part_names(storage)}
    width = d // 2 if storage.bits == 4 else d
    gd = min(storage.value_group_dims, d)
    n_sinks = min(storage.sink_tokens, s)
    rest = s - n_sinks  # tokens in integer groups
    shapes: dict[str, tuple[int, ...]] = {"keys.q": (n_kv, rest, width), "values.q": (n_kv, rest, width),
              "keys.min": (n_kv, -(-rest // storage.key_group_tokens), d),
              "values.min": (n_kv, rest, -(-d // gd))}  # fmt: skip
    shapes["keys.scale"], shapes["values.scale"] = shapes["keys.min"], shapes["values.min"]
    if storage.sink_tokens:
        shapes["sinks.keys"] = shapes["sinks.values"] = (n_kv, n_sinks, d)
    if storage.rotation == "rope":
        shapes["keys.rope_freqs"] = (d // 2,)
    if storage.key_bits == "allocated":
        shapes["keys.bits"] = (n_kv, d)
        shapes["keys.q"] = (n_kv, alloc_stream_bytes(rest, d))
    for p, shape in shapes.items():
        t = parts[p]
        if t.shape != shape:
            return False
        if p == "keys.bits":  # each channel 1–8 bits, each head's codes within the int4 bytes it was given
            if t.dtype != torch.uint8 or bool(((t < 1) | (t > 8)).any()) or bool((t.long().sum(1) > 4 * d).any()):
                return False
        elif p.endswith(".q"):
            if t.dtype != torch.uint8:
                return False
        elif p == "keys.rope_freqs":
            if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
                return False
        elif t.dtype not in (torch.float16, torch.float32) or not bounded(t):  # scales, minimums, sinks
            return False
    if any(bool((parts[p] < 0).any()) for p in ("keys.scale", "values.scale")):
        return False
    return not (d % 2 and (storage.bits == 4 or storage.rotation == "rope"))  # no model has one; codes need pairs
