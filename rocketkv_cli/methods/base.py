"""What every stage-1 method shares: the layer it scores (`LayerPrefill`), the base class, the registry.

A stage-1 method decides which tokens of each full-attention layer a KV head keeps after the
document's prefill (RocketKV §3.2). It is one small class in one file of this package: a frozen
dataclass whose fields are its options (each one a `PrefillConfig` field of the same name, so a
`.kv` file's recorded configuration rebuilds it), a `scores` method (the raw per-token scores it
ranks, or None) and a `select` method (the kept indices), registered by name with `@register`.
Every module of this package is imported by `rocketkv_cli.methods`, so a new file is all a new
method needs; the CLI's choices, `eval --methods` and the report plans read `registry()`.

This module imports no torch at import time (the CLI lists the methods before torch loads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    import torch

    from ..core.config import PrefillConfig

M = TypeVar("M", bound="Stage1Method")
_REGISTRY: dict[str, type[Stage1Method]] = {}


@dataclass
class LayerPrefill:
    """One full-attention layer after the document prefill.

    keys, values: `[1, Hkv, n + n_probe, D]` (the probe's after the document's), positions
    `[1, Hkv, n + n_probe]` int64. queries: `[1, H, n + n_probe − capture_from, D]` float32, the
    queries at positions capture_from … n + n_probe − 1. scaling, softcap: the layer's attention.
    Observation scores are memoised per (observation, window size), shared by budgets and kernels.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    n_context_tokens: int
    n_probe_tokens: int
    capture_from: int
    scaling: float
    softcap: float | None
    reconstruction: torch.Tensor | None = None  # [1, Hkv, n] context-reconstruction scores, when computed
    _scores: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def observation_scores(self, observation: str, window_size: int) -> torch.Tensor:
        """`[1, Hkv, n]` float32: attention mass of the last `window_size` document queries (plus
        the probe's, for "probe") on the document's keys (RocketKV §3.2, SnapKV §3).

        Raises:
            ValueError: the window starts before the captured queries.
        """
        import torch

        from .. import ops

        key = (observation, window_size)
        if key not in self._scores:
            n = self.n_context_tokens
            probe = self.n_probe_tokens if observation == "probe" else 0
            start = max(0, n - window_size)
            if start < self.capture_from:
                raise ValueError(f"window of {window_size} tokens starts before the captured queries")
            q = self.queries[:, :, start - self.capture_from : n + probe - self.capture_from]  # [1, H, W(+probe), D]
            q_pos = torch.arange(start, n + probe, device=self.keys.device)
            if q.shape[2] != q_pos.shape[0]:
                raise ValueError(f"captured queries {tuple(q.shape)} do not cover positions {start}…{n + probe - 1}")
            k = self.keys[:, :, : n + probe]  # a tail observation never sees the probe's keys
            scores = ops.observation_scores(q, k, q_pos, self.positions[0, 0, : n + probe], self.scaling,
                                            self.softcap)  # fmt: skip
            self._scores[key] = scores[..., :n]
        return self._scores[key]


@dataclass(frozen=True)
class Stage1Method:
    """A stage-1 method: which `prompt_budget` tokens of a layer each KV head keeps.

    Class attributes a method sets: `name` (its registry name: what `--observation` and `eval
    --methods` accept), `summary` (one line for help texts and docs), `selection` and
    `observation` (the values of those `PrefillConfig` fields that name it in a configuration and
    in a file's metadata; `observation = None`: any), and `capture` (what the document prefill must
    also compute for it: "probe" for the probe text's queries, "reconstruct" for the re-reading
    pass, None for nothing more than the tail window's queries). For `rocketkv eval`:
    `eval_options` maps option fields to the `EvalConfig` fields that set them there, and
    `eval_exact` makes its runs decode with exact attention (a baseline measured without stage 2),
    `eval_key` names its caches there. Its fields are its options: a field named as a
    `PrefillConfig` field takes that field's value; any other is the method's own, set through
    `PrefillConfig.method_options` (`ingest --method-option NAME=VALUE`) and needs a default.
    A method of selection "snapkv" (SnapKV++-style scores) also gets eval's re-selection and
    adaptive-layer-budget variants.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    selection: ClassVar[str] = "snapkv"
    observation: ClassVar[str | None] = None
    capture: ClassVar[str | None] = None
    eval_options: ClassVar[dict[str, str]] = {}
    eval_exact: ClassVar[bool] = False
    eval_key: ClassVar[str | None] = None  # the stem of its eval cache names (None: its name)

    @classmethod
    def own_options(cls) -> frozenset[str]:
        """The option fields that are not `PrefillConfig` fields: set through its `method_options`."""
        from ..core.config import PrefillConfig

        shared = {f.name for f in dataclasses.fields(PrefillConfig)}
        return frozenset(f.name for f in dataclasses.fields(cls) if f.name not in shared)

    @classmethod
    def from_config(cls: type[M], cfg: PrefillConfig) -> M:
        """This method with its options from the configuration: the `PrefillConfig` field of each
        option's name, else its entry in `cfg.method_options`, else the option's default."""
        own, given = cls.own_options(), dict(cfg.method_options)
        return cls(**{f.name: given[f.name] if f.name in own else getattr(cfg, f.name)
                      for f in dataclasses.fields(cls) if f.name not in own or f.name in given})  # fmt: skip

    @classmethod
    def config_fields(cls) -> dict[str, Any]:
        """The `PrefillConfig` fields that name this method (`selection`, and `observation` unless any)."""
        return {"selection": cls.selection} | ({} if cls.observation is None else {"observation": cls.observation})

    def scores(self, layer: LayerPrefill) -> torch.Tensor | None:
        """The raw scores `select` ranks `[1, Hkv, n]` float32 (before pooling), or None when it
        ranks nothing (adaptive layer budgets need them)."""
        raise NotImplementedError

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        """Kept token indices `[1, Hkv, prompt_budget]` int64, ascending, for n > prompt_budget."""
        raise NotImplementedError


def register(cls: type[M]) -> type[M]:
    """Class decorator: add a stage-1 method to the registry under `cls.name`.

    Raises:
        ValueError: the name is taken by another class, another class is named by the same
            `selection` and `observation` values, or an option of its own (not a `PrefillConfig`
            field) has no default.
    """
    missing = [f.name for f in dataclasses.fields(cls) if f.name in cls.own_options()
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]  # fmt: skip
    if missing:
        raise ValueError(f"{cls.__qualname__}'s own options {', '.join(missing)} need defaults")
    for other in _REGISTRY.values():
        if other is not cls and other.name == cls.name:
            raise ValueError(f"stage-1 method {cls.name!r} is already registered ({other.__qualname__})")
        if other is not cls and other.config_fields() == cls.config_fields():
            raise ValueError(f"{cls.__qualname__} and {other.__qualname__} are named by the same configuration")
    from ..core.config import STAGE1_METHODS

    _REGISTRY[cls.name] = cls
    STAGE1_METHODS.append((cls.selection, cls.observation, cls.own_options()))
    return cls


def unregister(name: str) -> None:
    """Remove a method from the registry (tests that register a toy method clean up with it)."""
    from ..core.config import STAGE1_METHODS

    cls = _REGISTRY.pop(name, None)
    if cls is not None:
        STAGE1_METHODS.remove((cls.selection, cls.observation, cls.own_options()))


def registry() -> dict[str, type[Stage1Method]]:
    """Every registered stage-1 method by name, in registration order."""
    return dict(_REGISTRY)


def method_class(cfg: PrefillConfig) -> type[Stage1Method]:
    """The class a (valid) configuration names: the method registered for its `selection` and
    `observation` (`PrefillConfig` itself refuses a pair that names none)."""
    for c in _REGISTRY.values():
        if c.selection == cfg.selection and c.observation in (None, cfg.observation):
            return c
    raise ValueError(
        f"no stage-1 method is registered for selection {cfg.selection!r}, observation {cfg.observation!r}"
    )


def method_for(cfg: PrefillConfig) -> Stage1Method:
    """The method a configuration names, with its options taken from the configuration."""
    return method_class(cfg).from_config(cfg)
