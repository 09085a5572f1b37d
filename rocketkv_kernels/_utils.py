"""Launcher-side checks shared by the kernel files (no Triton code here)."""

from __future__ import annotations

import os

import torch

MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (`TRITON_INTERPRET=1`, read when kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Raise `ValueError` unless every tensor is on CUDA (or the interpreter is on, tensors on CPU)."""
    for t in tensors:
        if not (t.is_cuda or (t.device.type == "cpu" and interpreting())):
            raise ValueError(
                f"{op}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); got a "
                f"tensor of shape {tuple(t.shape)} on {t.device}. Use ROCKETKV_KERNELS=torch or auto."
            )


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    """Raise `ValueError` unless `t`'s last dim is contiguous (other dims may be strided views)."""
    if t.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} must be contiguous in its last dim, got shape {tuple(t.shape)} strides {t.stride()}"
        )


def check_head_dim(op: str, name: str, d: int) -> None:
    """Raise `ValueError` for a head dim outside [1, MAX_HEAD_DIM]."""
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {d} of {name} is not supported (1..{MAX_HEAD_DIM})")


def check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    """Raise `ValueError` unless `t` is float32, bfloat16 or float16."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} of shape {tuple(t.shape)} has dtype {t.dtype}; expected one of {FLOAT_DTYPES}")


def block_dim(n: int, minimum: int = 16) -> int:
    """Next power of two ≥ max(n, minimum) (tl.dot needs blocks of at least 16)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def n_programs_target(device: torch.device) -> int:
    """Programs worth launching to fill the device: 4 per SM on CUDA, a handful in the interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4
