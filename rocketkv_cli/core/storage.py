"""The storage type of a compressed cache's keys and values (`KVStorage`): a float dtype, or
group-wise integers (int8, int4) with an optional key basis, sink tokens and allocated key bits.

What each name means and how it parses (`KVStorage.parse`, `KVStorage.name`); the codecs that
encode and decode a layer under it are in `core/quant.py`. Pure Python (torch only for the
float dtype table).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4", "float64")  # float64: tests' tiny models
FLOAT_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
ROTATIONS = ("none", "hadamard", "rope")  # integer storage's key basis (measured: docs/storage.md)
SINK_TOKENS = 4  # integer storage: each head's first stored tokens kept in float16 (measured: docs/storage.md)
KEY_BITS = ("uniform", "allocated")  # int4 keys: every channel 4 bits, or widths allocated per channel
ALLOC_WIDTHS = (2, 3, 4, 5, 6, 7, 8)  # the widths allocation may give a key channel (bits)


@dataclass(frozen=True)
class KVStorage:
    """Storage of keys and values in a `.kv` file (and in memory, so both answer alike).

    kv_dtype: auto (the model's dtype: nothing changes), float32, bfloat16, float16 (cast), or
        int8 / int4 (group-wise integers).
    key_group_tokens: tokens per key group (one min/scale per channel and group).
    value_group_dims: channels per value group (one min/scale per token and group).
    rotation: the basis keys are quantized in — "none" (the default): as the KV cache holds them;
        "rope": each key first rotated back by its RoPE angles (position × the layer's
        frequencies), so channels are grouped as the model computed them before RoPE mixed each
        channel pair with its position (KVQuant, Hooper et al., arXiv 2401.18079 §3.1; measured:
        better on Gemma 3 at 32K tokens, worse at 8K and on SmolLM2); "hadamard": rotated along
        the head dimension. Float storage: "none".
    sink_tokens: integer storage keeps each KV head's first `sink_tokens` stored tokens in
        float16 (tokens, ≥ 0); float storage has none (any value given is replaced by 0).
    key_bits: "uniform" (every key channel `bits` wide) or "allocated" (int4 only, in the
        default key basis: each channel of a head its own width in `ALLOC_WIDTHS`, 4 on average,
        by the expected logit error; `allocate_key_bits`).
    Raises:
        ValueError: an unknown dtype, rotation or key_bits, a non-positive group size, a negative
        sink count, allocated key bits with a dtype other than int4 or with a rotation.
    """

    kv_dtype: str = "auto"
    key_group_tokens: int = 64
    value_group_dims: int = 64
    rotation: str = "none"
    sink_tokens: int = SINK_TOKENS
    key_bits: str = "uniform"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        for name in ("key_group_tokens", "value_group_dims"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.rotation != "none" and not self.is_integer:
            raise ValueError(f"rotation {self.rotation!r} only applies to integer kv_dtype, got {self.kv_dtype}")
        sinks = self.sink_tokens
        if isinstance(sinks, bool) or not isinstance(sinks, int) or not 0 <= sinks <= 1 << 20:
            raise ValueError(f"sink_tokens must be an integer in [0, 2^20], got {sinks!r}")
        if not self.is_integer and sinks:
            object.__setattr__(self, "sink_tokens", 0)  # float storage holds every token as it is
        if self.key_bits not in KEY_BITS:
            raise ValueError(f"key_bits must be one of {', '.join(KEY_BITS)}, got {self.key_bits!r}")
        if self.key_bits == "allocated" and (self.kv_dtype != "int4" or self.rotation != "none"):
            raise ValueError(
                "allocated key bits need int4 in the default key basis, "
                f"got {self.kv_dtype} with rotation {self.rotation}"
            )

    @property
    def is_integer(self) -> bool:
        return self.kv_dtype in ("int8", "int4")

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}.get(self.kv_dtype, 0)

    def to_dict(self) -> dict:
        """The fields as a dict; `key_bits` only when allocated (format v5 added it, and a
        uniform storage's record stays what v4 wrote)."""
        d = asdict(self)
        if self.key_bits == "uniform":
            del d["key_bits"]
        return d

    @staticmethod
    def parse(name: str) -> KVStorage:
        """A storage from its name: a kv dtype, then optionally a key basis (`+rope`, `+hadamard`),
        `+alloc` (allocated key bits) and `+sinksN` (N sink tokens instead of the default):
        `int4`, `int4+rope`, `int4+alloc`, `int4+sinks0`. Raises ValueError naming the value."""
        dtype, *extras = name.split("+")
        rotation, sinks, chosen, sinks_named = "none", SINK_TOKENS, False, False
        key_bits = "uniform"
        for extra in extras:
            if extra == "alloc":
                if key_bits == "allocated":
                    raise ValueError(f"storage {name!r} names alloc twice")
                key_bits = "allocated"
            elif extra in ROTATIONS:
                if chosen:
                    raise ValueError(f"storage {name!r} names two key bases; choose one of rope, hadamard")
                rotation, chosen = extra, True
            elif extra.startswith("sinks") and extra[5:].isascii() and extra[5:].isdigit():
                if sinks_named:
                    raise ValueError(f"storage {name!r} names the sink count twice; give one sinksN")
                if len(extra) > 12:  # more digits than any count: said as the range, not as an unknown option
                    raise ValueError(f"sink_tokens must be an integer in [0, 2^20], got {extra[5:]}")
                sinks, sinks_named = int(extra[5:]), True
            else:
                raise ValueError(f"unknown storage option {extra!r} in {name!r} (known: rope, hadamard, alloc, sinksN)")
        if sinks_named and dtype not in ("int8", "int4"):
            raise ValueError(
                f"storage {name!r}: sinksN only applies to int8 and int4 (float storage keeps every token)"
            )
        if key_bits == "allocated" and (dtype != "int4" or rotation != "none"):
            raise ValueError(f"storage {name!r}: alloc only applies to int4 without a key rotation")
        return KVStorage(dtype, rotation=rotation, sink_tokens=sinks, key_bits=key_bits)

    @property
    def name(self) -> str:
        """The name `parse` reads back: `int4`, `int4+rope`, `int4+alloc`, `int8+hadamard+sinks0`."""
        out = self.kv_dtype + ("" if self.rotation == "none" else f"+{self.rotation}")
        out += "+alloc" if self.key_bits == "allocated" else ""
        return out + (f"+sinks{self.sink_tokens}" if self.is_integer and self.sink_tokens != SINK_TOKENS else "")


def resolved(storage: KVStorage, model_dtype: str) -> KVStorage:
    """`storage` with `auto` replaced by the model's dtype name."""
    if storage.kv_dtype != "auto":
        return storage
    return KVStorage(
        model_dtype, storage.key_group_tokens, storage.value_group_dims, storage.rotation, storage.sink_tokens
    )


def layer_part_names(storage: KVStorage) -> tuple[str, ...]:
    """Names of the tensors `encode_layer` returns under an integer `storage`."""
    sinks = ("sinks.keys", "sinks.values") if storage.sink_tokens else ()
    rope = ("keys.rope_freqs",) if storage.rotation == "rope" else ()
    bits = ("keys.bits",) if storage.key_bits == "allocated" else ()
    return ("keys.q", "keys.min", "keys.scale", "values.q", "values.min", "values.scale", *sinks, *rope, *bits)
