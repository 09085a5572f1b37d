"""Kernel dispatch: one rule for every hot-path op (docs/algorithm.md §6).

Each op has a torch reference (the specification, in `stage2.py` / `stage1.py`) and a Triton
launcher of the same signature in `rocketkv_cli.kernels.<file>`. The rule, evaluated per call from
the first tensor argument's device and `ROCKETKV_KERNELS`:

- `auto` (default): Triton for CUDA tensors when `triton` is installed, torch otherwise;
- `torch`: always the reference;
- `triton`: always the kernels (CPU tensors need `TRITON_INTERPRET=1`, as in the tests).

An op may also have a CPU fast path in torch (`ops/cpu.py`: context reconstruction's attention,
a question's scores of the stored keys),
taken for CPU tensors under `auto` and compared with its reference in the tests.

Nothing is decided or imported at import time; `triton` is imported only when a kernel is first
used. The backend chosen for each op is logged once at debug level. Kernel exceptions propagate.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..core import attention, stage1, stage2
from ..core.config import KERNEL_BACKENDS, KERNELS_ENV, kernels_choice
from ..errors import UsageError
from . import cpu

ENV_VAR, BACKENDS = KERNELS_ENV, KERNEL_BACKENDS
log = logging.getLogger(__name__)

# op → (reference function, "kernels module:launcher" loaded on first use)
DISPATCH: dict[str, tuple[Callable[..., Any], str]] = {
    "page_summaries": (stage2.page_summaries, "page_summaries:page_summaries_triton"),
    "update_page_summaries": (stage2.update_page_summaries, "page_summaries:update_page_summaries_triton"),
    "page_scores": (stage2.page_scores, "page_scores:page_scores_triton"),
    "sparse_attention": (stage2.sparse_attention, "sparse_attention:sparse_attention_triton"),
    "observation_scores": (stage1.observation_scores, "observation_scores:observation_scores_triton"),
    "pool_scores": (stage1.pool_scores, "observation_scores:pool_scores_triton"),
}
_logged: set[tuple[str, str]] = set()


class KernelUnavailableError(RuntimeError):
    """`ROCKETKV_KERNELS=triton` was asked for but the Triton kernels cannot be loaded."""


def requested_backend() -> str:
    """The value of `ROCKETKV_KERNELS` (default `auto`), lower-cased.

    Raises:
        ValueError: a value other than auto, torch or triton.
    """
    try:
        return kernels_choice()
    except UsageError as exc:
        raise ValueError(exc.message) from None


def triton_available() -> bool:
    """Whether the `triton` package imports (says nothing about a GPU: it imports on CPU too)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def backend_for(tensor: torch.Tensor) -> str:
    """`"triton"` or `"torch"` for an op whose first tensor argument is `tensor` (the rule above).

    Raises:
        ValueError: an invalid `ROCKETKV_KERNELS`.
    """
    requested = requested_backend()
    if requested != "auto":
        return requested
    return "triton" if tensor.is_cuda and triton_available() else "torch"


def implementation(op: str, tensor: torch.Tensor) -> Callable[..., Any]:
    """The function that runs `op` for `tensor`'s device under the current setting.

    Raises:
        KeyError: an unknown op. ValueError: an invalid `ROCKETKV_KERNELS`.
        KernelUnavailableError: Triton chosen but `triton` (or the kernel module) fails to import.
    """
    reference, target = DISPATCH[op]
    backend = backend_for(tensor)
    if (op, backend) not in _logged:
        _logged.add((op, backend))
        log.debug("rocketkv op %s: %s backend (%s=%s, device %s)", op, backend, ENV_VAR, requested_backend(),
                  tensor.device)  # fmt: skip
    if backend == "torch":
        return reference
    module_name, fn_name = target.split(":")
    try:
        module = importlib.import_module(f"rocketkv_cli.kernels.{module_name}")
    except ImportError as exc:
        raise KernelUnavailableError(
            f"{op}: the Triton backend was chosen ({ENV_VAR}={requested_backend()}) but cannot be loaded: {exc}. "
            f"Install it with `pip install triton`, or set {ENV_VAR}=torch."
        ) from exc
    return getattr(module, fn_name)


def page_summaries(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatched `stage2.page_summaries`: keys `[B, Hkv, S, D]` → (min, max) `[B, Hkv, P, D]`."""
    return implementation("page_summaries", keys)(keys, page_size)


def update_page_summaries(
    page_min: torch.Tensor, page_max: torch.Tensor, keys: torch.Tensor, start: int, page_size: int
) -> None:
    """Dispatched `stage2.update_page_summaries` (in place, pages touched from token `start` on)."""
    implementation("update_page_summaries", keys)(page_min, page_max, keys, start, page_size)


def page_scores(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, counts: torch.Tensor, n_score_dims: int
) -> torch.Tensor:
    """Dispatched `stage2.page_scores`: query `[B, H, 1, D]`, pages `[B, Hkv, P, D]` → `[B, Hkv, P]` float32."""
    return implementation("page_scores", query)(query, page_min, page_max, counts, n_score_dims)


def sparse_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dispatched `stage2.sparse_attention`: `[B, H, 1, D]` over indices `[B, Hkv, N_sel]` → `[B, H, 1, D]`."""
    return implementation("sparse_attention", query)(query, keys, values, indices, scaling, softcap)


def observation_scores(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dispatched `stage1.observation_scores`: `[B, H, W, D]` × `[B, Hkv, S, D]` → `[B, Hkv, S]` float32."""
    fn = implementation("observation_scores", keys)
    return fn(window_queries, keys, query_positions, key_positions, scaling, softcap)


def question_scores(
    question_queries: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """`stage1.question_scores`: `[B, H, T, D]` × `[B, Hkv, S, D]` (every key before every query) →
    `[B, Hkv, S]` float32, through the dispatched `observation_scores` (the reference of
    `question_attention`'s scores; on the CPU its fast path computes them in the same pass)."""
    return stage1.question_scores(question_queries, keys, scaling, softcap, score=observation_scores)


def question_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    n_context: int,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A question's first prefill in a full-attention layer and its re-selection scores
    (docs/algorithm.md §4): (`core.attention.exact_attention` of query `[B, H, T, D]` over keys/values
    `[B, Hkv, L, D]` at positions `[B, Hkv, L]` / `[T]` → `[B, H, T, D]`, `stage1.question_scores`
    of the same queries over the first `n_context` keys → `[B, Hkv, n_context]` float32). The
    keys are the stored context followed by the tail in position order, whose last T are the
    queries' own. CPU tensors under `ROCKETKV_KERNELS=auto` take the one-pass fast path
    `ops.cpu.question_attention`; others the two references."""
    if query.device.type == "cpu" and requested_backend() == "auto":
        return cpu.question_attention(query, keys, values, n_context, scaling, softcap)
    out = attention.exact_attention(query, keys, values, key_positions, query_positions, scaling, None, softcap)
    return out, question_scores(query, keys[:, :, :n_context], scaling, softcap)


def reconstruction_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_context: int,
    score_from: int,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`stage1.reconstruction_attention`: attention output `[B, H, T, D]` and context-reconstruction
    weights `[B, H, n_context]` float32. CPU tensors without softcapping under `ROCKETKV_KERNELS=auto`
    take the fast path `ops.cpu.reconstruction_attention` (the same values to float32 rounding);
    every other case (values of another head size too), and a call whose fused CPU attention op is
    missing or fails, the reference."""
    if (queries.device.type == "cpu" and softcap is None and requested_backend() == "auto" and cpu.flash_available()
            and values.shape[-1] == queries.shape[-1]):  # fmt: skip
        try:
            return cpu.reconstruction_attention(queries, keys, values, n_context, score_from, scaling)
        except (RuntimeError, TypeError) as exc:  # e.g. the private op changed in this torch: this call's reference
            log.debug("rocketkv op reconstruction_attention: CPU fast path failed (%s); using the reference", exc)
    return stage1.reconstruction_attention(queries, keys, values, n_context, score_from, scaling, softcap)


def pool_scores(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Dispatched `stage1.pool_scores`: `[B, Hkv, S]` → `[B, Hkv, S]` (stride-1 max-pool)."""
    return implementation("pool_scores", scores)(scores, kernel_size)


def snapkv_select(
    scores: torch.Tensor, prompt_budget: int, window_size: int, kernel_size: int, n_first: int = 0
) -> torch.Tensor:
    """`stage1.snapkv_select` with the dispatched pooling (docs/algorithm.md §2 steps 4–5).

    Args: scores `[B, Hkv, S]` float32; budgets in tokens. Returns: `[B, Hkv, min(S, prompt_budget)]` int64.
    """
    return stage1.snapkv_select(scores, prompt_budget, window_size, kernel_size, pool=pool_scores, n_first=n_first)


def hsa_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    topk: int,
    page_size: int,
    n_score_dims: int,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`stage2.hsa_decode` with the dispatched page scoring and sparse attention (RocketKV §3.5).

    Args: query `[B, H, 1, D]`; keys/values `[B, Hkv, S, D]`; page_min/page_max `[B, Hkv, P, D]`;
    budgets in tokens. Returns: (output `[B, H, 1, D]`, indices `[B, Hkv, N_sel]` int64).
    """
    return stage2.hsa_decode(query, keys, values, page_min, page_max, topk, page_size, n_score_dims, scaling,
                             softcap, score_pages=page_scores, attend=sparse_attention)  # fmt: skip


def hsa_context_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    n_context: int,
    topk: int,
    page_size: int,
    n_score_dims: int,
    n_sink_tokens: int,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One HSA decode step over a stored context followed by a question's tail (docs/algorithm.md §3):
    `stage2.context_selection` with the dispatched page scoring, then the dispatched sparse attention.

    Args: query `[B, H, 1, D]`; keys/values `[B, Hkv, S, D]` (context then tail); page_min/page_max
    `[B, Hkv, P, D]` over the context only. Returns (output `[B, H, 1, D]`, indices `[B, Hkv, N_sel]`).
    """
    s = keys.shape[2]
    indices = stage2.context_selection(query, page_min, page_max, n_context, s, topk, page_size, n_score_dims,
                                       n_sink_tokens, score_pages=page_scores)  # fmt: skip
    return sparse_attention(query, keys, values, indices, scaling, softcap), indices
