"""The `.kv` cache file (docs/file-format.md): safetensors tensors + string metadata, validated on load.

The only place where a `CompressedKVCache` / `SegmentedKVCache` becomes bytes and strings, and
back. This module holds what every format version shares: the metadata ↔ `CacheInfo`
conversion, the header parser, digests, and the entry points `save_cache`, `load_cache` and
`read_metadata`. Formats v3 and v4 (v4 is what rocketkv writes) are in `v3.py`, the reader of v1/v2 files in
`legacy.py`. Files are read into private memory (never memory-mapped) and the digest is checked on
exactly the bytes that are then used, so a file changed or truncated under a reader gives a
`CacheFormatError`, never a wrong answer or a signal. Nothing read from a file is checked with
`assert`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import math
import os
import re
import shlex
import struct
from pathlib import Path
from typing import Any

import torch

from ..core.cache import AnyCache, CacheInfo, CompressedKVCache, ModelIdentity, SegmentedKVCache, SegmentInfo
from ..core.config import WEIGHT_FORMATS, Budgets, PrefillConfig
from ..core.quant import KVStorage
from ..errors import CacheFormatError

FORMAT_NAME = "rocketkv.kv_cache"
FORMAT_VERSION = 5  # the newest this rocketkv reads and writes. v1: one segment (`layers.*`); v2:
# `segments.{j}.layers.*`; v3: + integer storage; v4: + float16 sink tokens, int16 positions where
# they fit, token lines as runs; v5: + allocated key bits (`keys.bits`). A file is written with the
# oldest version that holds it (`version_for`), so older rocketkv still read what they can.


def version_for(storage: KVStorage) -> int:
    """The format version a file of `storage` is written with: 5 for allocated key bits, else 4."""
    return 5 if storage.key_bits == "allocated" else 4


MAX_HEADER_BYTES = 100 << 20  # as safetensors itself
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "F64": 8, "U8": 1}
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
                "I32": torch.int32, "I16": torch.int16, "F64": torch.float64, "U8": torch.uint8}  # fmt: skip
ST_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
REQUIRED_METADATA = (
    "format", "format_version", "rocketkv_version", "model_id", "model_digest", "tokenizer_digest",
    "chat_template_digest", "dtype", "n_layers", "n_kv_heads", "head_dim", "n_context_tokens",
    "document_sha256", "config", "budgets", "layer_windows", "prompt_template_id", "created_at",
    "payload_sha256", "metadata_sha256",
)  # fmt: skip
BUDGET_FIELDS = ("prompt_budget", "capacity_budget", "topk", "page_size", "n_score_dims")
MAX_TOKENS = 1 << 31  # bounds read from a file before anything is allocated from them
MAX_KV_HEADS, MAX_HEAD_DIM = 1024, 1024


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


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
        "kv_storage": json.dumps(info.storage.to_dict(), sort_keys=True), "weights": info.weights,
    }  # fmt: skip
    if info.segment is not None:
        meta.update(segment_index=str(info.segment.index), segment_start_token=str(info.segment.start_token),
                    segment_ids_sha256=info.segment.ids_sha256)  # fmt: skip
    if info.created_at:
        meta["created_at"] = info.created_at
    return meta


def metadata_digest(meta: dict[str, str]) -> str:
    """sha256 of every metadata entry but `metadata_sha256` itself (sorted JSON)."""
    body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    """The v1/v2 payload digest: sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def rebuild_hint(meta: dict, path: Path) -> str:
    """The command that rebuilds a (damaged) cache, naming its document when the metadata says."""
    source = meta.get("document_source") if isinstance(meta.get("document_source"), str) else None
    doc = shlex.quote(source) if source else "DOC"
    return f"rebuild it with: rocketkv ingest {doc} -o {shlex.quote(str(path))} --force"


# -- reading ------------------------------------------------------------------------------------


class CacheFile:
    """A `.kv` file being read: its size and identity (device, inode) at opening, and private reads
    of byte ranges (`read`). The file is closed between reads; a lazy read reopens it and refuses
    a file replaced meanwhile, so holding many lazily read caches costs no file descriptors."""

    def __init__(self, path: Path, shown: str):
        self.path, self.shown = path, shown
        self.file: io.RawIOBase | None = None
        try:
            self.file = open(path, "rb", buffering=0)  # noqa: SIM115  (closed by `close`)
        except OSError as exc:
            raise CacheFormatError(f"cannot read cache {shown}: {exc.strerror}") from exc
        st = os.fstat(self.file.fileno())
        self.size, self.identity = st.st_size, (st.st_dev, st.st_ino)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def _reopen(self, rebuild: str) -> io.RawIOBase:
        if self.file is None:
            try:
                self.file = open(self.path, "rb", buffering=0)  # noqa: SIM115
            except OSError as exc:
                raise CacheFormatError(f"cannot read cache {self.shown}: {exc.strerror}", rebuild) from exc
            st = os.fstat(self.file.fileno())
            if (st.st_dev, st.st_ino) != self.identity:
                self.close()
                raise CacheFormatError(f"{self.shown} was replaced while in use", "run the command again")
        return self.file

    def read(self, start: int, stop: int, rebuild: str) -> bytearray:
        """Bytes [start, stop) of the file into private memory. Raises CacheFormatError when the
        file is now shorter (truncated under us), unreadable, or replaced since it was opened."""
        f = self._reopen(rebuild)
        buf = bytearray(stop - start)
        view, done = memoryview(buf), 0
        try:
            f.seek(start)
            while done < len(buf):
                n = f.readinto(view[done:])
                if not n:
                    raise CacheFormatError(f"{self.shown} is truncated or damaged (it shrank while being read)",
                                           rebuild)  # fmt: skip
                done += n
        except OSError as exc:
            raise CacheFormatError(f"cannot read cache {self.shown}: {exc.strerror}", rebuild) from exc
        return buf


def parse_header(f: CacheFile, rebuild: str) -> dict:
    """Read, parse and bound-check the safetensors header before any tensor is made.

    Returns {"tensors": {name: entry}, "metadata": {...}, "base": payload offset, "payload": bytes}.
    """
    if f.size < 8:
        raise CacheFormatError(f"{f.shown} is not a rocketkv cache (too short)", rebuild)
    (n,) = struct.unpack("<Q", f.read(0, 8, rebuild))
    if n > MAX_HEADER_BYTES or n > f.size - 8:
        raise CacheFormatError(f"{f.shown} is not a rocketkv cache (bad header length)", rebuild)
    try:
        header = json.loads(bytes(f.read(8, 8 + n, rebuild)))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CacheFormatError(f"{f.shown} is not a rocketkv cache (unreadable header)", rebuild) from exc
    if not isinstance(header, dict):
        raise CacheFormatError(f"{f.shown} is not a rocketkv cache (unreadable header)", rebuild)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{f.shown} is a safetensors file but not a rocketkv cache", rebuild)
    rebuild = rebuild_hint(meta, f.path)  # from here on it is a damaged rocketkv cache
    payload = f.size - 8 - n
    end = 0
    for name, entry in header.items():
        expected = described_bytes(entry)
        if expected is None:
            raise CacheFormatError(f"{f.shown}: tensor {name!r} is described wrongly in the header", rebuild)
        start, stop = entry["data_offsets"]
        if not (start <= stop <= payload) or stop - start != expected:
            raise CacheFormatError(f"{f.shown} is truncated or damaged (tensor {name!r})", rebuild)
        end = max(end, stop)
    if end != payload:
        raise CacheFormatError(f"{f.shown} is truncated or damaged (payload size)", rebuild)
    return {"tensors": header, "metadata": meta, "base": 8 + n, "payload": payload}


def is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def described_bytes(entry: Any) -> int | None:
    """Bytes a header entry says its tensor has, or None when the entry is malformed."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_BYTES:
        return None
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if not all(is_count(x) for x in (*shape, *offsets)) or any(d >= MAX_TOKENS for d in shape) or len(shape) > 4:
        return None
    return DTYPE_BYTES[entry["dtype"]] * math.prod(shape)


def tensor_from(buf: bytearray, offset: int, entry: dict) -> torch.Tensor:
    """Tensor `[shape]` over `buf` (private memory) from byte `offset`; a view, no copy."""
    dtype = TORCH_DTYPES[entry["dtype"]]
    start, stop = entry["data_offsets"]
    if stop == start:
        return torch.empty(entry["shape"], dtype=dtype)
    flat = torch.frombuffer(buf, dtype=dtype, count=(stop - start) // DTYPE_BYTES[entry["dtype"]], offset=offset)
    return flat.view(entry["shape"])


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
        from .v3 import read_v3

        cache = read_v3(f, header, info, rebuild)
        if not lazy and isinstance(cache, CompressedKVCache):
            cache.layers  # noqa: B018  (read and check the KV now)
        f.close()  # a lazy read reopens it
        return cache, meta
    from .legacy import read_legacy

    cache = read_legacy(f, header, info, rebuild)
    f.close()
    return cache, meta


def _int(meta: dict[str, str], key: str) -> int:
    value = meta[key]
    if not re.fullmatch(r"[0-9]{1,12}", value):
        raise ValueError(f"{key}={value!r}")
    return int(value)


def metadata_info(meta: dict[str, str], path: str, rebuild: str) -> CacheInfo:
    """The typed `CacheInfo` of validated string metadata. Raises CacheFormatError."""
    try:
        version = _int(meta, "format_version")
        n_layers, n_kv, head_dim, n_ctx = (_int(meta, k) for k in ("n_layers", "n_kv_heads", "head_dim",
                                                                    "n_context_tokens"))  # fmt: skip
    except ValueError as exc:
        raise CacheFormatError(f"{path}: malformed metadata ({exc})", rebuild) from exc
    if version < 1 or min(n_kv, head_dim, n_ctx) < 1 or not 0 < n_layers <= 4096:
        raise CacheFormatError(f"{path}: malformed metadata (version or sizes)", rebuild)
    if n_ctx >= MAX_TOKENS or n_kv > MAX_KV_HEADS or head_dim > MAX_HEAD_DIM:
        raise CacheFormatError(f"{path}: malformed metadata (sizes beyond any model rocketkv runs)", rebuild)
    if version > FORMAT_VERSION:
        raise CacheFormatError(
            f"{path} has format version {version}, newer than this rocketkv reads ({FORMAT_VERSION})",
            "upgrade rocketkv, or " + rebuild,
        )
    try:
        raw_config = json.loads(meta["config"])
        if isinstance(raw_config, dict):
            raw_config.setdefault("n_first_tokens", 0)  # written before stage 1 kept the first tokens
        config = PrefillConfig(**raw_config)
        budgets, kernel = parse_budgets(json.loads(meta["budgets"]))
        windows = json.loads(meta["layer_windows"])
        if not isinstance(windows, list) or len(windows) != n_layers:
            raise ValueError("layer_windows")
        if not all(w is None or (is_count(w) and w > 0) for w in windows):
            raise ValueError("layer_windows")
        segment = None
        if "segment_index" in meta:
            segment = SegmentInfo(_int(meta, "segment_index"), _int(meta, "segment_start_token"),
                                  meta.get("segment_ids_sha256", ""))  # fmt: skip
        storage = KVStorage(meta["dtype"])
        if version >= 3:
            raw_storage = json.loads(meta["kv_storage"])
            if not isinstance(raw_storage, dict):
                raise ValueError("kv_storage")
            if version == 3:  # v3 quantized every token as stored, and wrote no sink count
                if "sink_tokens" in raw_storage or raw_storage.get("rotation") == "rope":
                    raise ValueError("kv_storage")
                raw_storage["sink_tokens"] = 0
            elif "sink_tokens" not in raw_storage:  # v4 always writes it: a default would misread the file
                raise ValueError("kv_storage")
            if version < 5 and "key_bits" in raw_storage:  # v5 added it
                raise ValueError("kv_storage")
            if version >= 5 and raw_storage.get("key_bits") != "allocated":  # v5 is written for nothing else
                raise ValueError("kv_storage")
            storage = KVStorage(**raw_storage)
        if version >= 3 and storage.kv_dtype == "auto":
            raise ValueError("kv_storage")
        weights = meta.get("weights", "float") if version >= 3 else "float"
        if weights not in WEIGHT_FORMATS:
            raise ValueError("weights")
    except (TypeError, ValueError, KeyError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise CacheFormatError(f"{path}: malformed metadata (config, budgets, storage or layer windows)",
                               rebuild) from exc  # fmt: skip
    identity = ModelIdentity(
        model_id=meta["model_id"], model_digest=meta["model_digest"], tokenizer_digest=meta["tokenizer_digest"],
        chat_template_digest=meta["chat_template_digest"], prompt_template_id=meta["prompt_template_id"],
        n_layers=n_layers, n_kv_heads=n_kv, head_dim=head_dim, layer_windows=tuple(windows),
    )  # fmt: skip
    return CacheInfo(
        identity=identity, dtype=meta["dtype"], n_context_tokens=n_ctx, document_sha256=meta["document_sha256"],
        document_source=meta.get("document_source", ""), config=config, budgets=budgets, pool_kernel_size=kernel,
        segment=segment, storage=storage, weights=weights,
        created_at=meta["created_at"], format_version=version,
        rocketkv_version=meta["rocketkv_version"],
    )  # fmt: skip


def parse_budgets(raw: Any) -> tuple[Budgets, int]:
    """(Budgets, pool kernel) of a stored budgets record. Raises TypeError/ValueError/KeyError."""
    if not isinstance(raw, dict):
        raise ValueError("budgets")
    kernel = raw.get("pool_kernel_size", 0)
    if not is_count(kernel):
        raise ValueError("pool_kernel_size")
    return Budgets(**{k: raw[k] for k in BUDGET_FIELDS}), kernel


def segment_info(info: CacheInfo, index: int, entry: dict) -> CacheInfo:
    """The info of segment `index` of a segmented file: the file's, with the segment's own length,
    budgets and place (from its validated `segments` entry)."""
    budgets, kernel = parse_budgets(entry["budgets"])
    return info.with_(
        n_context_tokens=entry["n_context_tokens"], budgets=budgets, pool_kernel_size=kernel,
        segment=SegmentInfo(index, entry["start_token"], entry["ids_sha256"]),
    )  # fmt: skip


def positions_ok(pos: torch.Tensor, n_kv: int, n_kept: int, n_ctx: int) -> bool:
    """Positions `[Hkv, S]` of `n_kept` ≥ 1 tokens, strictly increasing per head, ending at n_ctx − 1."""
    return (
        pos.shape == (n_kv, n_kept) and n_kept > 0 and int(pos.min()) >= 0
        and (n_kept < 2 or bool((pos[:, 1:] > pos[:, :-1]).all())) and bool((pos[:, -1] == n_ctx - 1).all())
    )  # fmt: skip


def token_ids_ok(ids: torch.Tensor | None, info: CacheInfo, required: bool) -> bool:
    """Token ids (optional unless `required`) are int32 `[n_context_tokens]`, non-negative, and
    match the segment's digest when the info carries one."""
    if ids is None:
        return not required
    if ids.dtype != torch.int32 or ids.shape != (info.n_context_tokens,) or int(ids.min()) < 0:
        return False
    if info.segment is None or not info.segment.ids_sha256:
        return True
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest() == info.segment.ids_sha256


def save_cache(cache: AnyCache, path: str | Path, force: bool = False) -> Path:
    """Write `cache` (one or several segments) atomically to `path` in the current format (v4).

    Raises:
        OutputError: target exists without `force`, is a directory or special file, its directory
            is missing or not writable, or the header would be too large.
    """
    from .v3 import write_v3

    return write_v3(cache, Path(path), force)


def all_segments(cache: AnyCache) -> tuple[CompressedKVCache, ...]:
    return cache.segments if isinstance(cache, SegmentedKVCache) else (cache,)


def verify_file(path: str | Path) -> AnyCache:
    """`load_cache`, then read and check every segment's KV bytes now (not lazily): the file reads
    back whole. Returns the cache (its segments read again lazily on use). Raises CacheFormatError."""
    cache = load_cache(path, lazy=True)
    for seg in all_segments(cache):
        seg.layers  # noqa: B018  (reads, checks the digest and every tensor against the metadata)
        seg.release()
    return cache
