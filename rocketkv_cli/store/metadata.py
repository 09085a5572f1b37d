"""The metadata of a `.kv` file: `CacheInfo` ↔ string metadata (`info_metadata`,
`metadata_info`), its digest, the stored budgets, and the checks of positions and token ids that
every format version shares (docs/file-format.md, "Metadata").
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
from typing import Any

import torch

from ..core.cache import AnyCache, CacheInfo, CompressedKVCache, ModelIdentity, SegmentedKVCache, SegmentInfo
from ..core.config import WEIGHT_FORMATS, Budgets, PageOverTopk, PrefillConfig
from ..core.storage import KVStorage
from ..errors import CacheFormatError
from .header import FORMAT_VERSION, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_TOKENS, is_count

REQUIRED_METADATA = (
    "format", "format_version", "rocketkv_version", "model_id", "model_digest", "tokenizer_digest",
    "chat_template_digest", "dtype", "n_layers", "n_kv_heads", "head_dim", "n_context_tokens",
    "document_sha256", "config", "budgets", "layer_windows", "prompt_template_id", "created_at",
    "payload_sha256", "metadata_sha256",
)  # fmt: skip
BUDGET_FIELDS = ("prompt_budget", "capacity_budget", "topk", "page_size", "n_score_dims")


MAX_STORED_ABS = 2.0**40  # no key, value, scale, minimum or sink of a real model comes near it (the writer keeps
# float32 where float16's range is short); past it, attention's products and the norms' squares of the residual they
# feed can overflow float32 into NaN: a crafted 3e38 (finite) gave blank answers and "nan%" citations, not a refusal


def bounded(t: torch.Tensor) -> bool:
    """Whether every element of `t` is a number within ±`MAX_STORED_ABS` (NaN is not)."""
    return bool((t.float().abs() <= MAX_STORED_ABS).all())


def now() -> str:
    """The current UTC time, ISO 8601 to the second (`created_at`)."""
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
    except PageOverTopk as exc:  # a file an earlier rocketkv wrote itself: not damage
        raise CacheFormatError(f"{path}: its pages ({exc.page_size} tokens) are larger than its top-k ({exc.topk}): "
                               "written with --topk below the page size, which rocketkv no longer writes",
                               rebuild) from exc  # fmt: skip
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
    """(Budgets, pool kernel) of a stored budgets record. Raises TypeError/ValueError/KeyError
    (PageOverTopk: a page larger than the top-k)."""
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


def all_segments(cache: AnyCache) -> tuple[CompressedKVCache, ...]:
    """The segments of `cache` in order: itself when it has one."""
    return cache.segments if isinstance(cache, SegmentedKVCache) else (cache,)
