"""The compressed KV cache of one document, typed: what stage 1 kept, and what it was built from.

`CompressedKVCache` holds one `LayerKV` per decoder layer and a frozen `CacheInfo` (model
identity, budgets, configuration, context length, segment). `SegmentedKVCache` is a document
longer than the context, one `CompressedKVCache` per segment. Only `rocketkv_cli.store` turns
these into bytes and strings and back. Pure torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from .config import Budgets, PrefillConfig
from .quant import FLOAT_DTYPES, KVStorage, decode_layer, encode_layer


def tensor_bytes(tensors) -> int:
    """Bytes of memory the given tensors hold, each underlying storage counted once (views of one
    buffer share it): what keeping them costs, not what they show."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class LayerKV:
    """One layer's kept tokens: keys/values `[1, Hkv, S, D]`, positions `[1, Hkv, S]` int64.

    S = tokens this layer kept (each KV head its own tokens, the same count); positions are the
    tokens' original RoPE positions, ascending per head. stored: for integer storage, the encoded
    tensors (`core.quant.encode_layer`) that keys/values were dequantized from; None otherwise.
    Raises:
        ValueError: shapes that disagree.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    stored: dict[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

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
        """Bytes of keys + values as stored (positions not counted: the KV cache proper)."""
        if self.stored is not None:
            return sum(t.numel() * t.element_size() for t in self.stored.values())
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def to_storage(self, storage: KVStorage, rope_freqs: torch.Tensor | None = None,
                   key_weights: torch.Tensor | None = None) -> LayerKV:  # fmt: skip
        """This layer as `storage` holds it: cast for a float dtype; for an integer one, encoded
        (`stored`) with keys/values replaced by their float32 dequantization. Positions unchanged.
        rope_freqs `[D/2]`: the layer's RoPE frequencies, for the pre-RoPE key basis (None: no
        rotation, still exact). key_weights `[Hkv, D]`: E[q_c²] per key channel, for allocated
        key bits (None: channels weighted alike). Raises ValueError: bad key weights."""
        if storage.kv_dtype == "auto":
            return self
        if not storage.is_integer:
            dtype = FLOAT_DTYPES[storage.kv_dtype]
            return LayerKV(self.keys.to(dtype), self.values.to(dtype), self.positions)
        parts = encode_layer(self.keys[0], self.values[0], storage, self.positions[0], rope_freqs, key_weights)
        return LayerKV.from_stored(parts, self.positions, storage, self.keys.shape[-1])

    @staticmethod
    def from_stored(parts: dict[str, torch.Tensor], positions: torch.Tensor, storage: KVStorage, head_dim: int):
        """A layer from integer-stored tensors and positions `[1, Hkv, S]` (keys/values dequantized)."""
        keys, values = decode_layer(parts, storage, head_dim, positions[0])
        return LayerKV(keys.unsqueeze(0), values.unsqueeze(0), positions, stored=parts)


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
    storage: how keys/values are stored (`auto` = as the model computed them). weights: the weight
    format of the model that computed them ("float", "bf16", "int8", "int4"; `head-bf16` and
    `head-int4` prefill as float does and record "float").
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
    storage: KVStorage = KVStorage()
    weights: str = "float"
    created_at: str | None = None
    format_version: int | None = None
    rocketkv_version: str | None = None

    def with_(self, **changes) -> CacheInfo:
        return replace(self, **changes)

    def budgets_record(self) -> dict[str, int]:
        """The budgets and the pool kernel as one record, keys sorted (as files and `--json` show them)."""
        return dict(sorted((self.budgets.to_dict() | {"pool_kernel_size": self.pool_kernel_size}).items()))


class CompressedKVCache:
    """A document's pruned KV cache: one `LayerKV` per decoder layer, and its `CacheInfo`.

    token_ids: `[n]` int32, the framed document's token ids (n = n_context_tokens), or None.
    token_offsets: `[n]` int64, each token's first character in the source document (-1 for the
    prompt framing); token_lines: `[n]` int32, its 1-based line there (0 for the framing); None
    when unknown (files written before they were stored). `layers` may be read lazily from a file
    (`loader`, called once on first use; `release()` forgets them again).
    """

    def __init__(
        self,
        info: CacheInfo,
        layers: tuple[LayerKV, ...] | None = None,
        token_ids: torch.Tensor | None = None,
        token_offsets: torch.Tensor | None = None,
        token_lines: torch.Tensor | None = None,
        loader: Callable[[], tuple[LayerKV, ...]] | None = None,
    ):
        if (layers is None) == (loader is None):
            raise ValueError("give the layers or a loader, not both")
        self.info = info
        self._layers = layers
        self._loader = loader
        self._codes: tuple[tuple[dict[str, torch.Tensor], torch.Tensor], ...] | None = None  # kept by `compact`
        self.token_ids = token_ids
        self.token_offsets = token_offsets
        self.token_lines = token_lines
        if layers is not None:
            self._check(layers)

    def _check(self, layers: tuple[LayerKV, ...]) -> None:
        if len(layers) != self.info.identity.n_layers:
            raise ValueError(f"{len(layers)} layers for a model of {self.info.identity.n_layers}")

    @property
    def layers(self) -> tuple[LayerKV, ...]:
        if self._layers is None:
            assert self._loader is not None
            layers = self._loader()
            self._check(layers)
            self._layers = layers
        return self._layers

    @property
    def resident_bytes(self) -> int:
        """Bytes this cache holds in memory now (`tensor_bytes`): its layers (the float keys and
        values, their positions and the stored codes they were decoded from) once read, and its
        token arrays; layers not yet read (a lazy file) count nothing. A file's size
        understates what its cache costs once answered from: int8 or int4 codes are decoded to
        float32, 4–8 times their bytes."""
        layers = self._layers or ()
        tensors = [t for layer in layers for t in (layer.keys, layer.values, layer.positions,
                                                   *(layer.stored or {}).values())]  # fmt: skip
        codes = [t for parts, pos in self._codes or () for t in (*parts.values(), pos)]  # kept by `compact`
        return tensor_bytes([*tensors, *codes, self.token_ids, self.token_offsets, self.token_lines])

    def compact(self) -> None:
        """Drop the float32 keys and values decoded from integer codes, keeping the codes and
        positions (read, and verified, already): the next use decodes them again, without
        reading the file, so the cache still answers from the bytes it verified. For a decoder
        that holds its own copy: 4–8× less memory. No-op when the layers are not read or are
        stored as floats."""
        layers = self._layers
        if layers is None or any(layer.stored is None for layer in layers):
            return
        storage, head_dim = self.info.storage, self.info.identity.head_dim
        kept = tuple((layer.stored, layer.positions) for layer in layers if layer.stored is not None)

        def decode_again() -> tuple[LayerKV, ...]:
            return tuple(LayerKV.from_stored(dict(parts), pos, storage, head_dim) for parts, pos in kept)

        self._codes = kept
        self._layers, self._loader = None, decode_again

    def release(self) -> None:
        """Forget layers read lazily (they are read again on next use); no-op for in-memory ones."""
        if self._loader is not None:
            self._layers = None

    def with_info(self, info: CacheInfo) -> CompressedKVCache:
        return CompressedKVCache(info, self.layers, self.token_ids, self.token_offsets, self.token_lines)

    @property
    def n_context_tokens(self) -> int:
        return self.info.n_context_tokens

    @property
    def n_segments(self) -> int:
        return 1

    @contextlib.contextmanager
    def layers_for_now(self) -> Iterator[tuple[LayerKV, ...]]:
        """The layers for the block; layers read lazily for it are released after it, so that
        going over every segment of a book holds one segment's KV at a time, not the whole file's."""
        read_now = self._layers is None
        try:
            yield self.layers
        finally:
            if read_now:
                self.release()

    def _measured(self, measure: Callable[[tuple[LayerKV, ...]], int]) -> int:
        """`measure(self.layers)`, the layers read for it released again (`layers_for_now`)."""
        with self.layers_for_now() as layers:
            return measure(layers)

    @property
    def max_kept_tokens(self) -> int:
        """Most tokens any layer kept (per KV head)."""
        return self._measured(lambda layers: max(layer.n_kept_tokens for layer in layers))

    @property
    def kv_bytes(self) -> int:
        """Bytes of every layer's keys and values as stored (`LayerKV.nbytes`)."""
        return self._measured(lambda layers: sum(layer.nbytes for layer in layers))


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

    @property
    def resident_bytes(self) -> int:
        """`CompressedKVCache.resident_bytes` summed over the segments (those read so far)."""
        return sum(s.resident_bytes for s in self.segments)


AnyCache = CompressedKVCache | SegmentedKVCache


def full_kv_bytes(
    n_context_tokens: int, layer_windows: tuple[int | None, ...] | list[int | None], n_kv_heads: int, head_dim: int,
    element_bytes: int,
) -> int:  # fmt: skip
    """Bytes of the unpruned KV cache of a document (keys + values; sliding layers hold their window)."""
    tokens = sum(min(n_context_tokens, w) if w else n_context_tokens for w in layer_windows)
    return 2 * n_kv_heads * tokens * head_dim * element_bytes
