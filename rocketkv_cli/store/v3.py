"""Formats v3 and v4: every cache as segments (one or more), keys/values in their storage form (a
float dtype, or int8/int4 codes with group scales; v4: plus float16 sink tokens), positions (v3:
int32; v4: int16 where every position fits it, else int32), and per-token ids, character
offsets and lines (v4: lines as runs). This module defines the layout and writes v4 (v5 for
allocated key bits); `v3_read.py` reads v3–v5. Each segment's tensors occupy two contiguous byte
ranges — its KV, then its tokens — each with its own sha256 in the metadata, so a reader
verifies exactly the bytes it reads, when it reads them: `ask` on a book reads the token ranges
(for routing) and the KV of the segments it answers from only. The layout is plain safetensors
(8-byte aligned, no holes: each range is padded with a small `pad` tensor), written by hand:
docs/file-format.md says why not through the `safetensors` library.
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
from ..core.cache import AnyCache, CompressedKVCache
from ..core.storage import FLOAT_DTYPES
from ..errors import OutputError
from .atomic import atomic_write
from .header import FORMAT_NAME, MAX_HEADER_BYTES, ST_DTYPES, version_for
from .metadata import REQUIRED_METADATA, all_segments, info_metadata, metadata_digest, now

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
    check: Callable[[], None]  # reads the KV bytes and checks them as `layers` does, decoding nothing
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
