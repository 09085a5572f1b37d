"""What one `rocketkv eval` run measures (`EvalConfig`) and its plan: the distinct stage-1 caches a
sample needs and the runs answered from them, derived from the stage-1 registry (`rocketkv_cli.methods`).

Methods (budgets in tokens, docs/algorithm.md §1):
- full: nothing pruned, exact attention.
- rocketkv: SnapKV++ at the budget's prompt_budget, then HSA at its topk (both stages).
- snapkv: the same stage-1 cache, exact attention over it (stage 1 only).
- hsa: nothing pruned, HSA with topk = t/2 and pages/dims from the budget over the full cache
  (stage 2 only).
- sink_recent: the first `n_sink_tokens` plus the most recent tokens, the same kept count as
  rocketkv's stage 1, exact attention over them (a StreamingLLM-style baseline).
- reconstruct: stage 1 scored by context reconstruction (KVzip §3) instead of the tail window,
  then HSA as rocketkv.
- reselect: two-level budgets: the file keeps what SnapKV++ keeps at `store_factor`·t, each
  question re-selects its working set of t's prompt budget with its own queries, then HSA.
- reconstruct_reselect: both: the file keeps what context reconstruction keeps at
  `store_factor`·t, each question re-selects t's working set, then HSA.
- adaptive, reconstruct_adaptive: rocketkv and reconstruct with adaptive layer budgets (the same
  total over the full-attention layers, split by where the scores put the attention mass).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..core.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_WINDOW_SIZE, PrefillConfig
from ..methods import Stage1Method, registry
from .names import DEFAULT_METHODS, eval_methods
from .tasks import TASKS

OBSERVATIONS = ("tail", "probe", "wide")  # stage-1 observation windows compared by the ablation
FULL_TOKEN_BUDGET = 1 << 30  # a budget above any document: stage 1 keeps everything


@dataclass(frozen=True)
class EvalConfig:
    """What one `rocketkv eval` run measures. Lengths and budgets in tokens.

    context_tokens: document lengths. budgets: token budgets t. methods: subset of `eval_methods()`.
    tasks: subset of eval_tasks.TASKS. samples: samples per task and length. seed: generator seed.
    observations: stage-1 observation windows for rocketkv ("tail" = last `window_size` document
        queries; "probe" = those plus prompts/probe.txt, scored then dropped; "wide" = the last
        `wide_window_size` queries). pool_kernels: odd kernels, 0 = the `auto` rule. rocketkv is run
        for every (observation, pool kernel) pair; snapkv (stage 1 only) uses the first pair.
    plan_new_tokens: the answer length budgets plan for (ingest's --max-new-tokens).
    max_new_tokens: answer cap; None = each task's own (eval_tasks.ANSWER_TOKENS).
    kv_dtype: storage of every method's keys/values (None: what `ingest` stores for the model,
        `core.config.default_kv_dtype`).
    store_factor: reselect's store budget, as a multiple of t. reconstruct_pool_kernel: the
        pooling kernel of reconstruct's selection (odd; 1 = none, as KVzip).
    stage2: how the pruned caches decode: "hsa" (each method's stage 2, as on a GPU) or "exact"
        (exact attention over every pruned cache, as `ask` decodes on a CPU below HSA's crossover;
        the `hsa` method, stage 2 alone, is then refused).
    """

    context_tokens: tuple[int, ...] = (4096,)
    budgets: tuple[int, ...] = (128, 256, 512, 1024)
    methods: tuple[str, ...] = DEFAULT_METHODS
    tasks: tuple[str, ...] = TASKS
    samples: int = 4
    seed: int = 0
    observations: tuple[str, ...] = ("tail",)
    pool_kernels: tuple[int, ...] = (63,)
    window_size: int = DEFAULT_WINDOW_SIZE
    wide_window_size: int = 4 * DEFAULT_WINDOW_SIZE
    n_sink_tokens: int = 4
    plan_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_new_tokens: int | None = None
    chunk_tokens: int = 1024
    kv_dtype: str | None = None
    store_factor: int = 2
    reconstruct_pool_kernel: int = 7
    stage2: str = "hsa"

    def __post_init__(self) -> None:
        for name, allowed in (("methods", eval_methods()), ("tasks", TASKS), ("observations", OBSERVATIONS)):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values) or any(v not in allowed for v in values):
                raise ValueError(f"{name} must be distinct values from {', '.join(allowed)}, got {','.join(values)}")
        for name in ("context_tokens", "budgets", "pool_kernels"):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{name} must be distinct values, got {values}")
        if min(self.context_tokens) < 64:
            raise ValueError(f"context_tokens must be at least 64 each, got {self.context_tokens}")
        if min(self.budgets) < 2:
            raise ValueError(f"budgets must be at least 2 tokens each, got {self.budgets}")
        if any(k < 0 or (k and k % 2 == 0) for k in self.pool_kernels):
            raise ValueError(f"pool_kernels must be odd or 0 (auto), got {self.pool_kernels}")
        for name in ("samples", "window_size", "wide_window_size", "plan_new_tokens", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.store_factor < 2:
            raise ValueError(f"store_factor must be at least 2, got {self.store_factor}")
        if self.reconstruct_pool_kernel < 1 or self.reconstruct_pool_kernel % 2 == 0:
            raise ValueError(f"reconstruct_pool_kernel must be odd and positive, got {self.reconstruct_pool_kernel}")
        if self.stage2 not in ("hsa", "exact"):
            raise ValueError(f"stage2 must be hsa or exact, got {self.stage2!r}")
        if self.stage2 == "exact" and "hsa" in self.methods:
            raise ValueError("the hsa method (stage 2 alone) needs stage2 hsa")
        if self.seed < 0 or self.n_sink_tokens < 0:
            raise ValueError(f"seed and n_sink_tokens must be non-negative, got {self.seed}, {self.n_sink_tokens}")
        plan(self)  # every stage-1 configuration must be valid before any model loads (ValueError naming it)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Run:
    """One method at one budget (and stage-1 variant), answered from the cache `cache_key`."""

    method: str
    budget: int | None  # None: full attention, no budget
    observation: str | None
    pool_kernel: int | None  # 0 = auto
    cache_key: str
    label: str  # method as shown in tables


def pool_label(kernel: int) -> str:
    return "auto" if kernel == 0 else str(kernel)


def plan(cfg: EvalConfig) -> tuple[dict[str, PrefillConfig], list[Run]]:
    """The distinct stage-1 caches a sample needs (key → PrefillConfig) and the runs over them."""
    caches: dict[str, PrefillConfig] = {}
    runs: list[Run] = []
    base: dict = dict(max_new_tokens=cfg.plan_new_tokens, window_size=cfg.window_size, chunk_tokens=cfg.chunk_tokens)
    if {"full", "hsa"} & set(cfg.methods):
        caches["full"] = PrefillConfig(token_budget=FULL_TOKEN_BUDGET, **base)
    if "full" in cfg.methods:
        runs.append(Run("full", None, None, None, "full", "full"))
    variants = [(o, k) for o in cfg.observations for k in cfg.pool_kernels]
    for t in cfg.budgets:
        for i, (obs, kernel) in enumerate(variants):
            methods = [m for m in ("rocketkv", "snapkv") if m in cfg.methods and (m == "rocketkv" or i == 0)]
            if not methods:
                continue
            key = f"t{t}-{obs}-{pool_label(kernel)}"
            caches[key] = PrefillConfig(
                token_budget=t, max_new_tokens=cfg.plan_new_tokens, chunk_tokens=cfg.chunk_tokens,
                window_size=cfg.wide_window_size if obs == "wide" else cfg.window_size,
                observation="probe" if obs == "probe" else "tail", pool_kernel_size=kernel,
            )  # fmt: skip
            for m in methods:
                label = f"{m}[{obs},{pool_label(kernel)}]" if m == "rocketkv" and len(variants) > 1 else m
                runs.append(Run(m, t, obs, kernel, key, label))
        if "hsa" in cfg.methods:
            runs.append(Run("hsa", t, None, None, "full", "hsa"))
        for name, cls in registry().items():
            _plan_method(cfg, t, name, cls, caches, runs, base, variants[0])
    return caches, runs


def _plan_method(cfg: EvalConfig, t: int, name: str, cls: type[Stage1Method], caches: dict, runs: list,
                 base: dict, first_variant: tuple[str, int]) -> None:  # fmt: skip
    """Add the caches and runs of registered method `name` at budget t: the method itself (not for
    the tail window: "rocketkv" above), then its "_adaptive" and "_reselect" variants when asked."""
    prefix = "" if name == "tail" else f"{name}_"
    obs, kernel = first_variant
    if name == "tail":  # the first (observation, kernel) variant of the rocketkv runs
        window = cfg.wide_window_size if obs == "wide" else cfg.window_size
        fields: dict[str, Any] = dict(window_size=window, observation="probe" if obs == "probe" else "tail",
                                      pool_kernel_size=kernel)  # fmt: skip
    else:
        fields = cls.config_fields() | {k: getattr(cfg, v) for k, v in cls.eval_options.items()}
    label_obs: str | None = obs if name == "tail" else fields.get("observation")
    label_kernel: int | None = fields.get("pool_kernel_size")
    stem = f"t{t}-{obs}-{pool_label(kernel)}" if name == "tail" else f"t{t}-{cls.eval_key or name}"
    if name != "tail" and name in cfg.methods:
        caches[stem] = PrefillConfig(token_budget=t, **{**base, **fields})
        runs.append(Run(name, t, label_obs, label_kernel, stem, name))
    if f"{prefix}adaptive" in cfg.methods:
        caches[f"{stem}-adaptive"] = PrefillConfig(token_budget=t, layer_budgets="adaptive", **{**base, **fields})
        runs.append(Run(f"{prefix}adaptive", t, label_obs, label_kernel, f"{stem}-adaptive", f"{prefix}adaptive"))
    if f"{prefix}reselect" in cfg.methods:
        if name == "tail":
            fields = dict(observation="tail", pool_kernel_size=cfg.pool_kernels[0])
            label_obs, label_kernel = "tail", cfg.pool_kernels[0]
        key = f"t{t}-reselect" if name == "tail" else f"{stem}-reselect"
        caches[key] = PrefillConfig(token_budget=t, store_budget=cfg.store_factor * t, **{**base, **fields})
        runs.append(Run(f"{prefix}reselect", t, label_obs, label_kernel, key, f"{prefix}reselect"))


def stage2_only_budgets(n_context_tokens: int, max_new_tokens: int, token_budget: int, head_dim: int) -> dict:
    """HSA settings for a budget over the unpruned cache ("stage 2 only"): docs/algorithm.md §1 with the whole
    compression given to stage 2 (capacity = S): topk = t/2, c2 = S/t, page_size = ceil(√c2)
    (1 if above c2, at most topk), n_score_dims = floor(d·page_size/c2) in [1, d]. In tokens."""
    seq = n_context_tokens + max_new_tokens
    topk = max(1, token_budget // 2)
    c2 = max(1.0, seq / token_budget)
    page_size = math.ceil(math.sqrt(c2))
    page_size = min(1 if page_size > c2 else page_size, topk)
    return {"topk": topk, "page_size": page_size,
            "n_score_dims": min(head_dim, max(1, math.floor(head_dim * page_size / c2)))}  # fmt: skip
