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
`mlp-bf16` is head-int4 with each decoder layer's MLP linears as `bf16` converts them (decode
steps only): the MLPs are most of a layer's weights, and on Gemma 3 270M rounding them changed
no greedy answer where rounding the attention projections too did (docs/performance.md).
Embeddings are kept as they are (a lookup reads one row; a tied LM head is untied, and its top
logits are recomputed in float: `RefinedHead`).

Here: the conversion (`quantize_weights`) and the bytes a step reads (`weights_bytes`); the
linears and `decode_step` live in `model/linears.py`, the LM heads in `model/heads.py`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.config import WEIGHT_FORMATS
from .heads import CertifiedHead, RefinedHead
from .linears import Bf16Linear, Int4Linear, Int8Linear, decode_step
from .prepared import KeptTensors, certified_head

__all__ = ["Bf16Linear", "CertifiedHead", "Int4Linear", "Int8Linear", "RefinedHead", "decode_step",
           "quantize_weights", "weights_bytes"]  # fmt: skip


def quantize_weights(
    model: Any, weight_format: str, weights_digest: str | None = None, kept: KeptTensors | None = None
) -> int:
    """Convert `model`'s decoder linears and LM head to `weight_format` in place (int8 and int4:
    the linears whose shape their kernel takes, `Int8Linear.fits` and `Int4Linear.fits`; the
    others stay as they are).
    The converted LM head is wrapped in `RefinedHead` (its top logits recomputed in float).
    `head-bf16` converts the LM head alone (`Bf16Linear` in a `RefinedHead`): the decoder keeps
    its float weights, and a decode step ranks the vocabulary with the head's bfloat16 copy and
    recomputes the top `RefinedHead.TOPK` logits in float (on Gemma 3 270M the head is 168M of
    its 268M parameters: 671 of the 1,070 MB a float32 step reads). `head-int4` does the same with
    an `Int4Linear` copy in a `CertifiedHead` (greedy tokens proven to be the float head's); a
    head whose shape the int4 kernel cannot pack (`Int4Linear.fits`) stays float (returns 0);
    with `weights_digest` (the weight files', `loading.weights_file_digest`) and `kept`, its int4
    copy and bounds are kept there and read back by the next load (`model/prepared.py`).

    `mlp-bf16` is `head-int4` plus each decoder layer's MLP linears (`layer.mlp`; a layer without
    one keeps its float weights) as `Bf16Linear`: decode steps round their products' inputs and
    weights to bfloat16, prefill multiplies by the float weights.

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
    if weight_format in ("int4", "head-int4", "mlp-bf16") and not hasattr(
        torch.ops.aten, "_weight_int4pack_mm_for_cpu"
    ):
        raise ValueError(f"int4 weights need torch's CPU int4 kernel (torch 2.6 or newer; this is {torch.__version__})")
    if weight_format == "head-int4":  # the decoder keeps its float linears; the head ranks in int4, certified
        if not isinstance(head, nn.Linear) or not Int4Linear.fits(head):
            return 0
        model.lm_head = certified_head(head, weights_digest, kept)
        return 1
    if weight_format == "mlp-bf16":  # head-int4, and each layer's MLP products in bfloat16 in decode steps
        count = quantize_weights(model, "head-int4", weights_digest, kept)
        for layer in getattr(model.model, "layers", ()):
            mlp = getattr(layer, "mlp", None)
            for attr, sub in list(mlp.named_children()) if mlp is not None else ():
                if isinstance(sub, nn.Linear):
                    setattr(mlp, attr, Bf16Linear(sub))
                    count += 1
        return count

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
