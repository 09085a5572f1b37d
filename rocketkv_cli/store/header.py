"""The safetensors framing of a `.kv` file, read by hand: the header parsed and bound-checked
before anything is allocated from it (`parse_header`), private reads of byte ranges (`CacheFile`),
tensors over those bytes (`tensor_from`), and the format's name, versions and dtype tables.

Why by hand and not through the `safetensors` library: docs/file-format.md ("Why the loader reads
bytes itself"). Nothing read from a file is checked with `assert`.
"""

from __future__ import annotations

import io
import json
import math
import os
import shlex
import struct
from pathlib import Path
from typing import Any

import torch

from ..core.storage import KVStorage
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
MAX_TOKENS = 1 << 31  # bounds read from a file before anything is allocated from them
MAX_KV_HEADS, MAX_HEAD_DIM = 1024, 1024


def rebuild_hint(meta: dict, path: Path) -> str:
    """The command that rebuilds a (damaged) cache, naming its document when the metadata says."""
    source = meta.get("document_source") if isinstance(meta.get("document_source"), str) else None
    doc = shlex.quote(source) if source else "DOC"
    return f"rebuild it with: rocketkv ingest {doc} -o {shlex.quote(str(path))} --force"


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
    if n <= MAX_HEADER_BYTES and n > f.size - 8 and f.size > 8 and bytes(f.read(8, 9, rebuild)) == b"{":
        raise CacheFormatError.cut_header(f.shown, n, f.size, rebuild)
    if n > MAX_HEADER_BYTES or n > f.size - 8:
        raise CacheFormatError(f"{f.shown} is not a rocketkv cache (bad header length)", rebuild)
    try:
        header = json.loads(bytes(f.read(8, 8 + n, rebuild)))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, or an int of 4,300+ digits
        raise CacheFormatError(f"{f.shown} is not a rocketkv cache (unreadable header)", rebuild) from exc
    if not isinstance(header, dict):
        raise CacheFormatError(f"{f.shown} is not a rocketkv cache (unreadable header)", rebuild)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{f.shown} is a safetensors file but not a rocketkv cache", rebuild)
    rebuild = rebuild_hint(meta, f.path)  # from here on it is a damaged rocketkv cache
    payload = f.size - 8 - n
    sizes = {}
    for name, entry in header.items():
        sizes[name] = described_bytes(entry)
        if sizes[name] is None:
            raise CacheFormatError(f"{f.shown}: tensor {name!r} is described wrongly in the header", rebuild)
    described = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if described > payload:  # a cut copy or an interrupted write: say how much is missing
        raise CacheFormatError(f"{f.shown} is truncated or damaged: {f.size:,} bytes, its header describes "
                               f"{8 + n + described:,}", rebuild)  # fmt: skip
    end = 0
    for name, entry in header.items():
        expected = sizes[name]
        start, stop = entry["data_offsets"]
        if not (start <= stop <= payload) or stop - start != expected:
            raise CacheFormatError(f"{f.shown} is truncated or damaged (tensor {name!r})", rebuild)
        end = max(end, stop)
    if end != payload:
        raise CacheFormatError(f"{f.shown} is truncated or damaged (payload size)", rebuild)
    return {"tensors": header, "metadata": meta, "base": 8 + n, "payload": payload}


def is_count(x: Any) -> bool:
    """A non-negative int (not a bool), as header and metadata counts must be."""
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
