"""Weight formats for decode: the checkpoint's floats, weight-only int8, or weight-only int4.

Decode at batch 1 reads every weight once per token, so its speed on a CPU is bounded by the
bytes of the weights: float32 reads 4 bytes per parameter, bfloat16 2 (`--dtype bfloat16`; native
on CPUs with AVX512-BF16/AMX), weight-only int8 1. `int8` replaces each `nn.Linear` of the decoder
and the LM head with symmetric per-output-channel int8 weights and float scales, multiplied by
torch's own int8 matmul kernel (`aten._weight_int8pack_mm`); activations stay in the model's
dtype, bfloat16 unless the user names another (`model.loading.resolve_dtype`): that kernel is
fast with bfloat16 activations and slow with float32 ones (docs/performance.md, "Weight formats":
SmolLM2's linears at 2.9× float32's speed with bfloat16 activations, 0.68× with
float32 ones). `int4` stores 4-bit codes with a bfloat16 scale and zero per group of 32 input
channels (0.625 bytes per parameter) and multiplies with torch's CPU int4 kernel
(`aten._weight_int4pack_mm_for_cpu`, which needs bfloat16 inputs to be fast); only the product's
input is rounded to bfloat16 and its output returned in the model's dtype, so a float32 model
keeps float32 everywhere else (norms, residual stream, attention, softmax). Embeddings are kept
as they are (a lookup reads one row).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.config import WEIGHT_FORMATS


class _IntLinear(nn.Module):
    """What the integer linears share: the shapes, the bias and `[..., in] → [..., out]` around
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


class Int8Linear(_IntLinear):
    """`y = x · Wᵀ + b` with W stored as int8 `[out, in]` and one scale per output channel.

    Quantization: scale_o = max_i |W[o, i]| / 127, W_q = round(W / scale) (symmetric, per
    channel, as in LLM.int8()'s weight path without outliers; Dettmers et al., arXiv 2208.07339 §3).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        self.weight_int8: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype != self.scales.dtype:
            flat = flat.to(self.scales.dtype)
        return torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)  # [N, out]


class Int4Linear(_IntLinear):
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


def quantize_weights(model: Any, weight_format: str) -> int:
    """Convert `model`'s decoder linears and LM head to `weight_format` in place (int4: the
    linears whose shape the int4 kernel takes, `Int4Linear.fits`; the others stay as they are).

    Returns the number of layers converted. Raises ValueError: an unknown format, or an integer
    format on a device without its kernel (CUDA: use bfloat16 there).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format == "float":
        return 0
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"{weight_format} weights are for the CPU; on a GPU use --dtype bfloat16")
    if weight_format == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError(f"int4 weights need torch's CPU int4 kernel (torch 2.6 or newer; this is {torch.__version__})")

    def convert(linear: nn.Linear) -> nn.Module | None:
        if weight_format == "int8":
            return Int8Linear(linear)
        return Int4Linear(linear) if Int4Linear.fits(linear) else None

    count = 0
    for module in list(model.model.modules()):
        for attr, sub in list(module.named_children()):
            if isinstance(sub, nn.Linear) and (new := convert(sub)) is not None:
                setattr(module, attr, new)
                count += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and (new := convert(head)) is not None:
        model.lm_head = new  # tied to the embeddings: untie, the lookup keeps the floats
        count += 1
    return count


def weights_bytes(model: Any) -> int:
    """Bytes of every parameter and buffer the forward pass reads (embeddings included)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(b.numel() * b.element_size() for b in model.buffers())
