"""Formats v3 and v4: every cache as segments (one or more), keys/values in their storage form (a
float dtype, or int8/int4 codes with group scales; v4: plus float16 sink tokens), positions (v3:
int32; v4: int16 where every position fits it, else int32), and per-token ids, character
offsets and lines (v4: lines as runs). This module writes v4 and reads both. Each segment's
tensors occupy two contiguous byte ranges — its KV, then its tokens — each with its own sha256 in
the metadata, so a reader verifies exactly the bytes it reads, when it reads them: `ask` on a book
reads the token ranges (for routing) and the KV of the segments it answers from only. The layout
is plain safetensors (8-byte aligned, no holes: each range is padded with a small `pad` tensor).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from .. import __version__
from ..core.cache import AnyCache, CacheInfo, CompressedKVCache, LayerKV, SegmentedKVCache
from ..core.quant import FLOAT_DTYPES, alloc_stream_bytes, layer_part_names
from ..errors import CacheFormatError, OutputError
from .atomic import atomic_write
from .format import (
    FORMAT_NAME,
    MAX_HEADER_BYTES,
    REQUIRED_METADATA,
    ST_DTYPES,
    TORCH_DTYPES,
    CacheFile,
    all_segments,
    info_metadata,
    is_count,
    metadata_digest,
    now,
    parse_budgets,
    positions_ok,
    segment_info,
    tensor_from,
    token_ids_ok,
    version_for,
)  # fmt: skip

ENTRY_FIELDS = ("n_context_tokens", "start_token", "budgets", "ids_sha256", "kv", "kv_sha256", "tokens",
                "tokens_sha256")  # fmt: skip
TOKEN_FIELDS = {"token_ids": torch.int32, "token_offsets": torch.int32, "token_lines": torch.int32}
LINE_RUNS = "token_line_runs"  # v4: `[R, 2]` int32 (first token of a run, its line); v3 stored token_lines
POSITION_DTYPES = (torch.int16, torch.int32)
OFFSET_DTYPES = (torch.int32, torch.int64)  # offsets: int32 unless a document passes 2^31 characters
_PLACEHOLDER = "0" * 64  # digests are written after the payload, in place (same length)


class FileSegment(CompressedKVCache):
    """A segment of an open v3/v4 file: tokens read, KV read (and verified) on first use."""

    stored_loader: Callable[[], dict[str, torch.Tensor]]
    specs: dict[str, tuple[torch.dtype, list[int]]]


# -- writing ------------------------------------------------------------------------------------


def _kv_tensors(seg: CompressedKVCache) -> dict[str, torch.Tensor]:
    """The stored tensors of a segment's layers, by name (`layers.{i}.…`)."""
    if isinstance(seg, FileSegment):
        return seg.stored_loader()
    out = {}
    storage = seg.info.storage
    for i, layer in enumerate(seg.layers):
        if storage.is_integer:
            if layer.stored is None:
                raise ValueError(f"layer {i} has no {storage.kv_dtype} encoding")
            out.update({f"layers.{i}.{k}": t.contiguous() for k, t in layer.stored.items()})
        else:
            want = FLOAT_DTYPES[storage.kv_dtype]
            if layer.keys.dtype != want:
                raise ValueError(f"layer {i} holds {layer.keys.dtype}, the storage says {storage.kv_dtype}")
            out[f"layers.{i}.keys"] = layer.keys[0].contiguous()
            out[f"layers.{i}.values"] = layer.values[0].contiguous()
        out[f"layers.{i}.positions"] = layer.positions[0].to(position_dtype(layer.positions)).contiguous()
    return out


def position_dtype(positions: torch.Tensor) -> torch.dtype:
    """int16 when every position fits it (a segment of at most 2^15 tokens), else int32."""
    return torch.int16 if not positions.numel() or int(positions.max()) < 1 << 15 else torch.int32


def line_runs(lines: torch.Tensor) -> torch.Tensor:
    """Per-token lines `[n]` as runs `[R, 2]` int32: (first token of the run, its line), one row
    per change of line (a document token is about 1/10 of a line, so R ≪ n)."""
    change = torch.ones(lines.shape[0], dtype=torch.bool)
    change[1:] = lines[1:] != lines[:-1]
    starts = torch.nonzero(change).reshape(-1)
    return torch.stack([starts, lines[starts].to(torch.int64)], dim=1).to(torch.int32).contiguous()


def lines_from_runs(runs: torch.Tensor, n: int) -> torch.Tensor | None:
    """Per-token lines `[n]` int32 from `line_runs`'s rows, or None when they are not valid runs
    (starts from 0, strictly increasing, below n; lines ≥ 0)."""
    if runs.dtype != torch.int32 or runs.dim() != 2 or runs.shape[1] != 2 or not 1 <= runs.shape[0] <= n:
        return None
    starts, lines = runs[:, 0].to(torch.int64), runs[:, 1]
    if int(starts[0]) != 0 or int(starts[-1]) >= n or int(lines.min()) < 0:
        return None
    if runs.shape[0] > 1 and not bool((starts[1:] > starts[:-1]).all()):
        return None
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return torch.repeat_interleave(lines, lengths)


def _token_tensors(seg: CompressedKVCache) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype in TOKEN_FIELDS.items():
        t = getattr(seg, name)
        if t is None or not t.numel():
            continue
        if name == "token_lines":
            out[LINE_RUNS] = line_runs(t)
            continue
        if name == "token_offsets" and int(t.max()) >= 1 << 31:
            dtype = torch.int64
        out[name] = t.to(dtype).contiguous()
    return out


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, list[int]]]:
    return {name: (t.dtype, list(t.shape)) for name, t in tensors.items()}


def _ordered(specs: dict[str, tuple[torch.dtype, list[int]]]) -> list[str]:
    """Names by element size (largest first), then name: keeps every tensor aligned."""
    return sorted(specs, key=lambda n: (-torch.empty(0, dtype=specs[n][0]).element_size(), n))


def _nbytes(spec: tuple[torch.dtype, list[int]]) -> int:
    n = torch.empty(0, dtype=spec[0]).element_size()
    for d in spec[1]:
        n *= d
    return n


def write_v3(cache: AnyCache, target: Path, force: bool) -> Path:
    """Write `cache` as v3 to `target` atomically, one segment's tensors at a time (memory stays
    at one segment beyond the caches themselves). Raises OutputError (see `save_cache`)."""
    segments = all_segments(cache)
    if len(segments) > 1 and any(seg.token_ids is None for seg in segments):
        raise ValueError("segments of a long document need their token ids")
    plan, offset, entries = [], 0, []
    header: dict = {}
    for j, seg in enumerate(segments):
        kv_specs = seg.specs if isinstance(seg, FileSegment) else _specs(_kv_tensors(seg))
        tok_specs = _specs(_token_tensors(seg))
        ranges = []
        for part, specs in (("kv", kv_specs), ("tokens", tok_specs)):
            start = offset
            for name in _ordered(specs):
                size = _nbytes(specs[name])
                header[f"segments.{j}.{name}"] = {"dtype": ST_DTYPES[specs[name][0]], "shape": specs[name][1],
                                                  "data_offsets": [offset, offset + size]}  # fmt: skip
                offset += size
            pad = -offset % 8
            header[f"segments.{j}.{part}_pad"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            offset += pad
            ranges.append([start, offset])
        plan.append((seg, kv_specs, tok_specs))
        seg_meta = seg.info.segment
        entries.append({"n_context_tokens": seg.n_context_tokens, "start_token": seg_meta.start_token if seg_meta
                        else 0, "budgets": seg.info.budgets_record(), "ids_sha256": seg_meta.ids_sha256 if seg_meta
                        else "", "kv": ranges[0], "kv_sha256": _PLACEHOLDER, "tokens": ranges[1],
                        "tokens_sha256": _PLACEHOLDER})  # fmt: skip
    file_info = cache.info
    meta = info_metadata(file_info.with_(created_at=file_info.created_at or now(),
                                         segment=file_info.segment if len(segments) == 1 else None))  # fmt: skip
    meta.update(format=FORMAT_NAME, format_version=str(version_for(file_info.storage)), rocketkv_version=__version__,
                n_context_tokens=str(file_info.n_context_tokens), tensors_sha256=_table_digest(header))  # fmt: skip
    if len(segments) > 1:
        meta["n_context_tokens"] = str(sum(seg.n_context_tokens for seg in segments))

    def header_bytes() -> bytes:
        meta["segments"] = json.dumps(entries)
        meta["payload_sha256"] = _root(entries)
        meta["metadata_sha256"] = metadata_digest(meta)
        missing = [k for k in REQUIRED_METADATA if k not in meta]
        if missing:
            raise ValueError(f"metadata incomplete: {missing}")
        head = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
        return head + b" " * (-len(head) % 8)

    head_len = len(header_bytes())
    if head_len > MAX_HEADER_BYTES:
        raise OutputError(f"{len(segments)} segments make a file header of {head_len} bytes, over {MAX_HEADER_BYTES}",
                          "raise --segment-tokens (fewer, longer segments)")  # fmt: skip

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", head_len))
        f.write(b"\0" * head_len)  # the header is written last, once the digests are known
        for j, (seg, kv_specs, tok_specs) in enumerate(plan):
            for part, tensors in (("kv", _kv_tensors(seg)), ("tokens", _token_tensors(seg))):
                h = hashlib.sha256()
                specs = kv_specs if part == "kv" else tok_specs
                if _specs(tensors) != specs:
                    raise ValueError(f"segment {j} changed while being written")
                for name in _ordered(specs):
                    data = memoryview(tensors[name].detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
                    h.update(data)
                    f.write(data)
                pad = header[f"segments.{j}.{part}_pad"]["shape"][0]
                h.update(b"\0" * pad)
                f.write(b"\0" * pad)
                entries[j][f"{part}_sha256"] = h.hexdigest()
            seg.release()  # a segment read from a checkpoint leaves memory again
        head = header_bytes()
        if len(head) != head_len:
            raise ValueError("header length changed")
        f.seek(8)
        f.write(head)

    return atomic_write(target, force, write)


def _root(entries: list[dict]) -> str:
    """The payload digest of a v3/v4 file: sha256 over the segments' range digests, in order."""
    text = "".join(f"{e['kv_sha256']}{e['tokens_sha256']}" for e in entries)
    return hashlib.sha256(text.encode()).hexdigest()


def _table_digest(tensors: dict) -> str:
    """sha256 of the header's tensor table (names, dtypes, shapes, offsets), canonical JSON."""
    return hashlib.sha256(json.dumps(tensors, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# -- reading ------------------------------------------------------------------------------------


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

    seg = FileSegment(info, loader=layers, token_ids=tokens.get("token_ids"),
                      token_offsets=tokens.get("token_offsets"), token_lines=tokens.get("token_lines"))  # fmt: skip
    seg.stored_loader = stored
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
    n_kv, d, storage = info.identity.n_kv_heads, info.identity.head_dim, info.storage
    pos = tensors[f"layers.{i}.positions"]
    if pos.dtype not in POSITION_DTYPES or pos.dim() != 2:
        return None
    s = pos.shape[1]
    if not positions_ok(pos, n_kv, s, info.n_context_tokens):
        return None
    positions = pos.to(torch.int64).unsqueeze(0)
    if not storage.is_integer:
        k, v = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
        want = FLOAT_DTYPES[storage.kv_dtype]
        if k.shape != (n_kv, s, d) or v.shape != (n_kv, s, d) or k.dtype != want or v.dtype != want:
            return None
        return LayerKV(k.unsqueeze(0), v.unsqueeze(0), positions)
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
            return None
        if p == "keys.bits":  # each channel 1–8 bits, each head's codes within the int4 bytes it was given
            if t.dtype != torch.uint8 or bool(((t < 1) | (t > 8)).any()) or bool((t.long().sum(1) > 4 * d).any()):
                return None
        elif p.endswith(".q"):
            if t.dtype != torch.uint8:
                return None
        elif p == "keys.rope_freqs":
            if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
                return None
        elif t.dtype not in (torch.float16, torch.float32) or not bool(torch.isfinite(t).all()):
            return None
    if any(bool((parts[p] < 0).any()) for p in ("keys.scale", "values.scale")):
        return None
    if d % 2 and (storage.bits == 4 or storage.rotation == "rope"):  # no model has one; the codes need pairs
        return None
    try:
        return LayerKV.from_stored(parts, positions, storage, d)
    except (ValueError, RuntimeError):  # anything the checks above missed is still a refusal, never a crash
        return None
