"""Weight formats for decode: the checkpoint's floats, or weight-only bfloat16, int8 or int4.

Decode at batch 1 reads every weight once per token, so its speed on a CPU is bounded by the
bytes of the weights: float32 reads 4 bytes per parameter, bfloat16 2, int8 1, int4 0.625
(docs/performance.md, "Weight formats"). Each format replaces the decoder's `nn.Linear`s (int4:
those whose shape its kernel packs) and the LM head with a module that stores the weights in
that format and multiplies with torch's own CPU kernel for it, fast only with bfloat16 inputs:
`bf16` (`F.linear` in bfloat16), `int8` (symmetric per-output-channel codes, `aten._weight_int8pack_mm`), `int4`
(4-bit codes with a bfloat16 scale and zero per 32 input channels,
`aten._weight_int4pack_mm_for_cpu`). Only each product's input is rounded to bfloat16 and its
output returned in the model's dtype, so a float32 model keeps float32 everywhere else (norms,
residual stream, attention, softmax). `bf16` keeps the float weights too and prefills with
them: it changes decode steps only (`decode_step`). `head-bf16` converts the LM head alone,
as `bf16` does, and keeps every decoder linear in float (Gemma 3 270M's default: its head is
most of its weights). `head-int4` ranks with an int4 copy of the head instead (a quarter of
bf16's bytes) and certifies each greedy token to be the float head's (`CertifiedHead`).
Embeddings are kept as they are (a lookup reads one row; a tied LM head is untied, and its top
logits are recomputed in float: `RefinedHead`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import WEIGHT_FORMATS

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
    product exact, float32 accumulation, the output rounded to bfloat16). Prefill (the document
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
            return F.linear(flat.to(torch.bfloat16), self.weight_bf16).to(flat.dtype)  # [N, out]
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
                 | None = None):  # fmt: skip
        """on_rows(first row, codes, scales, zeros): called with each chunk of `quantized_rows`
        once it is packed (it may change the codes; `CertifiedHead` derives its bound there)."""
        super().__init__(linear)
        if not self.fits(linear):
            raise ValueError(f"int4 needs in_features % {self.GROUP} == 0 and out_features % 16 == 0, "
                             f"got [{linear.out_features}, {linear.in_features}]")  # fmt: skip
        packed, scales, zeros = [], [], []
        for start, codes, scale, zero in self.quantized_rows(linear.weight.detach()):
            codes32 = codes.view(len(codes), -1).to(torch.int32)  # [c, in]
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes32, 1))
            scales.append(scale)
            zeros.append(zero)
            if on_rows is not None:
                on_rows(start, codes, scale, zero)
        scale, zero = torch.cat(scales), torch.cat(zeros)  # [out, G]
        self.weight_int4: torch.Tensor
        self.scales_zeros: torch.Tensor
        self.register_buffer("weight_int4", torch.cat(packed))  # [out, in / 2] uint8, the kernel's layout
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


class RefinedHead(nn.Module):
    """An LM head in a weight-only format whose top candidates are recomputed in float32.

    A reduced-precision head rounds every logit (its kernel's bfloat16 output has steps of 0.125
    at logits of 16–32), which breaks near-ties the float model resolves, so greedy answers
    flip. Here, inside `decode_step()`, the logits `[..., V]` come from `approx`, then each
    position's `TOPK` largest are recomputed in float32 from the float weights `[V, H]` (the
    embedding matrix when tied: no extra memory) and the unrounded input: those equal the float
    head's logits up to float32 summation order, so the greedy token is the float head's
    whenever that token ranks within the approximate top `TOPK`. A decode step reads `TOPK`
    float rows per position, not V. Prefill (one row per question) takes the float head whole.
    Returns float32 logits.

    `float_weight` is a plain reference, not a parameter or buffer: the model is quantized after
    it is moved to its device and dtype and never converted again (a later `.to()` would leave it
    behind).
    """

    TOPK = 64

    def __init__(self, approx: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.approx = approx
        self.float_weight = weight.detach()  # [V, H]; shared with the embedding when tied
        self.float_bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if not _DECODE_STEP.get():  # [..., V] in float32, exact
            bias = None if self.float_bias is None else self.float_bias.float()
            return F.linear(xf, self.float_weight.float(), bias)
        y = self.approx(x).float()  # [..., V]
        idx = y.topk(min(self.TOPK, y.shape[-1]), dim=-1).indices  # [..., k]
        return y.scatter(-1, idx, self._exact(xf, idx))

    def _exact(self, xf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The float head's logits `[..., k]` of rows `idx` `[..., k]` for inputs `xf` `[..., H]`
        (float32; equal to `F.linear`'s up to summation order)."""
        exact = (self.float_weight[idx].float() @ xf.unsqueeze(-1)).squeeze(-1)  # [..., k]
        if self.float_bias is not None:
            exact = exact + self.float_bias[idx].float()
        return exact


_U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits, round to nearest)
_U_F32 = 2.0**-24
_C_OUT = _U_BF16 + 2.0**-20  # the int4 head's output rounding, per |logit| (derivation: CertifiedHead)
_MARGIN = 1 + 2.0**-20  # covers the float32 rounding of the bound's own arithmetic


def _gamma(n: int) -> float:
    """γₙ = n·u / (1 − n·u), u = 2⁻²⁴: a float32 sum of n terms, in any order, is within γₙ·Σ|terms|."""
    return n * _U_F32 / (1 - n * _U_F32)


def _int4_row_bounds(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-row coefficients `[c]` (float32, rounded up) of `CertifiedHead`'s error bound for float
    weights `w` `[c, H]` that `Int4Linear` stores as `codes` `[c, G, GROUP]` (changed in place),
    `scale` and `zero` `[c, G]`: a_r ≥ ‖e_r‖₂ + γ_{H+1}(1 + u)‖Ŵ_r‖₂ (the coefficient of ‖x̃‖₂)
    and n_r = ‖W_r‖₂ (of ‖x̃ − x‖₂), with e_ri = |Ŵ_ri − W_ri| + u|Ŵ_ri|, Ŵ = (code − 8)·s + z and
    u = 2⁻⁸ (the kernel's weight is within u|Ŵ_ri| of Ŵ_ri whether it dequantizes in float32 or
    rounds to bfloat16). By the triangle inequality ‖e_r‖₂ ≤ ‖Ŵ_r − W_r‖₂ + u‖Ŵ_r‖₂, so
    a_r = ‖Ŵ_r − W_r‖₂ + (u + γ_{H+1}(1 + u))‖Ŵ_r‖₂: three norms, no per-weight |·| (1 s on
    Gemma's head, a bound 2% looser than ‖e_r‖₂'s). In float32: (code − 8)·s is exact (4 × 8
    significant bits), adding z rounds once (Ŵ' = Ŵ(1 + δ), |δ| ≤ 2⁻²⁴: 2⁻²¹‖Ŵ'‖₂ more covers
    it), and each norm (a sum of H squares, one subtraction before) is multiplied by
    1 + 4γ_{H+2} (Higham §3.1)."""
    h = w.shape[1]
    per_norm = _U_BF16 + 2.0**-21 + _gamma(h + 1) * (1 + _U_BF16) * (1 + 2.0**-21)
    up = 1 + 4 * _gamma(h + 2)
    w = w.float()
    deq = codes.sub_(8).mul_(scale[..., None]).add_(zero[..., None]).view(w.shape)  # Ŵ' [c, H], in place
    deq_norm = torch.linalg.vector_norm(deq, dim=1)
    a = (torch.linalg.vector_norm(deq.sub_(w), dim=1) + per_norm * deq_norm) * up
    return a, torch.linalg.vector_norm(w, dim=1) * up


class CertifiedHead(RefinedHead):
    """An LM head ranked with `Int4Linear` whose greedy token is certified to be the float head's.

    In `decode_step()`, each position's logits `[V]` come from the int4 copy (ẑ), the top `TOPK`
    are recomputed in float32 (z̄, as `RefinedHead`), and a bound on the int4 copy's error proves
    that no other row can hold the largest float logit; where it cannot, the rows the bound
    leaves in doubt are recomputed too, and where those are too many (over `V / 16`) or the top
    two are within float32 rounding of each other, the position takes the float head whole
    (`F.linear`). `positions` counts the three outcomes ("topk", "widened", "float"). Outside
    decode steps, the float head whole. Returns float32 logits `[..., V]`.

    The bound. z_r = W_r·x + b_r is the float logit in exact arithmetic (x float32 `[H]`); the
    int4 head computes ẑ_r = fl₃₂(bf16(y_r) + b_r), y_r the kernel's float32 sum of Ŵ'_ri·x̃_i,
    x̃ = bf16(x), Ŵ' its dequantized weights (within u|Ŵ| of Ŵ = (code − 8)·s + z; u = 2⁻⁸).
    z_r − ẑ_r = (W_r − Ŵ'_r)·x̃ + W_r·(x − x̃) + (Ŵ'_r·x̃ − y_r) + (y_r + b_r − ẑ_r), and by
    Cauchy–Schwarz and the standard rounding bounds (Higham, Accuracy and Stability of
    Numerical Algorithms, §3.1):
      |(W_r − Ŵ'_r)·x̃| ≤ ‖e_r‖₂‖x̃‖₂ with e_ri = |Ŵ_ri − W_ri| + u|Ŵ_ri| ≥ |Ŵ'_ri − W_ri|;
      |W_r·(x − x̃)| ≤ ‖W_r‖₂‖x − x̃‖₂ (x − x̃ is exact in float32);
      |Ŵ'_r·x̃ − y_r| ≤ γ_{H+1} Σ|Ŵ'_ri x̃_i| ≤ γ_{H+1}(1 + u)‖Ŵ_r‖₂‖x̃‖₂, γₙ = n·2⁻²⁴/(1 − n·2⁻²⁴);
      |y_r + b_r − ẑ_r| ≤ u(1 + 2⁻²⁴)|ẑ_r| + u|b_r| + 2·2⁻²⁴|ẑ_r| ≤ c(|ẑ_r| + b_max), c = u + 2⁻²²
      (the bfloat16 output: |bf16(y) − y| ≤ u|bf16(y)|; then the float32 bias sum).
    So z_r ≤ U_r = g(ẑ_r) + a_r‖x̃‖₂ + n_r‖x̃ − x‖₂, g(t) = t + c(|t| + b_max) increasing, with
    the per-row a_r, n_r of `_int4_row_bounds` (computed once; 8 bytes per row). Evaluated in
    float32 with a 2⁻²⁰ relative margin for its own rounding (`_C_OUT`, `_MARGIN`).
    The recomputed logits: |z̄_s − z_s| ≤ ε = γ_{H+1}(max_r‖W_r‖₂‖x‖₂ + b_max), for any float32
    summation order — `F.linear`'s too.

    The certificate. X = the rows recomputed, t = argmax over X of z̄. If z̄_t − z̄_s > 4ε for
    every other s in X and U_r < z̄_t − 3ε for every r outside X, then z_t − z_r > 2ε for every
    r ≠ t: every float32 evaluation of the float head picks t, so the greedy token is the float
    head's. X starts as the approximate top `TOPK`; the rows with U_r ≥ z̄_t − 3ε (found with
    one pass over ẑ against g⁻¹ of the largest bound, then U_r on those) join it; the maximum
    over X can only grow, so the condition still holds outside. The bound is a worst case
    (Cauchy–Schwarz aligns the error with x); on Gemma 3 270M it is ~10 where the int4 copy's
    real error is ≤ 2, so a global bound (one number per step, the brief's first design)
    certified 0.35% of positions of real text and the per-row one with widening almost all
    (docs/performance.md).
    """

    TOPK = 64
    WIDEN_FRACTION = 16  # at most V / 16 rows recomputed beyond TOPK, else the float head (cheaper past that)

    def __init__(self, head: nn.Linear):
        """head: the float LM head `[V, H]` (its weight stays the float head, shared: the tied
        embedding). Raises ValueError where `Int4Linear` cannot pack it (`Int4Linear.fits`)."""
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        weight = head.weight.detach()

        def bound(start: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
            parts.append(_int4_row_bounds(weight[start : start + len(codes)], codes, scale, zero))

        super().__init__(Int4Linear(head, on_rows=bound), weight, head.bias)
        h = weight.shape[1]
        x_coef, d_coef = torch.cat([a for a, _ in parts]), torch.cat([n for _, n in parts])  # [V] each
        self.x_coef: torch.Tensor
        self.d_coef: torch.Tensor
        self.register_buffer("x_coef", x_coef)  # [V], a_r
        self.register_buffer("d_coef", d_coef)  # [V], n_r
        self.x_coef_max, self.d_coef_max = float(x_coef.max()), float(d_coef.max())
        self.b_max = 0.0 if head.bias is None else float(head.bias.detach().abs().max())
        self.gamma = _gamma(h + 1)
        self.positions: dict[str, int] = {"topk": 0, "widened": 0, "float": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if not _DECODE_STEP.get():
            return self._float_head(xf)  # [..., V], exact
        flat = xf.reshape(-1, xf.shape[-1])  # [N, H]
        y = self.approx(x).float().reshape(flat.shape[0], -1)  # [N, V]
        idx = y.topk(min(self.TOPK, y.shape[-1]), dim=-1).indices  # [N, k]
        out = y.scatter(-1, idx, self._exact(flat, idx))  # [N, V]
        for n in range(flat.shape[0]):
            self.positions[self._certify(flat[n], y[n], idx[n], out[n])] += 1
        return out.view(*x.shape[:-1], -1)

    def _float_head(self, xf: torch.Tensor) -> torch.Tensor:
        bias = None if self.float_bias is None else self.float_bias.float()
        return F.linear(xf, self.float_weight.float(), bias)

    def _certify(self, x: torch.Tensor, y: torch.Tensor, top: torch.Tensor, out: torch.Tensor) -> str:
        """Certify one position (x `[H]`, its int4 logits y `[V]`, top `[k]` already recomputed in
        `out` `[V]`); recompute more rows of `out`, or all of it, until certified. Returns the outcome."""
        norm_rounded, norm_diff = (float(n) for n in self._norms(x))
        eps = self.gamma * (self.d_coef_max * float(x.double().norm()) + self.b_max)
        threshold = float(out[top].max()) - 3 * eps
        widest = (self.x_coef_max * norm_rounded + self.d_coef_max * norm_diff) * _MARGIN**4  # ≥ error_bound's, rounded
        if not math.isfinite(threshold - widest):  # inf or NaN in x: nothing to certify
            out.copy_(self._float_head(x))
            return "float"
        lowest = self._below(threshold - widest - _C_OUT * self.b_max)
        doubt = (y >= lowest).nonzero().squeeze(1)  # [m], a superset of the rows with U_r ≥ threshold
        doubt = doubt[~torch.isin(doubt, top)]
        upper = y[doubt] + self.error_bound(x, y[doubt], doubt)  # [m]
        widen = doubt[upper >= threshold]  # [w]
        if len(widen) > max(self.TOPK, len(y) // self.WIDEN_FRACTION):
            out.copy_(self._float_head(x))
            return "float"
        if len(widen):
            out[widen] = self._exact(x[None], widen[None])[0]
        recomputed = out[torch.cat([top, widen])]
        if len(recomputed) > 1:
            first, second = recomputed.topk(2).values.tolist()
            if first - second <= 4 * eps:  # a near-tie float32 rounding could break either way
                out.copy_(self._float_head(x))
                return "float"
        return "widened" if len(widen) else "topk"

    def error_bound(self, x: torch.Tensor, approx: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """A bound `[..., V]` (or `[..., m]` for `rows` `[m]`) on |z_r − ẑ_r|, the float head's
        logit of row r for input x `[..., H]` against the int4 copy's `approx` (ẑ, float32,
        `[..., V]` or `[..., m]`): c(|ẑ_r| + b_max) + a_r‖x̃‖₂ + n_r‖x̃ − x‖₂ (class docstring), in
        float32, rounded up."""
        norm_rounded, norm_diff = (n[..., None] for n in self._norms(x))  # [..., 1] each
        x_coef = self.x_coef if rows is None else self.x_coef[rows]
        d_coef = self.d_coef if rows is None else self.d_coef[rows]
        return _C_OUT * (approx.abs() + self.b_max) + (x_coef * norm_rounded + d_coef * norm_diff) * _MARGIN

    @staticmethod
    def _norms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """‖x̃‖₂ and ‖x̃ − x‖₂ `[...]` (float32, from float64) for x `[..., H]`, x̃ = bf16(x) as the
        int4 kernel takes it (x − x̃ is exact)."""
        x64 = x.double()
        rounded = x.bfloat16().double()
        return rounded.norm(dim=-1).float(), (rounded - x64).norm(dim=-1).float()

    @staticmethod
    def _below(target: float) -> float:
        """A t with h(t') < target for every t' < t, h(t) = t + c|t| (c = `_C_OUT`; increasing):
        h⁻¹(target), lowered by more than its float rounding."""
        t = target / (1 + _C_OUT) if target >= 0 else target / (1 - _C_OUT)
        return t - 2.0**-20 * (abs(t) + 1)


def quantize_weights(model: Any, weight_format: str) -> int:
    """Convert `model`'s decoder linears and LM head to `weight_format` in place (int8 and int4:
    the linears whose shape their kernel takes, `Int8Linear.fits` and `Int4Linear.fits`; the
    others stay as they are).
    The converted LM head is wrapped in `RefinedHead` (its top logits recomputed in float).
    `head-bf16` converts the LM head alone (`Bf16Linear` in a `RefinedHead`): the decoder keeps
    its float weights, and a decode step ranks the vocabulary with the head's bfloat16 copy and
    recomputes the top `RefinedHead.TOPK` logits in float (on Gemma 3 270M the head is 168M of
    its 268M parameters: 671 of the 1,070 MB a float32 step reads). `head-int4` does the same with
    an `Int4Linear` copy in a `CertifiedHead` (greedy tokens proven to be the float head's); a
    head whose shape the int4 kernel cannot pack (`Int4Linear.fits`) stays float (returns 0).

    Returns the number of layers converted. Raises ValueError: an unknown format, a weight-only
    format on a GPU (use `--dtype bfloat16` there), or int4 on a torch without its CPU kernel.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format == "float":
        return 0
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"{weight_format} weights are for the CPU; on a GPU use --dtype bfloat16")
    head = getattr(model, "lm_head", None)
    if weight_format == "head-bf16":  # the decoder keeps its float linears; only the head's ranking is bfloat16
        if not isinstance(head, nn.Linear):
            return 0
        model.lm_head = RefinedHead(Bf16Linear(head), head.weight, head.bias)
        return 1
    if weight_format in ("int4", "head-int4") and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError(f"int4 weights need torch's CPU int4 kernel (torch 2.6 or newer; this is {torch.__version__})")
    if weight_format == "head-int4":  # the decoder keeps its float linears; the head ranks in int4, certified
        if not isinstance(head, nn.Linear) or not Int4Linear.fits(head):
            return 0
        model.lm_head = CertifiedHead(head)
        return 1

    def convert(linear: nn.Linear) -> nn.Module | None:
        if weight_format == "bf16":
            return Bf16Linear(linear)
        if weight_format == "int8":
            return Int8Linear(linear) if Int8Linear.fits(linear) else None
        return Int4Linear(linear) if Int4Linear.fits(linear) else None

    count = 0
    for module in list(model.model.modules()):
        for attr, sub in list(module.named_children()):
            if isinstance(sub, nn.Linear) and (new := convert(sub)) is not None:
                setattr(module, attr, new)
                count += 1
    if isinstance(head, nn.Linear) and (new := convert(head)) is not None:
        model.lm_head = RefinedHead(new, head.weight, head.bias)  # tied: the lookup keeps the float embeddings
        count += 1
    return count


def weights_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads: every parameter and buffer, except the input
    embedding matrix (a lookup reads one row) unless it is also the float LM head (tied)."""
    embedding = model.get_input_embeddings().weight
    head = getattr(model, "lm_head", None)
    tied = isinstance(head, nn.Linear) and head.weight is embedding
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if tied or t is not embedding)
