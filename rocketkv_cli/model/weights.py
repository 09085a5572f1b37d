"""Weight formats for decode: the checkpoint's floats, or weight-only int8.

Decode at batch 1 reads every weight once per token, so its speed on a CPU is bounded by the
bytes of the weights: float32 reads 4 bytes per parameter, bfloat16 2 (`--dtype bfloat16`; native
on CPUs with AVX512-BF16/AMX), weight-only int8 1. `int8` replaces each `nn.Linear` of the decoder
and the LM head with symmetric per-output-channel int8 weights and float scales, multiplied by
torch's own int8 matmul kernel (`aten._weight_int8pack_mm`); activations stay in the model's
dtype, bfloat16 unless the user names another (`model.loading.resolve_dtype`): that kernel is
fast with bfloat16 activations and slow with float32 ones (docs/performance.md, "Weight formats":
SmolLM2's linears at 2.1× float32's speed with bfloat16 activations, 0.29× with
float32 ones). Embeddings are kept as they are (a lookup reads one row).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.config import WEIGHT_FORMATS


class Int8Linear(nn.Module):
    """`y = x · Wᵀ + b` with W stored as int8 `[out, in]` and one scale per output channel.

    Quantization: scale_o = max_i |W[o, i]| / 127, W_q = round(W / scale) (symmetric, per
    channel, as in LLM.int8()'s weight path without outliers; Dettmers et al., arXiv 2208.07339 §3).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int8: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.scales.dtype:
            flat = flat.to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)  # [N, out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_weights(model: Any, weight_format: str) -> int:
    """Convert `model`'s decoder linears and LM head to `weight_format` in place.

    Returns the number of layers converted. Raises ValueError: an unknown format, or int8 on a
    device without the int8 kernel (CUDA: use bfloat16 there).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format == "float":
        return 0
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 weights are for the CPU; on a GPU use --dtype bfloat16")
    count = 0
    for module in list(model.model.modules()):
        for attr, sub in list(module.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(module, attr, Int8Linear(sub))
                count += 1
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        model.lm_head = Int8Linear(model.lm_head)  # tied to the embeddings: untie, the lookup keeps the floats
        count += 1
    return count


def weights_bytes(model: Any) -> int:
    """Bytes of every parameter and buffer the forward pass reads (embeddings included)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(b.numel() * b.element_size() for b in model.buffers())
