"""The `.kv` cache file (docs/file-format.md): safetensors tensors + string metadata, validated on load.

The only place where a `CompressedKVCache` / `SegmentedKVCache` becomes bytes and strings, and
back. Tensors per layer i: `layers.{i}.keys` / `layers.{i}.values` `[Hkv, n_kept, D]` and
`layers.{i}.positions` `[Hkv, n_kept]` int64 (original RoPE positions); v2 prefixes them with
`segments.{j}.`. No pickle, no torch.save. Writes are atomic (temporary file in the target
directory, fsync, rename); an existing target is replaced only with `force`, and a symlink at the
target is replaced, never written through. Nothing read from a file is checked with `assert`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from .. import __version__
from ..core.cache import CacheInfo, CompressedKVCache, LayerKV, ModelIdentity, SegmentedKVCache, SegmentInfo
from ..core.config import Budgets, PrefillConfig
from ..errors import CacheFormatError, OutputError
from .paths import check_target, make_temp_file, remove_stale_temp_files

FORMAT_NAME = "rocketkv.kv_cache"
FORMAT_VERSION = 2  # v1: one segment (`layers.*` tensors); v2: `segments.{j}.layers.*`
MAX_HEADER_BYTES = 100 << 20  # as safetensors itself
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "F64": 8}
_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
                 "I32": torch.int32, "F64": torch.float64}  # fmt: skip
_ST_DTYPES = {v: k for k, v in _TORCH_DTYPES.items()}
REQUIRED_METADATA = (
    "format", "format_version", "rocketkv_version", "model_id", "model_digest", "tokenizer_digest",
    "chat_template_digest", "dtype", "n_layers", "n_kv_heads", "head_dim", "n_context_tokens",
    "document_sha256", "config", "budgets", "layer_windows", "prompt_template_id", "created_at",
    "payload_sha256", "metadata_sha256",
)  # fmt: skip


SEGMENT_FIELDS = ("n_context_tokens", "start_token", "budgets", "ids_sha256")
BUDGET_FIELDS = ("prompt_budget", "capacity_budget", "topk", "page_size", "n_score_dims")


def info_metadata(info: CacheInfo) -> dict[str, str]:
    """The string metadata of `info` (everything but the format fields and digests)."""
    ident = info.identity
    meta = {
        "model_id": ident.model_id, "model_digest": ident.model_digest, "tokenizer_digest": ident.tokenizer_digest,
        "chat_template_digest": ident.chat_template_digest, "prompt_template_id": ident.prompt_template_id,
        "n_layers": str(ident.n_layers), "n_kv_heads": str(ident.n_kv_heads), "head_dim": str(ident.head_dim),
        "layer_windows": json.dumps(list(ident.layer_windows)), "dtype": info.dtype,
        "n_context_tokens": str(info.n_context_tokens), "document_sha256": info.document_sha256,
        "document_source": info.document_source, "config": json.dumps(info.config.to_dict(), sort_keys=True),
        "budgets": json.dumps(info.budgets_record(), sort_keys=True),
    }  # fmt: skip
    if info.segment is not None:
        meta.update(segment_index=str(info.segment.index), segment_start_token=str(info.segment.start_token),
                    segment_ids_sha256=info.segment.ids_sha256)  # fmt: skip
    if info.created_at:
        meta["created_at"] = info.created_at
    return meta


def _segment_entry(segment: CompressedKVCache) -> dict:
    """The per-segment record stored in a v2 file's `segments` metadata (JSON list)."""
    seg = segment.info.segment
    return {
        "n_context_tokens": segment.n_context_tokens,
        "start_token": seg.start_token if seg else 0,
        "budgets": segment.info.budgets_record(),
        "ids_sha256": seg.ids_sha256 if seg else "",
    }


def _tensors(cache: CompressedKVCache) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(cache.layers):
        out[f"layers.{i}.keys"] = layer.keys[0].contiguous()
        out[f"layers.{i}.values"] = layer.values[0].contiguous()
        out[f"layers.{i}.positions"] = layer.positions[0].to(torch.int64).contiguous()
    if cache.token_ids is not None:
        out["token_ids"] = cache.token_ids.to(torch.int32).contiguous()
    return out


def payload_digest(tensors: dict[str, torch.Tensor], after_each=lambda name: None) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order (`after_each(name)`
    runs after each tensor, e.g. to release the memory-mapped pages just read)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
        after_each(name)
    return h.hexdigest()


def release_pages(mapping) -> None:
    """Drop a read-only file mapping's resident pages from this process (they stay in the page
    cache and fault back in when read), so reading a big cache once does not keep it in RSS."""
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def metadata_digest(meta: dict[str, str]) -> str:
    """sha256 of every metadata entry but `metadata_sha256` itself (sorted JSON)."""
    body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _finish_metadata(
    meta: dict[str, str], tensors: dict[str, torch.Tensor], version: int, after_each: Callable[[str], None]
) -> dict[str, str]:
    meta = dict(meta)
    meta.update(
        format=FORMAT_NAME,
        format_version=str(version),
        rocketkv_version=__version__,
        created_at=meta.get("created_at") or _now(),
        payload_sha256=payload_digest(tensors, after_each),
    )
    meta["metadata_sha256"] = metadata_digest(meta)
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise ValueError(f"metadata incomplete: {missing}")
    return meta


def save_cache(cache: CompressedKVCache, path: str | Path, force: bool = False) -> Path:
    """Write a one-segment `cache` (format v1) atomically to `path`.

    Raises:
        OutputError: target exists without `force`, is a directory, or its directory is missing
            or not writable.
    """
    tensors = {k: v.detach().cpu() for k, v in _tensors(cache).items()}
    meta = _finish_metadata(info_metadata(cache.info), tensors, 1, lambda name: None)
    data = st_save(tensors, metadata=meta)
    return _atomic_write(Path(path), force, lambda f: f.write(data))


def save_segmented(cache: SegmentedKVCache, path: str | Path, force: bool = False) -> Path:
    """Write a multi-segment cache (format v2) atomically to `path`, streaming tensor by tensor.

    The segments may be memory-mapped checkpoints (`load_cache` results): memory stays at one
    tensor beyond the maps, whatever the file size. Tensors are named
    `segments.{j}.layers.{i}.{kind}`; each segment's `token_ids` (required here) go in
    `segments.{j}.token_ids`. The layout is plain safetensors (contiguous, 8-byte dtypes first).
    The metadata is the file's `info` plus the `segments` list (see `_segment_entry`).
    Raises:
        OutputError: as `save_cache`, or a header over MAX_HEADER_BYTES.
        ValueError: a segment without token ids, or in another dtype than `cache.info`.
    """
    segments = cache.segments
    if any(seg.token_ids is None for seg in segments):
        raise ValueError("segments need their token ids")
    dtypes = {str(seg.layers[0].keys.dtype).removeprefix("torch.") for seg in segments}
    if dtypes != {cache.info.dtype}:
        raise ValueError(f"segments in {dtypes}, the cache says {cache.info.dtype}")
    tensors = {f"segments.{j}.{name}": t for j, seg in enumerate(segments) for name, t in _tensors(seg).items()}
    maps = {f"segments.{j}.{name}": seg.mapping for j, seg in enumerate(segments) for name in _tensors(seg)}
    release = lambda name: release_pages(maps[name])  # noqa: E731  (memory stays one tensor, not the book)
    meta = info_metadata(cache.info.with_(created_at=None, segment=None))
    meta["segments"] = json.dumps([_segment_entry(seg) for seg in segments])
    meta["n_context_tokens"] = str(sum(seg.n_context_tokens for seg in segments))
    meta = _finish_metadata(meta, tensors, 2, release)
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": meta}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    if len(head) > MAX_HEADER_BYTES:
        raise OutputError(
            f"{len(segments)} segments make a file header of {len(head)} bytes, over {MAX_HEADER_BYTES}",
            "raise --segment-tokens (fewer, longer segments)",
        )

    def write(f) -> None:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in order:
            t = tensors[name].contiguous()
            if t.numel():
                f.write(t.view(torch.uint8).reshape(-1).numpy().tobytes())
            release(name)

    return _atomic_write(Path(path), force, write)


def _atomic_write(target: Path, force: bool, write) -> Path:
    """Write through `write(file)` into a temporary file beside `target`, fsync, then rename.

    The temporary file is named for this process (`paths.make_temp_file`); stale ones left in
    the directory by killed runs are removed first (`paths.remove_stale_temp_files`)."""
    parent = check_target(target, force)
    remove_stale_temp_files(parent)
    try:
        fd, tmp = make_temp_file(parent)
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


def _parse_header(buf: mmap.mmap | bytes, path: Path, rebuild: str) -> dict:
    """Parse and bound-check the safetensors header of `buf` before any tensor is made."""
    size = len(buf)
    if size < 8:
        raise CacheFormatError(f"{path} is not a rocketkv cache (too short)", rebuild)
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise CacheFormatError(f"{path} is not a rocketkv cache (bad header length)", rebuild)
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CacheFormatError(f"{path} is not a rocketkv cache (unreadable header)", rebuild) from exc
    if not isinstance(header, dict):
        raise CacheFormatError(f"{path} is not a rocketkv cache (unreadable header)", rebuild)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{path} is a safetensors file but not a rocketkv cache", rebuild)
    rebuild = rebuild_hint(meta, path)  # from here on it is a damaged rocketkv cache
    payload = size - 8 - n
    end = 0
    for name, info in header.items():
        expected = _described_bytes(info)
        if expected is None:
            raise CacheFormatError(f"{path}: tensor {name!r} is described wrongly in the header", rebuild)
        start, stop = info["data_offsets"]
        if not (start <= stop <= payload) or stop - start != expected:
            raise CacheFormatError(f"{path} is truncated or damaged (tensor {name!r})", rebuild)
        end = max(end, stop)
    if end != payload:
        raise CacheFormatError(f"{path} is truncated or damaged (payload size)", rebuild)
    return {"tensors": header, "metadata": meta, "base": 8 + n}


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _described_bytes(info: Any) -> int | None:
    """Bytes a header entry says its tensor has, or None when the entry is malformed."""
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPE_BYTES:
        return None
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if not all(_is_count(x) for x in (*shape, *offsets)):
        return None
    return _DTYPE_BYTES[info["dtype"]] * math.prod(shape)


def rebuild_hint(meta: dict, path: Path) -> str:
    """The command that rebuilds a (damaged) cache, naming its document when the metadata says."""
    source = meta.get("document_source") if isinstance(meta.get("document_source"), str) else None
    return f"rebuild it with: rocketkv ingest {source or 'DOC'} -o {path} --force"


def _map_file(p: Path, path: str | Path) -> mmap.mmap | bytes:
    """Memory-map the file once: header and tensors then come from the same inode, even if the
    path is replaced meanwhile (a concurrent ingest), and tensors are views, not copies."""
    try:
        with open(p, "rb") as f:
            try:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # empty file
                return b""
    except OSError as exc:
        raise CacheFormatError(f"cannot read cache {path}: {exc.strerror}") from exc


def _tensor(buf, base: int, info: dict) -> torch.Tensor:
    """Zero-copy view `[shape]` of one tensor's bytes in `buf` (read-only; never written)."""
    dtype = _TORCH_DTYPES[info["dtype"]]
    start, stop = info["data_offsets"]
    if stop == start:
        return torch.empty(info["shape"], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the mapping is read-only, and so is our use
        flat = torch.frombuffer(
            buf, dtype=dtype, count=(stop - start) // _DTYPE_BYTES[info["dtype"]], offset=base + start
        )
    return flat.view(info["shape"])


def load_cache(path: str | Path) -> CompressedKVCache | SegmentedKVCache:
    """Load and validate a `.kv` file (format, version, header bounds, shapes, digests).

    Tensors are zero-copy views of a read-only memory map of the file. Model compatibility is
    checked separately (`ModelIdentity.mismatch`). A v1 file gives a `CompressedKVCache`, a v2
    file (a document in segments) a `SegmentedKVCache`.
    Raises:
        CacheFormatError: not a rocketkv cache, newer format, truncated, damaged, inconsistent.
    """
    return _load(Path(path), str(path))[0]


def read_metadata(path: str | Path) -> dict[str, str]:
    """The validated string metadata of a `.kv` file (for `inspect`). Raises CacheFormatError."""
    return _load(Path(path), str(path))[1]


def _load(p: Path, path: str) -> tuple[CompressedKVCache | SegmentedKVCache, dict[str, str]]:
    if not p.is_file():
        raise CacheFormatError(f"cache file not found: {path}", f"build one with: rocketkv ingest DOC -o {path}")
    buf = _map_file(p, path)
    header = _parse_header(buf, p, "give a .kv file written by: rocketkv ingest DOC -o FILE.kv")
    meta = header["metadata"]
    rebuild = rebuild_hint(meta, p)
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise CacheFormatError(f"{path}: metadata lacks {', '.join(missing)}", rebuild)
    if not all(isinstance(v, str) for v in meta.values()) or metadata_digest(meta) != meta["metadata_sha256"]:
        raise CacheFormatError(f"{path} is damaged (metadata digest mismatch)", rebuild)
    info = _info(meta, path, rebuild)
    version = info.format_version or 1
    segments = _segment_entries(meta, version, info.n_context_tokens, path, rebuild)
    n_layers = info.identity.n_layers
    if len(header["tensors"]) > 4 * n_layers * len(segments):
        raise CacheFormatError(f"{path}: tensors do not match n_layers={n_layers}", rebuild)
    prefixes = [""] if version == 1 else [f"segments.{j}." for j in range(len(segments))]
    expected = {
        f"{p}layers.{i}.{kind}" for p in prefixes for i in range(n_layers) for kind in ("keys", "values", "positions")
    }
    ids_names = {f"{p}token_ids" for p in prefixes}  # optional in v1, required in v2
    names = set(header["tensors"])
    if not expected <= names <= expected | ids_names or (version > 1 and not ids_names <= names):
        raise CacheFormatError(f"{path}: tensors do not match n_layers={n_layers}", rebuild)
    tensors = {name: _tensor(buf, header["base"], header["tensors"][name]) for name in sorted(names)}
    if payload_digest(tensors) != meta["payload_sha256"]:
        raise CacheFormatError(f"{path} is damaged (payload digest mismatch)", rebuild)
    release_pages(buf)  # verified; pages come back from the page cache when used
    parts = []
    for j, (prefix, entry) in enumerate(zip(prefixes, segments)):
        seg_info = info if version == 1 else _segment_info(info, j, entry)
        where = f"segment {j} " if version > 1 else ""
        layers = tuple(_checked_layer(tensors, f"{prefix}layers.{i}.", seg_info) for i in range(n_layers))
        ids = tensors.get(f"{prefix}token_ids")
        if any(layer is None for layer in layers) or not _ids_ok(ids, seg_info, version > 1):
            raise CacheFormatError(f"{path}: {where}layer tensors disagree with the metadata", rebuild)
        parts.append(CompressedKVCache(info=seg_info, layers=layers, token_ids=ids, mapping=buf))  # type: ignore[arg-type]
    if version == 1:
        return parts[0], meta
    return SegmentedKVCache(info=info, segments=tuple(parts)), meta


def _int(meta: dict[str, str], key: str) -> int:
    value = meta[key]
    if not value.isdigit():
        raise ValueError(f"{key}={value!r}")
    return int(value)


def _info(meta: dict[str, str], path: str, rebuild: str) -> CacheInfo:
    """The typed `CacheInfo` of validated string metadata. Raises CacheFormatError."""
    try:
        version = _int(meta, "format_version")
        n_layers, n_kv, head_dim, n_ctx = (_int(meta, k) for k in ("n_layers", "n_kv_heads", "head_dim",
                                                                    "n_context_tokens"))  # fmt: skip
    except ValueError as exc:
        raise CacheFormatError(f"{path}: malformed metadata ({exc})", rebuild) from exc
    if version < 1 or min(n_kv, head_dim, n_ctx) < 1 or not 0 < n_layers <= 4096:
        raise CacheFormatError(f"{path}: malformed metadata (version or sizes)", rebuild)
    if version > FORMAT_VERSION:
        raise CacheFormatError(
            f"{path} has format version {version}, newer than this rocketkv reads ({FORMAT_VERSION})",
            "upgrade rocketkv, or " + rebuild,
        )
    try:
        config = PrefillConfig(**json.loads(meta["config"]))
        budgets, kernel = _budgets(json.loads(meta["budgets"]))
        windows = json.loads(meta["layer_windows"])
        if not isinstance(windows, list) or len(windows) != n_layers:
            raise ValueError("layer_windows")
        if not all(w is None or (_is_count(w) and w > 0) for w in windows):
            raise ValueError("layer_windows")
        segment = None
        if "segment_index" in meta:
            segment = SegmentInfo(_int(meta, "segment_index"), _int(meta, "segment_start_token"),
                                  meta.get("segment_ids_sha256", ""))  # fmt: skip
    except (TypeError, ValueError, KeyError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise CacheFormatError(f"{path}: malformed metadata (config, budgets or layer windows)", rebuild) from exc
    identity = ModelIdentity(
        model_id=meta["model_id"], model_digest=meta["model_digest"], tokenizer_digest=meta["tokenizer_digest"],
        chat_template_digest=meta["chat_template_digest"], prompt_template_id=meta["prompt_template_id"],
        n_layers=n_layers, n_kv_heads=n_kv, head_dim=head_dim, layer_windows=tuple(windows),
    )  # fmt: skip
    return CacheInfo(
        identity=identity, dtype=meta["dtype"], n_context_tokens=n_ctx, document_sha256=meta["document_sha256"],
        document_source=meta.get("document_source", ""), config=config, budgets=budgets, pool_kernel_size=kernel,
        segment=segment, created_at=meta["created_at"], format_version=version,
        rocketkv_version=meta["rocketkv_version"],
    )  # fmt: skip


def _budgets(raw: Any) -> tuple[Budgets, int]:
    """(Budgets, pool kernel) of a stored budgets record. Raises TypeError/ValueError/KeyError."""
    if not isinstance(raw, dict):
        raise ValueError("budgets")
    kernel = raw.get("pool_kernel_size", 0)
    if not _is_count(kernel):
        raise ValueError("pool_kernel_size")
    return Budgets(**{k: raw[k] for k in BUDGET_FIELDS}), kernel


def _segment_entries(meta: dict, version: int, n_ctx: int, path, rebuild: str) -> list[dict]:
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
            if not (_is_count(e["n_context_tokens"]) and _is_count(e["start_token"])):
                raise ValueError("segment entry")
            if e["n_context_tokens"] < 1 or e["start_token"] < start:
                raise ValueError("segment entry")
            _budgets(e["budgets"])
            start = e["start_token"]
        if sum(e["n_context_tokens"] for e in entries) != n_ctx:
            raise ValueError("segment lengths")
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CacheFormatError(f"{path}: malformed metadata (segments)", rebuild) from exc
    return entries


def _segment_info(info: CacheInfo, index: int, entry: dict) -> CacheInfo:
    budgets, kernel = _budgets(entry["budgets"])
    return info.with_(
        n_context_tokens=entry["n_context_tokens"], budgets=budgets, pool_kernel_size=kernel,
        segment=SegmentInfo(index, entry["start_token"], entry["ids_sha256"]),
    )  # fmt: skip


def _checked_layer(tensors: dict, prefix: str, info: CacheInfo) -> LayerKV | None:
    """One layer's `LayerKV` (`[1, Hkv, S, D]`, `[1, Hkv, S]`), or None when its tensors disagree
    with the metadata (shapes, dtype, positions strictly increasing and ending at n_ctx−1)."""
    k, v, pos = (tensors[f"{prefix}{kind}"] for kind in ("keys", "values", "positions"))
    n_kv, head_dim, n_ctx = info.identity.n_kv_heads, info.identity.head_dim, info.n_context_tokens
    ok = (
        k.dim() == 3 and k.shape[0] == n_kv and k.shape[2] == head_dim and v.dim() == 3
        and v.shape[:2] == k.shape[:2] and v.shape[2] == head_dim and pos.shape == k.shape[:2]
        and pos.dtype == torch.int64 and (pos.shape[1] < 2 or bool((pos[:, 1:] > pos[:, :-1]).all()))
        and k.dtype == v.dtype and str(k.dtype).removeprefix("torch.") == info.dtype
        and pos.numel() > 0 and int(pos.min()) >= 0 and bool((pos[:, -1] == n_ctx - 1).all())
    )  # fmt: skip
    return LayerKV(k.unsqueeze(0), v.unsqueeze(0), pos.unsqueeze(0)) if ok else None


def _ids_ok(ids: torch.Tensor | None, info: CacheInfo, check_digest: bool) -> bool:
    """Token ids (optional in v1) are int32 `[n_context_tokens]`, non-negative, matching their digest in v2."""
    if ids is None:
        return not check_digest
    if ids.dtype != torch.int32 or ids.shape != (info.n_context_tokens,) or int(ids.min()) < 0:
        return False
    if not check_digest or info.segment is None:
        return True
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest() == info.segment.ids_sha256
