"""The weight-only linears of decode's weight formats (`model.weights`): bfloat16, int8 and int4
copies of an `nn.Linear`, each multiplying with torch's own CPU kernel for its format, and
`decode_step`, the context in which a forward runs decode's weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_DECODE_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("rocketkv_decode_step", default=False)


@contextlib.contextmanager
def decode_step() -> Iterator[None]:
    """Inside the block, the forward runs decode's weights: `Bf16Linear`'s bfloat16 copy and
    `RefinedHead`'s approximate head with its top logits refined. The engine wraps each
    generated token's forward in it, and an answer's teacher forcing (which must equal decode);
    prefill runs outside it. Integer linears use their codes either way (they keep no floats)."""
    token = _DECODE_STEP.set(True)
    try:
        yield
    finally:
        _DECODE_STEP.reset(token)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (the `avx512_bf16` or `amx_bf16` flag of
    Linux's /proc/cpuinfo; False where it cannot be read). Without them torch's bfloat16 products
    and attention are emulated and ran 4–8× slower than float32's on a CPU measured earlier; with
    them exact decode attention over bfloat16 keys and values ran 1.6–2.1× faster than over
    float32 (docs/performance.md, "A bfloat16 working set")."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_matvec(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`weight · x` for one bfloat16 row on a CPU: weight `[out, in]`, x `[in]` → `[out]`, both
    bfloat16, products exact, float32 accumulation, the output rounded to bfloat16 (as
    `F.linear` computes it). A decode step multiplies one row; torch's matrix-vector kernel
    (`torch.mv`) streams the weights 1.3–1.4× faster than `F.linear`'s matrix product of one row
    on a CPU (`benchmarks/decode_linears.py`). `tests/test_weights.py` compares the two."""
    return torch.mv(weight, x)


class _PackedLinear(nn.Module):
    """What the weight-only linears share: the shapes, the bias and `[..., in] → [..., out]` around
    their kernel's `[N, in] → [N, out]` product (`_product`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x.reshape(-1, self.in_features))  # [N, out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    # The tensors `join` concatenates along the output channels (dim 0 of each).
    _ROWS: tuple[str, ...] = ()

    @classmethod
    def join(cls, parts: list[nn.Module]) -> nn.Module | None:
        """One module of this class whose output `[..., Σ out]` is the outputs of `parts` side by
        side, computed in one kernel call: a decode step's q, k and v projections, or an MLP's
        gate and up, read their common input once and pay one call's overhead instead of three
        or two (`model/step.py`). Each output channel is computed as its part computes it (the same
        codes, scales and input rounding). The parts' tensors become views of the joined ones,
        so memory does not grow and the parts still work alone.

        Returns None unless every part is an instance of this class (exactly) with one input
        size. Bf16Linear's joined module has no float weights: it runs in decode steps only.
        """
        packed = [p for p in parts if isinstance(p, cls) and type(p) is cls]
        if not cls._ROWS or len(packed) < 2 or len(packed) != len(parts):
            return None
        if len({p.in_features for p in packed}) != 1:
            return None
        joined = cls.__new__(cls)
        nn.Module.__init__(joined)
        joined.in_features = packed[0].in_features
        joined.out_features = sum(p.out_features for p in packed)
        biases = [p.bias for p in packed]
        if all(b is None for b in biases):
            joined.register_buffer("bias", None)
        else:
            some = next(b for b in biases if b is not None)
            joined.register_buffer("bias", torch.cat([b if b is not None else some.new_zeros(p.out_features)
                                                      for p, b in zip(packed, biases, strict=True)]))  # fmt: skip
        for name in cls._ROWS:
            whole = torch.cat([getattr(p, name) for p in packed])
            joined.register_buffer(name, whole)
            start = 0
            for p in packed:
                setattr(p, name, whole[start : start + p.out_features])
                start += p.out_features
        if "float_weight" in vars(packed[0]):
            setattr(joined, "float_weight", None)  # a joined copy of the floats would double their memory
        return joined


class Bf16Linear(_PackedLinear):
    """`y = x · Ŵᵀ + b` in decode steps with Ŵ = W rounded to bfloat16 `[out, in]` (2 bytes per
    weight read per token); `y = x · Wᵀ + b` with the float weights W everywhere else.

    Inside `decode_step()` (each generated token; an answer's teacher forcing, which equals
    decode) the input is rounded to bfloat16 too and torch's bfloat16 kernel multiplies (each
    product exact, float32 accumulation, the output rounded to bfloat16): on a CPU row by row
    (`bf16_matvec`, decode's one row; teacher forcing's rows alike, so they equal decode's, at
    the cost of reading the weights once per row), on other devices `F.linear`. Prefill (the document
    and the question) multiplies by W exactly as the float model does: a CPU without native
    bfloat16 runs a bfloat16 product of many rows several times slower than float32, and a
    cache prefilled with W keeps the tokens the float model would keep (docs/performance.md
    measured the difference). So `--weights bf16` changes decode, not what `ingest` stores.
    Memory: W stays loaded beside Ŵ (6 bytes per weight); `float_weight` is a plain reference,
    not a buffer (the model is quantized after it is moved to its device and dtype, and never
    converted again). The output comes back in the input's dtype.
    """

    _ROWS = ("weight_bf16",)

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.weight_bf16: torch.Tensor
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16).contiguous())
        self.float_weight: torch.Tensor | None = linear.weight.detach()  # [out, in], the model's dtype

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        if _DECODE_STEP.get() or flat.dtype == torch.bfloat16:
            x = flat.to(torch.bfloat16)
            if x.device.type == "cpu" and (x.shape[0] == 1 or _DECODE_STEP.get()):
                # a decode step's row; teacher forcing's rows one by one, so that they are computed
                # exactly as decode computes them on any CPU (the two kernels may sum differently)
                if x.shape[0] == 1:  # the decode loop: no stacking copy
                    return bf16_matvec(self.weight_bf16, x[0]).unsqueeze(0).to(flat.dtype)  # [1, out]
                rows = [bf16_matvec(self.weight_bf16, row) for row in x]
                return (torch.stack(rows) if rows else x.new_empty(0, self.out_features)).to(flat.dtype)
            return F.linear(x, self.weight_bf16).to(flat.dtype)  # [N, out]
        if self.float_weight is None:
            raise RuntimeError("a joined bf16 linear has no float weights: it runs inside decode_step() only")
        return F.linear(flat, self.float_weight.to(flat.dtype))


class Int8Linear(_PackedLinear):
    """`y = x · Wᵀ + b` with W stored as int8 `[out, in]` and one scale per output channel.

    Quantization: scale_o = max_i |W[o, i]| / 127 rounded to bfloat16, W_q = round(W / scale)
    (symmetric, per channel, as in LLM.int8()'s weight path without outliers; Dettmers et al.,
    arXiv 2208.07339 §3). The product's input is rounded to bfloat16 (the kernel's fast path);
    the output comes back in the input's dtype.
    """

    _ROWS = ("weight_int8", "scales")
    # torch's kernel returns wrong values (up to 1e34 off, no error) when in_features is not a
    # multiple of 16 (torch 2.13, CPU; found by `tests/test_weights.py`), so such linears stay float.
    MULTIPLE = 16

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        return linear.in_features % cls.MULTIPLE == 0

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        if not self.fits(linear):
            raise ValueError(f"int8 needs in_features % {self.MULTIPLE} == 0, got [{linear.out_features}, "
                             f"{linear.in_features}]")  # fmt: skip
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).bfloat16().float()  # [out], as stored
        self.weight_int8: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.bfloat16())

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.weight_int8, self.scales)  # [N, out]
        return y.to(flat.dtype)


class Int4Linear(_PackedLinear):
    """`y = x · Ŵᵀ + b` with W `[out, in]` stored as 4-bit codes, one bfloat16 scale s and zero z
    per output channel and group of `GROUP` input channels: Ŵ = (code − 8) · s + z.

    Quantization (asymmetric min/max per group, the group-wise uniform scheme of GPTQ's and AWQ's
    int4 formats; Lin et al., arXiv 2306.00978 §3): s = (max − min) / 15 and z = min + 8 s, both
    rounded to bfloat16, then code = clamp(round((W − z) / s) + 8, 0, 15) against the stored s and
    z. Needs in % GROUP == 0 and out % 16 == 0 (the kernel's packing); `fits` says whether a
    linear does.
    """

    GROUP = 32
    # rows quantized and packed at a time: 4x faster than all at once on Gemma's [262144, 640] head
    # (the temporaries stay in cache); a multiple of 64, the packing's blocks of rows
    ROWS_PER_CHUNK = 16384

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        return linear.in_features % cls.GROUP == 0 and linear.out_features % 16 == 0

    def __init__(self, linear: nn.Linear, on_rows: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], Any]
                 | None = None, packed: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
        """on_rows(first row, codes, scales, zeros): called with each chunk of `quantized_rows`
        once it is packed (it may change the codes; `CertifiedHead` derives its bound there).
        packed: (`weight_int4` `[out, in / 2]` uint8, `scales_zeros` `[in / GROUP, out, 2]`
        bfloat16) of an earlier quantization of the same weights (`model/prepared.py`), taken as
        they are. Raises ValueError: a shape the kernel cannot pack, or `packed` of other shapes."""
        super().__init__(linear)
        if not self.fits(linear):
            raise ValueError(f"int4 needs in_features % {self.GROUP} == 0 and out_features % 16 == 0, "
                             f"got [{linear.out_features}, {linear.in_features}]")  # fmt: skip
        self.weight_int4: torch.Tensor
        self.scales_zeros: torch.Tensor
        if packed is not None:
            out, k = linear.out_features, linear.in_features
            want = {"weight_int4": ((out, k // 2), torch.uint8), "scales_zeros": ((k // self.GROUP, out, 2),
                                                                                    torch.bfloat16)}  # fmt: skip
            for (name, (shape, dtype)), t in zip(want.items(), packed):
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(f"{name}: expected {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
            self.register_buffer("weight_int4", packed[0])
            self.register_buffer("scales_zeros", packed[1])
            return
        packed_rows, scales, zeros = [], [], []
        for start, codes, scale, zero in self.quantized_rows(linear.weight.detach()):
            codes32 = codes.view(len(codes), -1).to(torch.int32)  # [c, in]
            packed_rows.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes32, 1))
            scales.append(scale)
            zeros.append(zero)
            if on_rows is not None:
                on_rows(start, codes, scale, zero)
        scale, zero = torch.cat(scales), torch.cat(zeros)  # [out, G]
        self.register_buffer("weight_int4", torch.cat(packed_rows))  # [out, in / 2] uint8, the kernel's layout
        self.register_buffer("scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16())

    @classmethod
    def quantize(cls, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes `[out, in / GROUP, GROUP]` (float, 0–15), scales and zeros `[out, in / GROUP]`
        (float32 holding bfloat16 values) of float32 weights `w` `[out, in]`, as stored: each row
        on its own, so a slice of rows gets the rows' own codes. Ŵ = (code − 8) · scale + zero."""
        out, k = w.shape
        groups = w.view(out, k // cls.GROUP, cls.GROUP)  # [out, G, GROUP]
        lo, hi = groups.amin(-1), groups.amax(-1)  # [out, G]
        scale = ((hi - lo) / 15).clamp_min(1e-8).bfloat16().float()
        zero = (lo + 8 * scale).bfloat16().float()
        codes = torch.round((groups - zero[..., None]).div_(scale[..., None])).add_(8).clamp_(0, 15)
        return codes, scale, zero

    @classmethod
    def quantized_rows(cls, w: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`quantize` of `w` `[out, in]` (any float dtype) `ROWS_PER_CHUNK` rows at a time: (first
        row, codes `[c, in / GROUP, GROUP]`, scales `[c, in / GROUP]`, zeros `[c, in / GROUP]`)."""
        for start in range(0, len(w), cls.ROWS_PER_CHUNK):
            yield (start, *cls.quantize(w[start : start + cls.ROWS_PER_CHUNK].float()))

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), self.weight_int4, self.GROUP,
                                                        self.scales_zeros)  # fmt: skip
        return y.to(flat.dtype)  # [N, out], in the caller's dtype
