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
most of its weights). Embeddings are kept as they are (a lookup reads one row; a tied LM head is
untied, and its top logits are recomputed in float: `RefinedHead`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
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

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        return linear.in_features % cls.GROUP == 0 and linear.out_features % 16 == 0

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        if not self.fits(linear):
            raise ValueError(f"int4 needs in_features % {self.GROUP} == 0 and out_features % 16 == 0, "
                             f"got [{linear.out_features}, {linear.in_features}]")  # fmt: skip
        w = linear.weight.detach().float()  # [out, in]
        out, k = w.shape
        groups = w.view(out, k // self.GROUP, self.GROUP)  # [out, G, GROUP]
        lo, hi = groups.amin(-1), groups.amax(-1)  # [out, G]
        scale = ((hi - lo) / 15).clamp_min(1e-8).bfloat16().float()
        zero = (lo + 8 * scale).bfloat16().float()
        codes = (torch.round((groups - zero[..., None]) / scale[..., None]) + 8).clamp_(0, 15)
        self.weight_int4: torch.Tensor
        self.scales_zeros: torch.Tensor
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(out, k).to(torch.int32), 1)
        self.register_buffer("weight_int4", packed)  # [out, in / 2] uint8, the kernel's layout
        self.register_buffer("scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16())

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
        exact = (self.float_weight[idx].float() @ xf.unsqueeze(-1)).squeeze(-1)  # [..., k]
        if self.float_bias is not None:
            exact = exact + self.float_bias[idx].float()
        return y.scatter(-1, idx, exact)


def quantize_weights(model: Any, weight_format: str) -> int:
    """Convert `model`'s decoder linears and LM head to `weight_format` in place (int8 and int4:
    the linears whose shape their kernel takes, `Int8Linear.fits` and `Int4Linear.fits`; the
    others stay as they are).
    The converted LM head is wrapped in `RefinedHead` (its top logits recomputed in float).
    `head-bf16` converts the LM head alone (`Bf16Linear` in a `RefinedHead`): the decoder keeps
    its float weights, and a decode step ranks the vocabulary with the head's bfloat16 copy and
    recomputes the top `RefinedHead.TOPK` logits in float (on Gemma 3 270M the head is 168M of
    its 268M parameters: 671 of the 1,070 MB a float32 step reads).

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
    if weight_format == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError(f"int4 weights need torch's CPU int4 kernel (torch 2.6 or newer; this is {torch.__version__})")

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
