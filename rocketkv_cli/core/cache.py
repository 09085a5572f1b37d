"""The compressed KV cache of one document, typed: what stage 1 kept, and what it was built from.

`CompressedKVCache` holds one `LayerKV` per decoder layer and a frozen `CacheInfo` (model
identity, budgets, configuration, context length, segment). `SegmentedKVCache` is a document
longer than the context, one `CompressedKVCache` per segment. Only `rocketkv_cli.store` turns
these into bytes and strings and back. Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .config import Budgets, PrefillConfig


@dataclass(frozen=True)
class LayerKV:
    """One layer's kept tokens: keys/values `[1, Hkv, S, D]`, positions `[1, Hkv, S]` int64.

    S = tokens this layer kept (each KV head its own tokens, the same count); positions are the
    tokens' original RoPE positions, ascending per head.
    Raises:
        ValueError: shapes that disagree.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self) -> None:
        k, v, p = self.keys, self.values, self.positions
        if k.dim() != 4 or v.shape[:3] != k.shape[:3] or p.shape != k.shape[:3] or k.shape[0] != 1:
            raise ValueError(f"LayerKV wants [1, Hkv, S, D] keys/values and [1, Hkv, S] positions, got "
                             f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(p.shape)}")  # fmt: skip

    @property
    def n_kept_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of keys + values (positions not counted: the KV cache proper)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


_IDENTITY_LABELS = {
    "model_digest": "another model",
    "tokenizer_digest": "another tokenizer",
    "chat_template_digest": "another chat template",
    "prompt_template_id": "another prompt template",
    "n_layers": "a model with another layer count",
    "n_kv_heads": "a model with another KV head count",
    "head_dim": "a model with another head_dim",
    "layer_windows": "a model with other sliding windows",
}


@dataclass(frozen=True)
class ModelIdentity:
    """What a cache must match to be used with a model: digests of the weights + config, the
    tokenizer, the chat template; the prompt template; the KV geometry (sliding windows in
    tokens, None = full attention). `model_id` names the model and is not compared."""

    model_id: str
    model_digest: str
    tokenizer_digest: str
    chat_template_digest: str
    prompt_template_id: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]

    def mismatch(self, other: ModelIdentity) -> str | None:
        """A phrase naming the first way `self` (the cache's) differs from `other`, or None."""
        for name, label in _IDENTITY_LABELS.items():
            if getattr(self, name) != getattr(other, name):
                return label
        return None

    @property
    def full_layers(self) -> list[int]:
        return [i for i, w in enumerate(self.layer_windows) if w is None]


@dataclass(frozen=True)
class SegmentInfo:
    """Where a segment sits in a long document: its index, the offset of its first document
    token in the whole document's tokens, and the sha256 of its framed token ids."""

    index: int
    start_token: int
    ids_sha256: str


@dataclass(frozen=True)
class CacheInfo:
    """Everything known about a compressed cache besides its tensors.

    n_context_tokens: n, framed document tokens (the next RoPE position). budgets: stage 1 and 2
    budgets in tokens (paper §3.6). pool_kernel_size: the kernel stage 1 used (the `auto` rule
    resolved). document_sha256/source: the document's bytes digest and where it came from.
    format_version, rocketkv_version, created_at: set when read from (or written to) a file.
    """

    identity: ModelIdentity
    dtype: str
    n_context_tokens: int
    document_sha256: str
    document_source: str
    config: PrefillConfig
    budgets: Budgets
    pool_kernel_size: int
    segment: SegmentInfo | None = None
    created_at: str | None = None
    format_version: int | None = None
    rocketkv_version: str | None = None

    def with_(self, **changes) -> CacheInfo:
        return replace(self, **changes)

    def budgets_record(self) -> dict[str, int]:
        """The budgets and the pool kernel as one record, keys sorted (as files and `--json` show them)."""
        return dict(sorted((self.budgets.to_dict() | {"pool_kernel_size": self.pool_kernel_size}).items()))


@dataclass
class CompressedKVCache:
    """A document's pruned KV cache: one `LayerKV` per decoder layer, and its `CacheInfo`.

    token_ids: `[n_context_tokens]` int32, the framed document's token ids, or None (kept for
    segments of long documents, where questions are routed by their text). mapping: the file
    mapping the tensors are views of, when loaded (kept alive with them).
    """

    info: CacheInfo
    layers: tuple[LayerKV, ...]
    token_ids: torch.Tensor | None = None
    mapping: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.layers) != self.info.identity.n_layers:
            raise ValueError(f"{len(self.layers)} layers for a model of {self.info.identity.n_layers}")

    @property
    def n_context_tokens(self) -> int:
        return self.info.n_context_tokens

    @property
    def n_segments(self) -> int:
        return 1

    @property
    def max_kept_tokens(self) -> int:
        """Most tokens any layer kept (per KV head)."""
        return max(layer.n_kept_tokens for layer in self.layers)

    @property
    def kv_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


@dataclass
class SegmentedKVCache:
    """The cache of a document longer than the model's context: one `CompressedKVCache` per
    segment, in document order, each prefilled on its own at RoPE positions 0 … n_j−1. `info` is
    the file's: `n_context_tokens` is the sum of the segments' n_j, `document_sha256` the whole
    document's digest, budgets those of segment 0."""

    info: CacheInfo
    segments: tuple[CompressedKVCache, ...]

    @property
    def n_context_tokens(self) -> int:
        return self.info.n_context_tokens

    @property
    def n_segments(self) -> int:
        return len(self.segments)

    @property
    def max_kept_tokens(self) -> int:
        return max(s.max_kept_tokens for s in self.segments)

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv_bytes for s in self.segments)


AnyCache = CompressedKVCache | SegmentedKVCache


def full_kv_bytes(
    n_context_tokens: int, layer_windows: tuple[int | None, ...] | list[int | None], n_kv_heads: int, head_dim: int,
    element_bytes: int,
) -> int:  # fmt: skip
    """Bytes of the unpruned KV cache of a document (keys + values; sliding layers hold their window)."""
    tokens = sum(min(n_context_tokens, w) if w else n_context_tokens for w in layer_windows)
    return 2 * n_kv_heads * tokens * head_dim * element_bytes
