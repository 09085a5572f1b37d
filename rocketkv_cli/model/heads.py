"""LM heads for decode in a weight-only format (`model.weights`): `RefinedHead` ranks the
vocabulary with a cheap copy and recomputes the top logits in float; `CertifiedHead` ranks with
an int4 copy and proves each greedy token to be the float head's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .linears import _DECODE_STEP, Int4Linear, decode_step


class RefinedHead(nn.Module):
    """An LM head in a weight-only format whose top candidates are recomputed in float32.

    A reduced-precision head rounds every logit (its kernel's bfloat16 output has steps of 0.125
    at logits of 16–32), which breaks near-ties the float model resolves, so greedy answers
    flip. Here, inside `decode_step()`, the logits `[..., V]` come from `approx`, then each
    position's `TOPK` largest are recomputed in float32 from the float weights `[V, H]` (the
    embedding matrix when tied: no extra memory) and the unrounded input: those equal the float
    head's logits up to float32 summation order, so the greedy token is the float head's
    whenever that token ranks within the approximate top `TOPK`. A decode step reads `TOPK`
    float rows per position, not V. A single row outside decode steps (a question's prefill asks
    for its last position's logits only) is ranked the same way: the answer's first token is
    chosen as every later one is; a forward of several rows (ingest) takes the float head whole.
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

    @staticmethod
    def ranked(x: torch.Tensor) -> bool:
        """Whether `x` `[..., H]` is ranked with the cheap copy: in a decode step, or a single row."""
        return bool(_DECODE_STEP.get()) or x[..., 0].numel() == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if not self.ranked(x):  # [..., V] in float32, exact
            bias = None if self.float_bias is None else self.float_bias.float()
            return F.linear(xf, self.float_weight.float(), bias)
        with decode_step():  # a bf16 copy runs its own weights only in a decode step
            y = self.approx(x).float()  # [..., V]
        idx = top_indices(y.reshape(-1, y.shape[-1]), self.TOPK).view(*y.shape[:-1], -1)  # [..., k]
        return y.scatter(-1, idx, self._exact(xf, idx))

    def _exact(self, xf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The float head's logits `[..., k]` of rows `idx` `[..., k]` for inputs `xf` `[..., H]`
        (float32; equal to `F.linear`'s up to summation order)."""
        rows = self.float_weight.index_select(0, idx.reshape(-1)).view(*idx.shape, -1)  # [..., k, H]
        exact = (rows.float() @ xf.unsqueeze(-1)).squeeze(-1)  # [..., k]
        if self.float_bias is not None:
            exact = exact + self.float_bias[idx].float()
        return exact


def top_indices(y: torch.Tensor, k: int) -> torch.Tensor:
    """Indices `[N, min(k, V)]` of the k largest of each row of `y` `[N, V]`, in no particular order:
    the values they hold are `y.topk(k)`'s (which of several equal values at the k-th place is
    taken is arbitrary in both). One step of a two-level selection: the rows are cut in B blocks
    of b ≈ √V entries, the k blocks with the largest maxima kept, and the top k taken among
    their k·b entries. Exact: an entry above the k-th largest value v lies in a block whose
    maximum exceeds v, and fewer than k blocks have such a maximum, so all of them are kept;
    and the kept blocks whose maximum equals v hold enough entries equal to v. Over a large
    vocabulary this reads the logits about once where one `torch.topk` of the whole row is
    slower on a CPU (the certified head's decode step takes it once per token)."""
    n, v = y.shape
    k = min(k, v)
    b = 1 << (math.isqrt(v).bit_length() - 1)  # the largest power of two ≤ √V that divides V
    while v % b:
        b //= 2
    if v // b < 4 * k:  # too few blocks to gain anything
        return y.topk(k, dim=-1).indices
    blocks = y.reshape(n, v // b, b).amax(dim=-1).topk(k, dim=-1).indices  # [N, k]
    candidates = (blocks.unsqueeze(-1) * b + torch.arange(b, device=y.device)).flatten(1)  # [N, k·b]
    return candidates.gather(-1, y.gather(-1, candidates).topk(k, dim=-1).indices)


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
    (`F.linear`). `positions` counts the three outcomes ("topk", "widened", "float"). A single
    row outside decode steps (a question's last position) is certified the same way; a forward
    of several rows outside them takes the float head whole. Returns float32 logits `[..., V]`.

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

    PREPARED = ("weight_int4", "scales_zeros", "x_coef", "d_coef")  # the tensors `prepared()` gives

    def __init__(self, head: nn.Linear, prepared: Mapping[str, torch.Tensor] | None = None):
        """head: the float LM head `[V, H]` (its weight stays the float head, shared: the tied
        embedding). prepared: `prepared()` of a CertifiedHead of the same weights (read back by
        `model/prepared.py`), taken instead of quantizing and bounding again (~1 s on Gemma 3
        270M's head). Raises ValueError where `Int4Linear` cannot pack the head
        (`Int4Linear.fits`) or `prepared` has other names, shapes or dtypes."""
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        weight = head.weight.detach()
        v = weight.shape[0]

        def bound(start: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
            parts.append(_int4_row_bounds(weight[start : start + len(codes)], codes, scale, zero))

        if prepared is not None:
            if sorted(prepared) != sorted(self.PREPARED):
                raise ValueError(
                    f"prepared head: expected tensors {', '.join(self.PREPARED)}, got {', '.join(prepared)}"
                )
            for name in ("x_coef", "d_coef"):
                t = prepared[name]
                if tuple(t.shape) != (v,) or t.dtype != torch.float32:
                    raise ValueError(f"prepared head: {name} must be [{v}] float32, got {list(t.shape)} {t.dtype}")
            approx = Int4Linear(head, packed=(prepared["weight_int4"], prepared["scales_zeros"]))
            x_coef, d_coef = prepared["x_coef"], prepared["d_coef"]
        else:
            approx = Int4Linear(head, on_rows=bound)
            x_coef, d_coef = torch.cat([a for a, _ in parts]), torch.cat([n for _, n in parts])  # [V] each
        super().__init__(approx, weight, head.bias)
        h = weight.shape[1]
        self.x_coef: torch.Tensor
        self.d_coef: torch.Tensor
        self.register_buffer("x_coef", x_coef)  # [V], a_r
        self.register_buffer("d_coef", d_coef)  # [V], n_r
        self.x_coef_max, self.d_coef_max = float(x_coef.max()), float(d_coef.max())
        self.b_max = 0.0 if head.bias is None else float(head.bias.detach().abs().max())
        self.gamma = _gamma(h + 1)
        self.positions: dict[str, int] = {"topk": 0, "widened": 0, "float": 0}

    def prepared(self) -> dict[str, torch.Tensor]:
        """The int4 copy and the per-row bound coefficients (`PREPARED`): what `__init__` computes
        from the float head, to be saved and passed back as `prepared`."""
        assert isinstance(self.approx, Int4Linear)  # set in __init__
        return {"weight_int4": self.approx.weight_int4, "scales_zeros": self.approx.scales_zeros,
                "x_coef": self.x_coef, "d_coef": self.d_coef}  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if not self.ranked(x):
            return self._float_head(xf)  # [..., V], exact
        flat = xf.reshape(-1, xf.shape[-1])  # [N, H]
        with decode_step():
            y = self.approx(x).float().reshape(flat.shape[0], -1)  # [N, V]
        idx = top_indices(y, self.TOPK)  # [N, k]
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
        candidates = y >= lowest  # [V]
        candidates[top] = False  # recomputed already (a mask, not `isin`: that sorts, ~15% of a step)
        doubt = candidates.nonzero().squeeze(1)  # [m], a superset of the rows outside top with U_r ≥ threshold
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
