"""The `.kv` cache file (SPEC §4): safetensors tensors + string metadata, validated on load.

Tensors per layer i: `layers.{i}.keys` / `layers.{i}.values` `[Hkv, n_kept, D]` and
`layers.{i}.positions` `[Hkv, n_kept]` int64 (original RoPE positions). No pickle, no torch.save.
Writes are atomic (temporary file in the target directory, fsync, rename); an existing target is
replaced only with `force`, and a symlink at the target is replaced, never written through.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from . import __version__
from .errors import CacheFormatError, OutputError

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


@dataclass
class PrunedKVCache:
    """A stored (pruned) KV cache of one document.

    layers: per layer (keys `[1, Hkv, S_l, D]`, values `[1, Hkv, S_l, D]`, positions `[1, Hkv, S_l]`
    int64), S_l = tokens kept by that layer. metadata: the string metadata of SPEC §4.
    token_ids: `[n_context_tokens]` int32, the framed document's token ids, or None (stored for
    segments of long documents, where questions are routed by them).
    """

    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    metadata: dict[str, str] = field(default_factory=dict)
    token_ids: torch.Tensor | None = None
    mapping: object | None = field(default=None, repr=False, compare=False)  # the file's memory map, if loaded

    @property
    def n_context_tokens(self) -> int:
        return int(self.metadata["n_context_tokens"])


@dataclass
class SegmentedKVCache:
    """The stored cache of a document longer than the model's context (format v2).

    segments: one `PrunedKVCache` per segment, in document order; each was prefilled on its own
    at RoPE positions 0 … n_j−1 (n_j = its framed length in tokens) and carries its own metadata
    (`n_context_tokens` = n_j, its `budgets`, `segment_index`, `segment_start_token` = offset of
    its first document token in the whole document's tokens). metadata: the file's metadata;
    `n_context_tokens` there is the sum of the segments' n_j.
    """

    segments: list[PrunedKVCache]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def n_context_tokens(self) -> int:
        return int(self.metadata["n_context_tokens"])


SEGMENT_FIELDS = ("n_context_tokens", "start_token", "budgets", "ids_sha256")


def segment_entry(segment: PrunedKVCache) -> dict:
    """The per-segment record stored in a v2 file's `segments` metadata (JSON list)."""
    meta = segment.metadata
    return {
        "n_context_tokens": int(meta["n_context_tokens"]),
        "start_token": int(meta.get("segment_start_token", 0)),
        "budgets": json.loads(meta["budgets"]),
        "ids_sha256": meta.get("segment_ids_sha256", ""),
    }


def full_kv_bytes(
    n_context_tokens: int, layer_windows: list[int | None], n_kv_heads: int, head_dim: int, element_bytes: int
) -> int:
    """Bytes of the unpruned KV cache of a document (keys + values; sliding layers hold their window)."""
    tokens = sum(min(n_context_tokens, w) if w else n_context_tokens for w in layer_windows)
    return 2 * n_kv_heads * tokens * head_dim * element_bytes


def _tensors(cache: PrunedKVCache) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v, p) in enumerate(cache.layers):
        out[f"layers.{i}.keys"] = k[0].contiguous()
        out[f"layers.{i}.values"] = v[0].contiguous()
        out[f"layers.{i}.positions"] = p[0].to(torch.int64).contiguous()
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


def _finish_metadata(meta: dict[str, str], tensors: dict[str, torch.Tensor], version: int) -> dict[str, str]:
    meta = dict(meta)
    meta.update(
        format=FORMAT_NAME,
        format_version=str(version),
        rocketkv_version=__version__,
        created_at=meta.get("created_at") or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        payload_sha256=payload_digest(tensors),
    )
    meta["metadata_sha256"] = metadata_digest(meta)
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    assert not missing, f"metadata incomplete: {missing}"
    return meta


def save_cache(cache: PrunedKVCache, path: str | Path, force: bool = False) -> Path:
    """Write a one-segment `cache` (format v1) atomically to `path`.

    Raises:
        OutputError: target exists without `force`, is a directory, or its directory is missing
            or not writable.
    """
    tensors = {k: v.detach().cpu() for k, v in _tensors(cache).items()}
    meta = _finish_metadata(cache.metadata, tensors, 1)
    data = st_save(tensors, metadata=meta)
    return _atomic_write(Path(path), force, lambda f: f.write(data))


def save_segmented(
    segments: list[PrunedKVCache], metadata: dict[str, str], path: str | Path, force: bool = False
) -> Path:
    """Write a multi-segment cache (format v2) atomically to `path`, streaming tensor by tensor.

    `segments` may be memory-mapped checkpoints (`load_cache` results): memory stays at one tensor
    beyond the maps, whatever the file size. Tensors are named `segments.{j}.layers.{i}.{kind}`;
    each segment's `token_ids` (required here) go in `segments.{j}.token_ids`. The layout is plain
    safetensors (contiguous, 8-byte dtypes first). `metadata` gets the
    `segments` list (see `segment_entry`) and the total `n_context_tokens`.
    Raises:
        OutputError: as `save_cache`.
    """
    tensors: dict[str, torch.Tensor] = {}
    assert all(seg.token_ids is not None for seg in segments), "segments need their token ids"
    dtypes = {str(seg.layers[0][0].dtype).removeprefix("torch.") for seg in segments}
    assert dtypes == {metadata["dtype"]}, f"segments in {dtypes}, metadata says {metadata['dtype']}"
    for j, seg in enumerate(segments):
        for name, t in _tensors(seg).items():
            tensors[f"segments.{j}.{name}"] = t
    meta = dict(metadata)
    meta["segments"] = json.dumps([segment_entry(seg) for seg in segments])
    meta["n_context_tokens"] = str(sum(int(seg.metadata["n_context_tokens"]) for seg in segments))
    maps = {f"segments.{j}.{name}": seg.mapping for j, seg in enumerate(segments) for name in _tensors(seg)}
    release = lambda name: release_pages(maps[name])  # noqa: E731  (memory stays one tensor, not the book)
    meta = dict(meta)
    meta.update(
        format=FORMAT_NAME, format_version="2", rocketkv_version=__version__,
        created_at=meta.get("created_at") or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        payload_sha256=payload_digest(tensors, release),
    )  # fmt: skip
    meta["metadata_sha256"] = metadata_digest(meta)
    assert not [k for k in REQUIRED_METADATA if k not in meta], "metadata incomplete"
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
        try:
            dtype, shape, (start, stop) = info["dtype"], info["shape"], info["data_offsets"]
            assert all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (*shape, start, stop))
            expected = _DTYPE_BYTES[dtype] * math.prod(shape)
        except (KeyError, TypeError, ValueError, AssertionError) as exc:
            raise CacheFormatError(f"{path}: tensor {name!r} is described wrongly in the header", rebuild) from exc
        if not (start <= stop <= payload) or stop - start != expected:
            raise CacheFormatError(f"{path} is truncated or damaged (tensor {name!r})", rebuild)
        end = max(end, stop)
    if end != payload:
        raise CacheFormatError(f"{path} is truncated or damaged (payload size)", rebuild)
    return {"tensors": header, "metadata": meta, "base": 8 + n}


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


def load_cache(path: str | Path) -> PrunedKVCache | SegmentedKVCache:
    """Load and validate a `.kv` file (format, version, header bounds, shapes, digests).

    Tensors are zero-copy views of a read-only memory map of the file. Model compatibility is
    checked separately by `check_compatible`. A v1 file gives a `PrunedKVCache`, a v2 file (a
    document in segments) a `SegmentedKVCache`.
    Raises:
        CacheFormatError: not a rocketkv cache, newer format, truncated, damaged, inconsistent.
    """
    p = Path(path)
    if not p.is_file():
        raise CacheFormatError(f"cache file not found: {path}", f"build one with: rocketkv ingest DOC -o {path}")
    buf = _map_file(p, path)
    info = _parse_header(buf, p, "give a .kv file written by: rocketkv ingest DOC -o FILE.kv")
    meta = info["metadata"]
    rebuild = rebuild_hint(meta, p)
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise CacheFormatError(f"{path}: metadata lacks {', '.join(missing)}", rebuild)
    if not all(isinstance(v, str) for v in meta.values()) or metadata_digest(meta) != meta["metadata_sha256"]:
        raise CacheFormatError(f"{path} is damaged (metadata digest mismatch)", rebuild)
    try:
        version = int(meta["format_version"])
        n_layers, n_kv, head_dim, n_ctx = (
            int(meta[k]) for k in ("n_layers", "n_kv_heads", "head_dim", "n_context_tokens")
        )
    except ValueError as exc:
        raise CacheFormatError(f"{path}: malformed metadata ({exc})", rebuild) from exc
    try:
        for key in ("config", "budgets", "layer_windows"):
            json.loads(meta[key])
    except json.JSONDecodeError as exc:
        raise CacheFormatError(f"{path}: malformed metadata ({exc})", rebuild) from exc
    if version < 1 or min(n_kv, head_dim, n_ctx) < 1:
        raise CacheFormatError(f"{path}: malformed metadata (version or sizes)", rebuild)
    try:
        from .config import Budgets, PrefillConfig

        PrefillConfig(**json.loads(meta["config"]))
        budgets = json.loads(meta["budgets"])
        Budgets(**{k: budgets[k] for k in ("prompt_budget", "capacity_budget", "topk", "page_size", "n_score_dims")})
        windows = json.loads(meta["layer_windows"])
        assert isinstance(windows, list) and len(windows) == n_layers
        assert all(w is None or (isinstance(w, int) and w > 0) for w in windows)
    except (TypeError, ValueError, KeyError, AssertionError) as exc:
        raise CacheFormatError(f"{path}: malformed metadata (config, budgets or layer windows)", rebuild) from exc
    if version > FORMAT_VERSION:
        raise CacheFormatError(
            f"{path} has format version {version}, newer than this rocketkv reads ({FORMAT_VERSION})",
            "upgrade rocketkv, or " + rebuild,
        )
    segments = _segment_entries(meta, version, n_ctx, path, rebuild)
    if not 0 < n_layers <= 4096 or len(info["tensors"]) > 4 * n_layers * len(segments):
        raise CacheFormatError(f"{path}: tensors do not match n_layers={n_layers}", rebuild)
    prefixes = [""] if version == 1 else [f"segments.{j}." for j in range(len(segments))]
    expected = {
        f"{p}layers.{i}.{kind}" for p in prefixes for i in range(n_layers) for kind in ("keys", "values", "positions")
    }
    ids_names = {f"{p}token_ids" for p in prefixes}  # optional in v1, required in v2
    names = set(info["tensors"])
    if not expected <= names <= expected | ids_names or (version > 1 and not ids_names <= names):
        raise CacheFormatError(f"{path}: tensors do not match n_layers={n_layers}", rebuild)
    tensors = {name: _tensor(buf, info["base"], info["tensors"][name]) for name in sorted(names)}
    if payload_digest(tensors) != meta["payload_sha256"]:
        raise CacheFormatError(f"{path} is damaged (payload digest mismatch)", rebuild)
    release_pages(buf)  # verified; pages come back from the page cache when used
    parts = []
    for j, (prefix, entry) in enumerate(zip(prefixes, segments)):
        n_seg = entry["n_context_tokens"]
        layers = [
            _checked_layer(tensors, f"{prefix}layers.{i}.", n_kv, head_dim, n_seg, meta["dtype"])
            for i in range(n_layers)
        ]
        ids = tensors.get(f"{prefix}token_ids")
        ids_ok = ids is None or (ids.dtype == torch.int32 and ids.shape == (n_seg,) and int(ids.min()) >= 0)
        if ids_ok and ids is not None and version > 1:
            ids_ok = hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest() == entry["ids_sha256"]
        if any(layer is None for layer in layers) or not ids_ok:
            where = f"segment {j} " if version > 1 else ""
            raise CacheFormatError(f"{path}: {where}layer tensors disagree with the metadata", rebuild)
        seg_meta = dict(meta)
        if version > 1:
            seg_meta.update(
                n_context_tokens=str(entry["n_context_tokens"]), budgets=json.dumps(entry["budgets"], sort_keys=True),
                segment_index=str(j), segment_start_token=str(entry["start_token"]),
                segment_ids_sha256=entry["ids_sha256"],
            )  # fmt: skip
        parts.append(PrunedKVCache(layers=layers, metadata=seg_meta, token_ids=ids, mapping=buf))
    return parts[0] if version == 1 else SegmentedKVCache(segments=parts, metadata=dict(meta))


def _segment_entries(meta: dict, version: int, n_ctx: int, path, rebuild: str) -> list[dict]:
    """The per-segment records of a v2 file (validated), or one record for a v1 file."""
    if version == 1:
        return [{"n_context_tokens": n_ctx}]
    try:
        entries = json.loads(meta["segments"])
        assert isinstance(entries, list) and 2 <= len(entries) <= 1 << 20
        from .config import Budgets

        start = 0
        for e in entries:
            assert isinstance(e, dict) and set(e) == set(SEGMENT_FIELDS)
            assert all(
                isinstance(e[k], int) and not isinstance(e[k], bool) for k in ("n_context_tokens", "start_token")
            )
            assert e["n_context_tokens"] >= 1 and e["start_token"] >= start and isinstance(e["ids_sha256"], str)
            b = e["budgets"]
            Budgets(**{k: b[k] for k in ("prompt_budget", "capacity_budget", "topk", "page_size", "n_score_dims")})
            start = e["start_token"]
        assert sum(e["n_context_tokens"] for e in entries) == n_ctx
    except (KeyError, TypeError, ValueError, AssertionError, RecursionError, json.JSONDecodeError) as exc:
        raise CacheFormatError(f"{path}: malformed metadata (segments)", rebuild) from exc
    return entries


def _checked_layer(tensors: dict, prefix: str, n_kv: int, head_dim: int, n_ctx: int, dtype: str):
    """One layer's (keys, values, positions) `[1, Hkv, S, D]`, `[1, Hkv, S]`, or None when they
    disagree with the metadata (shapes, dtype, positions strictly increasing and ending at n_ctx−1)."""
    k, v, pos = (tensors[f"{prefix}{kind}"] for kind in ("keys", "values", "positions"))
    ok = (
        k.dim() == 3 and k.shape[0] == n_kv and k.shape[2] == head_dim and v.dim() == 3
        and v.shape[:2] == k.shape[:2] and v.shape[2] == head_dim and pos.shape == k.shape[:2]
        and pos.dtype == torch.int64 and (pos.shape[1] < 2 or bool((pos[:, 1:] > pos[:, :-1]).all()))
        and k.dtype == v.dtype and str(k.dtype).removeprefix("torch.") == dtype
        and pos.numel() > 0 and int(pos.min()) >= 0 and bool((pos[:, -1] == n_ctx - 1).all())
    )  # fmt: skip
    return (k.unsqueeze(0), v.unsqueeze(0), pos.unsqueeze(0)) if ok else None


def check_compatible(cache: PrunedKVCache, expected: dict[str, str], path: str, rebuild: str) -> None:
    """Refuse a cache built for another model, tokenizer, chat template, prompt or geometry.

    Args:
        expected: metadata values the current model produces (same keys as the file's).
    Raises:
        CacheFormatError naming the first mismatch and the rebuild command.
    """
    labels = {
        "model_digest": "another model",
        "tokenizer_digest": "another tokenizer",
        "chat_template_digest": "another chat template",
        "prompt_template_id": "another prompt template",
        "n_layers": "a model with another layer count",
        "n_kv_heads": "a model with another KV head count",
        "head_dim": "a model with another head_dim",
        "layer_windows": "a model with other sliding windows",
    }
    for key, label in labels.items():
        if key in expected and cache.metadata.get(key) != expected[key]:
            built = cache.metadata.get("model_id", "?")
            raise CacheFormatError(f"{path} was built for {label} (model {built}), not this one", rebuild)
