"""How a compressed cache's keys and values are stored: a float dtype, or group-wise integers.

Integer storage is asymmetric round-to-nearest with one (minimum, scale) pair per group, the
KIVI layout (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
arXiv 2402.02750, §3): keys are grouped per channel along the tokens (their outliers sit in fixed
channels), values per token along the channels. Optionally keys are quantized before RoPE: each
rotated back by its position's RoPE angles (KVQuant, Hooper et al., arXiv 2401.18079 §3.1: RoPE
makes a channel with a steady value swing with the position, widening its group's range) and
rotated forward again after dequantization; or rotated by an orthonormal Hadamard matrix along
the head dimension (spreading outlier channels, as in QuaRot, arXiv 2404.00456 §4). Each KV head's first `sink_tokens`
stored tokens (the attention sinks: position 0 and the document's first tokens, which stage 1
keeps) are held apart in float16, outside the integer groups — the pivot tokens of IntactKV (Liu
et al., arXiv 2403.01241 §3): they draw most of the attention, so their rounding error reaches
every query, and their outlier magnitudes would widen the range of the first key group. Measured
in docs/storage.md (SmolLM2 int4: top-1 agreement 0.95 without, 0.99 with). Scales, minimums and
sinks are float16 when they fit, else float32. Dequantization happens in float32 and is deterministic, so a cache
quantized in memory and the same cache read back from a file hold bit-identical values.

Allocated key bits (`int4+alloc`): int4's bytes, but each key channel of a head gets its own
width in `ALLOC_WIDTHS` (4 bits on average per head), chosen to minimise the expected error of
the attention logits q·k. A channel c rounded in a token group of range r with b bits errs by
about r²/(12·(2^b−1)²) in mean square, and reaches a logit weighted by E[q_c²]; minimising
Σ_c E[q_c²]·mean r_c²/(2^b_c−1)² under Σ_c b_c ≤ 4·D is reverse water-filling, the bit
allocation of transform coding (as KVTC, arXiv 2511.01815 §3, allocates bits over PCA components).
E[q_c²] comes from the document's own observation-window queries (`Engine.prefill`), so the
allocation depends on nothing but the document. Measured in docs/storage.md.
The storage type itself (`KVStorage`, its names and parsing) is in `core/storage.py`. Pure torch.
"""

from __future__ import annotations

import math

import torch

from .storage import (  # noqa: F401  (re-exported: callers import the storage type from here)
    ALLOC_WIDTHS,
    FLOAT_DTYPES,
    KVStorage,
    layer_part_names,
    resolved,
)

_F16_MAX = 65504.0


def hadamard(dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An orthonormal `[dim, dim]` rotation: Sylvester's Hadamard matrix / √block, block-diagonal
    with the largest power-of-two block dividing dim (the whole matrix when dim is a power of two).
    Built in float64; exact in float32 too when the block is a power of four (16, 64, 256)."""
    block = dim & -dim  # largest power of two dividing dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(block)
    return torch.block_diag(*([h] * (dim // block))).to(device, dtype)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Keys `x` `[Hkv, S, D]` rotated by their RoPE angles (`positions` `[Hkv, S]` × `freqs`
    `[D/2]` radians per token, in float64), channel i paired with i + D/2 as transformers'
    `rotate_half` pairs them; `inverse` rotates back. Orthonormal per pair, so ‖R x − R y‖ =
    ‖x − y‖: rounding error in the rotated basis is the error in the original one.
    Raises ValueError: an odd head dim or freqs not `[D/2]`."""
    d = x.shape[-1]
    if d % 2 or freqs.shape != (d // 2,):
        raise ValueError(f"RoPE rotation needs an even head_dim and [D/2] frequencies, got {d}, {tuple(freqs.shape)}")
    angles = positions.to(torch.float64).unsqueeze(-1) * freqs.to(torch.float64)  # [Hkv, S, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if inverse:
        sin = -sin
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _scale_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float16 when every value fits its range with margin, else float32."""
    biggest = max(float(t.abs().max()) if t.numel() else 0.0 for t in tensors)
    return torch.float16 if biggest < _F16_MAX / 2 else torch.float32


def _quantize_groups(x: torch.Tensor, bits: int | torch.Tensor) -> dict[str, torch.Tensor]:
    """Asymmetric quantization of `x` `[..., G, E]`: one (min, scale) per row of E elements.

    bits: one width for every row, or a tensor of widths broadcastable to `[..., G]` (allocated
    key bits: one per channel). Returns {"q": uint8 `[..., G, E]` (codes), "min": `[..., G]`,
    "scale": `[..., G]`}.
    """
    levels = (1 << bits) - 1 if isinstance(bits, int) else (2.0 ** bits.float() - 1)
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    dtype = _scale_dtype(lo, hi, hi - lo)
    stored = lo.to(dtype)  # rounded to the nearest: may land above the true minimum (then above hi)
    lo = torch.where(stored.float() > lo, torch.nextafter(stored, torch.full_like(stored, -torch.inf)), stored)
    scale = ((hi - lo.float()) / levels).clamp_min(0).to(dtype)  # ≥ 0: a constant group gets 0
    step = scale.float().unsqueeze(-1)
    codes = torch.where(step > 0, torch.round((x - lo.float().unsqueeze(-1)) / step.clamp_min(1e-30)), 0.0)
    top = levels if isinstance(levels, int) else levels.unsqueeze(-1).expand_as(codes)
    return {"q": torch.minimum(codes.clamp_(min=0), torch.as_tensor(top)).to(torch.uint8), "min": lo, "scale": scale}


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim (even length): `[..., D]` → `[..., D/2]`."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def allocate_key_bits(keys: torch.Tensor, weight: torch.Tensor | None, group_tokens: int,
                      average: int = 4) -> torch.Tensor:  # fmt: skip
    """Bits per key channel `[Hkv, D]` uint8, each in `ALLOC_WIDTHS`, summing to average·D per head
    (less only when no channel gains from more: constant keys, zero weights): the widths b
    minimising Σ_c weight_c · mean_g range_cg² / (2^b_c − 1)², the expected squared error of a
    logit q·k when channel c is rounded in token groups of range range_cg (module docstring).
    Solved per head by bisection on the multiplier λ of the bit
    budget (each channel then takes argmin_b importance·err(b) + λ·b), and the bits λ leaves
    unspent given one at a time to the channel whose error drops most. Deterministic; computed on
    the CPU (a `[Hkv, D]` problem), returned on the keys' device.

    keys: `[Hkv, S, D]` float, the tokens in integer groups (groups of `group_tokens` tokens).
    weight: `[Hkv, D]` E[q_c²] per channel, ≥ 0 (None: every channel alike, the allocation then
    follows the ranges alone).
    Raises ValueError: a weight of another shape, or negative or not finite.
    """
    hkv, s, d = keys.shape
    if weight is not None and weight.shape != (hkv, d):
        raise ValueError(f"key weights must be [Hkv, D] = {[hkv, d]}, got {list(weight.shape)}")
    if weight is not None and (not bool(torch.isfinite(weight).all()) or bool((weight < 0).any())):
        raise ValueError("key weights must be finite and ≥ 0 (E[q²] of the observation window)")
    if s == 0:
        return torch.full((hkv, d), average, dtype=torch.uint8, device=keys.device)
    n = -(-s // group_tokens)
    x = keys.detach().to("cpu", torch.float64)  # [Hkv, D]-sized work below: no device syncs per step
    if n * group_tokens > s:
        x = torch.cat([x, x[:, -1:].expand(hkv, n * group_tokens - s, d)], dim=1)
    grouped = x.view(hkv, n, group_tokens, d)
    spread = ((grouped.amax(2) - grouped.amin(2)) ** 2).mean(1)  # [Hkv, D]
    importance = spread * (1.0 if weight is None else weight.detach().to("cpu", torch.float64))
    importance = torch.nan_to_num(importance, nan=0.0, posinf=0.0)  # keys that are not finite: nothing to weigh
    widths = torch.tensor(ALLOC_WIDTHS, dtype=torch.float64)
    err = 1 / (2**widths - 1) ** 2  # [W]
    out = torch.empty(hkv, d, dtype=torch.long)
    for head in range(hkv):
        top = float(importance[head].max())
        cost = importance[head, :, None] * err / (top if top > 0 else 1.0)  # [D, W], ≤ 1: λ's range is fixed
        lo, hi = 0.0, 2.0  # λ = hi: every channel at the narrowest width
        for _ in range(60):
            lam = (lo + hi) / 2
            if float(widths[(cost + lam * widths).argmin(-1)].sum()) > average * d:
                lo = lam
            else:
                hi = lam
        pick = (cost + hi * widths).argmin(-1)  # [D] index into ALLOC_WIDTHS
        left = average * d - int(widths[pick].sum())
        while left > 0:  # consecutive widths: each step is one bit
            nxt = (pick + 1).clamp(max=len(ALLOC_WIDTHS) - 1)
            gain = torch.where(
                nxt > pick, cost.gather(1, pick[:, None])[:, 0] - cost.gather(1, nxt[:, None])[:, 0], -1.0
            )
            if float(gain.max()) <= 0:  # nothing left to gain (constant channels, zero weights): bits unspent
                break
            pick[int(gain.argmax())] += 1
            left -= 1
        out[head] = widths[pick].long()
    return out.to(torch.uint8).to(keys.device)


STREAM_SLACK_BYTES = (
    8  # allocated key bits: per head (so ≥ 8 per layer), room for each width block (≤ 8) to end on a byte
)


def alloc_stream_bytes(n_tokens: int, head_dim: int) -> int:
    """Bytes per head of a layer's allocated-key-bits stream for n_tokens tokens: int4's n·D/2,
    plus `STREAM_SLACK_BYTES` (the layer's stream pads up to 8 width blocks, ≤ 7 bits each)."""
    return n_tokens * head_dim // 2 + STREAM_SLACK_BYTES


def _pack_fixed(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Codes `[N]` (each < 2^width) as ⌈N·width/8⌉ bytes: code i at bits i·width …, least
    significant first. Eight codes fill `width` bytes exactly, so they are packed as one word."""
    n = codes.numel()
    padded = torch.cat([codes.long(), codes.new_zeros(-n % 8).long()]).view(-1, 8)
    # the codes' bits never overlap, so the sum is their OR (width 8: the top byte wraps into the sign bit, bits kept)
    word = (padded << (width * torch.arange(8, device=codes.device))).sum(1, keepdim=True)  # [N/8, 1]
    out = (word >> (8 * torch.arange(width, device=codes.device))) & 0xFF  # [N/8, width]
    return out.flatten()[: -(-n * width // 8)].to(torch.uint8)


def _unpack_fixed(data: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Codes `[N]` uint8 from `_pack_fixed`'s bytes."""
    groups = -(-n // 8)
    padded = torch.cat([data.long(), data.new_zeros(groups * width - data.numel()).long()]).view(groups, width)
    word = (padded << (8 * torch.arange(width, device=data.device))).sum(1, keepdim=True)  # [N/8, 1]
    codes = (word >> (width * torch.arange(8, device=data.device))) & ((1 << width) - 1)  # [N/8, 8]
    return codes.flatten()[:n].to(torch.uint8)


def _pack_bits(codes: torch.Tensor, widths: torch.Tensor, n_bytes: int) -> torch.Tensor:
    """Rows of codes `[R, S]` (row r's below 2^widths[r]) as a uint8 stream `[n_bytes]`: a block
    per width present, narrowest first; a block holds its rows' codes in row order, each row's
    token by token, `_pack_fixed` at that width, and ends on a byte; zeros
    after the last block. Raises ValueError: a stream longer than n_bytes."""
    blocks = []
    for width in sorted(set(widths.tolist())):
        blocks.append(_pack_fixed(codes[widths == width].flatten(), int(width)))
    stream = torch.cat(blocks) if blocks else codes.new_zeros(0)
    if stream.numel() > n_bytes:
        raise ValueError(f"{8 * stream.numel()} bits do not fit {n_bytes} bytes")
    return torch.cat([stream, stream.new_zeros(n_bytes - stream.numel())])


def _unpack_bits(stream: torch.Tensor, widths: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Codes `[R, S]` uint8 from `_pack_bits`' stream (S = n_tokens). Raises ValueError: a
    stream shorter than the widths need."""
    out = torch.zeros(widths.shape[0], n_tokens, dtype=torch.uint8, device=stream.device)
    at = 0
    for width in sorted(set(widths.tolist())) if n_tokens else ():
        rows = widths == width
        n = int(rows.sum()) * n_tokens
        size = -(-n * int(width) // 8)
        if at + size > stream.numel():
            raise ValueError(f"{8 * (at + size)} bits of codes in a {stream.numel()}-byte stream")
        out[rows] = _unpack_fixed(stream[at : at + size], int(width), n).view(-1, n_tokens)
        at += size
    return out


def encode_keys(keys: torch.Tensor, storage: KVStorage, positions: torch.Tensor | None = None,
                rope_freqs: torch.Tensor | None = None, key_weights: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:  # fmt: skip
    """The stored form of keys `[Hkv, S, D]` (rotated into the storage's basis, then per channel in
    token groups). positions `[Hkv, S]` and rope_freqs `[D/2]`: needed by the `rope` basis.
    key_weights `[Hkv, D]`: E[q_c²] for allocated key bits (`allocate_key_bits`; None: equal).

    Returns {"q": uint8 `[Hkv, S, D]` (int4: `[Hkv, S, D/2]`), "min"/"scale": `[Hkv, ⌈S/Gt⌉, D]`};
    allocated key bits add "bits": uint8 `[Hkv, D]`, and "q" is the layer's `_pack_bits` stream over
    the rows (head, channel) in that order, viewed as `[Hkv, alloc_stream_bytes(S, D)]` (int4's
    S·D/2 bytes and 8 of slack per head).
    Raises ValueError: the `rope` basis without positions or frequencies; bad key weights.
    """
    x = keys.float()
    if storage.rotation == "hadamard":
        x = x @ hadamard(x.shape[-1], x.device)
    elif storage.rotation == "rope":
        if positions is None or rope_freqs is None:
            raise ValueError("pre-RoPE key storage needs the keys' positions and the layer's RoPE frequencies")
        x = rope_rotate(x, positions, rope_freqs, inverse=True)
    hkv, s, d = x.shape
    g = storage.key_group_tokens
    n_groups = -(-s // g)
    pad = n_groups * g - s
    if pad:  # repeat the last token: a group's min and max do not change
        x = torch.cat([x, x[:, -1:].expand(hkv, pad, d)], dim=1)
    grouped = x.view(hkv, n_groups, g, d).transpose(2, 3)  # [Hkv, G, D, Gt]
    widths = allocate_key_bits(x[:, :s], key_weights, g, storage.bits) if storage.key_bits == "allocated" else None
    parts = _quantize_groups(grouped, storage.bits if widths is None else widths[:, None, :])
    q = parts["q"].transpose(2, 3).reshape(hkv, n_groups * g, d)[:, :s]  # [Hkv, S, D]
    out = {"q": q.contiguous(), "min": parts["min"].contiguous(), "scale": parts["scale"].contiguous()}
    if widths is not None:
        rows = q.permute(0, 2, 1).reshape(hkv * d, s)  # [Hkv·D, S]: head by head, channel by channel
        stream = _pack_bits(rows, widths.flatten(), hkv * alloc_stream_bytes(s, d))  # one stream for the layer
        out["q"] = stream.view(hkv, alloc_stream_bytes(s, d))
        out["bits"] = widths
    elif storage.bits == 4:
        out["q"] = _pack4(out["q"])
    return out


def decode_keys(
    parts: dict[str, torch.Tensor],
    storage: KVStorage,
    head_dim: int,
    positions: torch.Tensor | None = None,
    rope_freqs: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 keys `[Hkv, S, D]` from `encode_keys`'s parts (rotation undone; the `rope` basis
    needs the same positions `[Hkv, S]` and frequencies `[D/2]`; allocated key bits their
    "bits"), written into `out` `[Hkv, S, D]` float32 when given (returned). Raises ValueError
    without them."""
    if storage.key_bits == "allocated":
        hkv, d = parts["bits"].shape
        s = (parts["q"].shape[1] - STREAM_SLACK_BYTES) * 2 // d  # alloc_stream_bytes, inverted
        rows = _unpack_bits(parts["q"].flatten(), parts["bits"].flatten(), s)  # [Hkv·D, S]
        q = rows.view(hkv, d, s).transpose(1, 2)  # [Hkv, S, D]
    else:
        q = _unpack4(parts["q"]) if storage.bits == 4 else parts["q"]
    g = storage.key_group_tokens
    rotated = storage.rotation in ("hadamard", "rope")
    x = _dequantize(q, parts["scale"], parts["min"], dim=1, group=g, out=None if rotated else out)  # per channel
    if storage.rotation == "hadamard":
        x = x @ hadamard(head_dim, x.device).T
    elif storage.rotation == "rope":
        if positions is None or rope_freqs is None:
            raise ValueError("pre-RoPE key storage needs the keys' positions and the layer's RoPE frequencies")
        x = rope_rotate(x, positions, rope_freqs.float(), inverse=False)
    return out.copy_(x) if out is not None and rotated else x


def encode_values(values: torch.Tensor, storage: KVStorage) -> dict[str, torch.Tensor]:
    """The stored form of values `[Hkv, S, D]`: per token, in channel groups of `value_group_dims`.

    Returns {"q": uint8 `[Hkv, S, D]` (int4: `[Hkv, S, D/2]`), "min"/"scale": `[Hkv, S, ⌈D/Gd⌉]`}.
    """
    x = values.float()
    hkv, s, d = x.shape
    g = min(storage.value_group_dims, d)
    n_groups = -(-d // g)
    pad = n_groups * g - d
    if pad:
        x = torch.cat([x, x[..., -1:].expand(hkv, s, pad)], dim=2)
    parts = _quantize_groups(x.view(hkv, s, n_groups, g), storage.bits)
    q = parts["q"].reshape(hkv, s, n_groups * g)[..., :d].contiguous()
    out = {"q": q, "min": parts["min"].contiguous(), "scale": parts["scale"].contiguous()}
    if storage.bits == 4:
        out["q"] = _pack4(q)
    return out


def decode_values(parts: dict[str, torch.Tensor], storage: KVStorage, out: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 values `[Hkv, S, D]` from `encode_values`'s parts, written into `out` when given."""
    q = _unpack4(parts["q"]) if storage.bits == 4 else parts["q"]
    g = min(storage.value_group_dims, q.shape[2])
    return _dequantize(q, parts["scale"], parts["min"], dim=2, group=g, out=out)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dim: int, group: int,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Float32 `q · scale + lo` `[Hkv, S, D]` from codes `q` `[Hkv, S, D]`, where `scale` and `lo`
    hold one number per `group` consecutive elements along `dim` (1: tokens, keys' `[Hkv, ⌈S/g⌉, D]`;
    2: channels, values' `[Hkv, S, ⌈D/g⌉]`; the last group may be short). Each group's numbers are
    broadcast over it, not gathered into full-size copies: the same float32 products and sums
    (bit for bit), in three passes over the layer instead of seven.
    out: float32 `[Hkv, S, D]` to write into (a view of a larger buffer: no copy afterwards).
    Raises ValueError: `scale`/`lo` do not have ⌈size/group⌉ groups along `dim`, or `out` another shape."""
    if out is not None and (out.shape != q.shape or out.dtype != torch.float32):
        raise ValueError(f"out must be float32 {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    x = q.float() if out is None else out.copy_(q)  # [Hkv, S, D], scaled in place
    size, n_groups = x.shape[dim], -(-x.shape[dim] // group)
    if scale.shape[dim] != n_groups or lo.shape != scale.shape:
        raise ValueError(f"{n_groups} quantization groups expected along dim {dim}, got {tuple(scale.shape)}")
    full = size // group
    if full:
        head = x.narrow(dim, 0, full * group)
        shape = (*head.shape[:dim], full, group, *head.shape[dim + 1 :])
        sc, mn = scale.narrow(dim, 0, full).float(), lo.narrow(dim, 0, full).float()
        head.view(shape).mul_(sc.unsqueeze(dim + 1)).add_(mn.unsqueeze(dim + 1))
    if size > full * group:  # the short last group
        tail = x.narrow(dim, full * group, size - full * group)
        tail.mul_(scale.narrow(dim, full, 1).float()).add_(lo.narrow(dim, full, 1).float())
    return x


def encode_layer(keys: torch.Tensor, values: torch.Tensor, storage: KVStorage, positions: torch.Tensor | None = None,
                 rope_freqs: torch.Tensor | None = None, key_weights: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:  # fmt: skip
    """The stored tensors of one layer's keys/values `[Hkv, S, D]` under an integer `storage`.

    With s = min(sink_tokens, S): `sinks.keys` / `sinks.values` `[Hkv, s, D]` float16 (float32
    when out of its range) hold the first s tokens; `keys.q`, `keys.min`, `keys.scale`,
    `values.q`, `values.min`, `values.scale` encode the other S − s (`encode_keys`, `encode_values`);
    the `rope` basis adds `keys.rope_freqs` `[D/2]` float32, the layer's RoPE frequencies (radians
    per token; None: zeros, no rotation), used with the keys' positions `[Hkv, S]`; allocated key
    bits add `keys.bits` `[Hkv, D]` uint8, chosen with key_weights `[Hkv, D]` (E[q_c²]; None: equal).
    Raises ValueError: int4 with an odd head dim; the `rope` basis without positions or with an
    odd head dim; bad key weights."""
    if storage.bits == 4 and keys.shape[-1] % 2:
        raise ValueError(f"int4 storage needs an even head_dim, got {keys.shape[-1]}")
    n_sinks = min(storage.sink_tokens, keys.shape[1])
    freqs = None
    if storage.rotation == "rope":
        if keys.shape[-1] % 2:
            raise ValueError(f"pre-RoPE key storage needs an even head_dim, got {keys.shape[-1]}")
        freqs = torch.zeros(keys.shape[-1] // 2) if rope_freqs is None else rope_freqs.detach().float().cpu()
        freqs = freqs.to(keys.device).contiguous()
        positions = None if positions is None else positions[:, n_sinks:]
    parts = {f"keys.{k}": v for k, v in encode_keys(keys[:, n_sinks:], storage, positions, freqs, key_weights).items()}
    if freqs is not None:
        parts["keys.rope_freqs"] = freqs
    parts.update({f"values.{k}": v for k, v in encode_values(values[:, n_sinks:], storage).items()})
    if storage.sink_tokens:
        sink_k, sink_v = keys[:, :n_sinks].float(), values[:, :n_sinks].float()
        dtype = _scale_dtype(sink_k, sink_v)
        parts["sinks.keys"], parts["sinks.values"] = sink_k.to(dtype).contiguous(), sink_v.to(dtype).contiguous()
    return parts


def decode_layer(
    parts: dict[str, torch.Tensor], storage: KVStorage, head_dim: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 (keys, values) `[Hkv, S, D]` from `encode_layer`'s tensors (sinks first); the
    `rope` basis needs the layer's positions `[Hkv, S]`. Raises ValueError without them."""
    n_sinks = parts["sinks.keys"].shape[1] if storage.sink_tokens else 0
    rest = None if positions is None else positions[:, n_sinks:]
    names = ("q", "min", "scale", "bits") if storage.key_bits == "allocated" else ("q", "min", "scale")
    keys = values = None
    if n_sinks:  # the sinks first, the rest decoded straight behind them (no concatenation of the layer)
        sink_k, sink_v = parts["sinks.keys"], parts["sinks.values"]  # [Hkv, n_sinks, D]
        n = n_sinks + parts["values.q"].shape[1]
        keys = sink_k.new_empty(sink_k.shape[0], n, sink_k.shape[2], dtype=torch.float32)
        values = sink_v.new_empty(sink_v.shape[0], n, sink_v.shape[2], dtype=torch.float32)
        keys[:, :n_sinks], values[:, :n_sinks] = sink_k, sink_v
    rest_k = decode_keys({k: parts[f"keys.{k}"] for k in names}, storage, head_dim, rest, parts.get("keys.rope_freqs"),
                         out=None if keys is None else keys[:, n_sinks:])  # fmt: skip
    rest_v = decode_values({k: parts[f"values.{k}"] for k in ("q", "min", "scale")}, storage,
                           out=None if values is None else values[:, n_sinks:])  # fmt: skip
    return (rest_k, rest_v) if keys is None or values is None else (keys, values)
