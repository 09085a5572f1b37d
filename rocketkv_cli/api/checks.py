"""The checks the Python API makes before a model loads (the CLI calls them as parsed options
arrive, `RocketKV` calls them too): questions, stage-2 overrides, citations, the model a cache
was built for; and reading or describing a `.kv` file without a model. Each raises a
`rocketkv_cli.errors.RocketKVError` subclass with a one-line message.
"""

from __future__ import annotations

from pathlib import Path

from ..core.cache import AnyCache, SegmentedKVCache
from ..core.config import AttentionChoice
from ..engine.answer import decode_config_for
from ..errors import CacheFormatError, InputError, UsageError
from ..model.loading import PRESETS, configure_transformers
from .citations import check_citable
from .files import describe as describe  # re-exported: defined without transformers
from .files import pending_checkpoints as pending_checkpoints
from .files import read_cache as read_cache
from .preflight import check_questions as check_questions  # defined torch-free, re-exported


def configure(quiet: bool, progress_bars: bool) -> None:
    """Offline, quiet model loading (no hub access; transformers' own bars only if `progress_bars`)."""
    configure_transformers(quiet, progress_bars)


def decode_weights_for(cache: AnyCache) -> str | None:
    """The weights to answer from `cache` with when the user names none: the cache's own when it
    was prefilled with integer weights (int8/int4 change what stage 1 kept), else None (the
    model's measured default: float and bf16 prefill alike, `model.weights.Bf16Linear`)."""
    return cache.info.weights if cache.info.weights in ("int8", "int4") else None


def check_decode_options(cache: AnyCache, dense: bool = False, hsa: bool = False, topk: int | None = None,
                         page_size: int | None = None, n_score_dims: int | None = None) -> None:  # fmt: skip
    """Refuse stage-2 overrides that `cache`'s budgets make invalid (a page larger than top-k, a
    non-positive count), before any model loads: `RocketKV.ask` would refuse them only after.

    Raises:
        UsageError: dense and hsa together, or a page size over a top-k both given (no cache makes
        that valid). InputError: an override `DecodeConfig` rejects with the cache's budgets.
    """
    AttentionChoice(dense=dense, hsa=hsa)  # the one check of the pair (UsageError)
    if topk is not None and page_size is not None and page_size > topk:  # as ingest refuses the pair
        raise UsageError(f"invalid option: page_size must not exceed topk ({topk}), got {page_size}")
    first = cache.segments[0] if isinstance(cache, SegmentedKVCache) else cache
    try:
        decode_config_for(first, sparse=not dense, topk=topk, page_size=page_size, n_score_dims=n_score_dims)
    except ValueError as exc:
        raise InputError(f"invalid option: {exc}") from None  # depends on the cache's budgets: exit 1


def check_segment(cache: AnyCache, segment: int | None) -> None:
    """Refuse a `segment` index (`--segment J`) that `cache` does not have, before any model loads
    (the answer would refuse it only after the seconds of loading one).

    Raises:
        InputError: J ≠ 0 for a cache of one segment; J outside 0 … n−1 for a segmented one.
    """
    if segment is None:
        return
    if not isinstance(cache, SegmentedKVCache):
        if segment != 0:
            raise InputError(f"--segment {segment}: this cache has one segment (0)")
    elif not 0 <= segment < cache.n_segments:
        raise InputError(f"segment {segment} out of range; this cache has segments 0-{cache.n_segments - 1}",
                         "`rocketkv inspect FILE.kv` lists them")  # fmt: skip


def check_model_choice(cache: AnyCache, model: str | None, path: str | Path) -> None:
    """Refuse, before it loads, a preset `model` other than the preset `cache` was built with
    (a model directory or hub id is checked by its digests once loaded: `Engine.check`).

    Raises:
        CacheFormatError: both are presets and they differ.
    """
    built = cache.info.identity.model_id
    if model is not None and model != built and model in PRESETS and built in PRESETS:
        hint = f"drop --model (or give --model {built}), or rebuild it with --model {model}"
        raise CacheFormatError(f"{path} was built for model {built}, not {model}", hint)


def check_cite(cache: AnyCache, cite: int, segments: int = 1) -> None:
    """Refuse `cite` passages that `cache` cannot give (before any model loads).

    Raises:
        InputError: a negative count; a cache without token offsets (older files); a segmented
        cache answered from several segments at once.
    """
    if isinstance(cite, bool) or not isinstance(cite, int) or cite < 0:
        raise UsageError(f"--cite must be a count of passages ≥ 0, got {cite!r}")
    if not cite:
        return
    if isinstance(cache, SegmentedKVCache) and segments > 1:
        raise InputError("--cite needs one segment per answer", "drop --segments, or give --segment J")
    for part in cache.segments if isinstance(cache, SegmentedKVCache) else (cache,):
        check_citable(part)
