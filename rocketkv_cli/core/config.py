"""Frozen, validated configuration and the RocketKV budget decomposition (paper §3.6; docs/algorithm.md §1).

All budgets are in tokens, per KV head, per layer. Nothing here reads the environment or the CLI.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import UsageError

# (selection, observation or None = any) of every registered stage-1 method, in registration
# order: `rocketkv_cli.methods.register` adds to it (the package imports its methods with itself),
# and `PrefillConfig` refuses a configuration that names no method
STAGE1_METHODS: list[tuple[str, str | None, frozenset[str]]] = []  # (…, the method's own option names)
LAYER_BUDGETS = ("uniform", "adaptive")  # how stage 1 splits the prompt budget over full-attention layers
DEFAULT_TOKEN_BUDGET = 512
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_WINDOW_SIZE = 32
DEFAULT_POOL_KERNEL_SIZE = 63
DEFAULT_FIRST_TOKENS = 64  # docs/algorithm.md §2 step 5
STORE_ALL = "all"  # a store budget that keeps every token (each question re-selects its working set from all)
SUMMARY_WRITE_FROM = ("sentences", "document")  # what a summary's model writes from (api/summaries.py)
# the `ask` options (`RocketKV.ask`'s keywords) that focus mode (`RocketKV.ask_focused`: the best
# passages re-read with the model's defaults, greedy) cannot take, with their defaults: a value
# other than these is refused, by the CLI (`ask --focus`) and the server alike
FOCUS_EXCLUDES: dict[str, object] = {"dense": False, "hsa": False, "topk": None, "page_size": None,
                                     "n_score_dims": None, "segments": 1, "segment": None, "temperature": 0.0,
                                     "top_p": 1.0, "seed": None}  # fmt: skip


KERNELS_ENV = "ROCKETKV_KERNELS"  # which implementation runs the kernel ops (`ops`): auto, torch or triton
KERNEL_BACKENDS = ("auto", "torch", "triton")


def kernels_choice() -> str:
    """`$ROCKETKV_KERNELS` lower-cased (default `auto`). Raises UsageError: another value."""
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in KERNEL_BACKENDS:
        raise UsageError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_BACKENDS)}, got {os.environ[KERNELS_ENV]!r}")
    return value


FOCUS_RANKINGS = ("bm25", "attention", "mixed")  # how focus ranks passages for a question (api/focus.py)


def focus_conflicts(options: dict) -> list[str]:
    """The options in `options` (`RocketKV.ask`'s keywords) that focus mode cannot take (`FOCUS_EXCLUDES`)."""
    return [name for name, default in FOCUS_EXCLUDES.items() if options.get(name, default) != default]


DEFAULT_SUMMARY_WRITE_FROM = "document"  # what a model writes from when it writes (not a measured preset)
# Models that extract their summaries unless asked to write (`--write-from`): measured in
# docs/summaries.md, where none of these presets' own summaries passed the summary check (every one
# printed was extracted after its model's two outputs were rejected, on every document, written from
# the document and from its key sentences alike), at 5-20x the time of extracting at once.
PRESET_SUMMARY_EXTRACTIVE = frozenset({"gemma-3-270m", "smollm2-135m"})


def summary_writing(model_id: str, extractive: bool | None = None, write_from: str | None = None,
                    can_extract: bool = True) -> str | None:  # fmt: skip
    """What model `model_id` writes a summary from ("document" or "sentences", `SUMMARY_WRITE_FROM`),
    or None: it writes nothing and the key sentences are extracted. `extractive` True: None;
    else `write_from` when given; else None for a model in `PRESET_SUMMARY_EXTRACTIVE` (its
    measured default) when the text `can_extract` (a cache without token ids cannot), else
    `DEFAULT_SUMMARY_WRITE_FROM`. `extractive` False and None alike leave the choice to the rest.

    Raises:
        ValueError: a `write_from` not in `SUMMARY_WRITE_FROM`.
    """
    if write_from is not None and write_from not in SUMMARY_WRITE_FROM:
        raise ValueError(f"write_from must be one of {', '.join(SUMMARY_WRITE_FROM)}, got {write_from!r}")
    if extractive:
        return None
    if write_from is not None:
        return write_from
    return None if model_id in PRESET_SUMMARY_EXTRACTIVE and can_extract else DEFAULT_SUMMARY_WRITE_FROM


# decode weight formats (model/weights.py)
WEIGHT_FORMATS = ("float", "head-bf16", "bf16", "int8", "int4", "head-int4", "mlp-bf16")
# the formats that prefill with the float model and change only decode steps' LM head (and, mlp-bf16,
# the MLPs' products): their caches record "float", readable by every release
FLOAT_CACHE_WEIGHT_FORMATS = ("head-bf16", "head-int4", "mlp-bf16")
# the weights a model loads with when none are named (`--weights`; `ask` on a cache: the cache's),
# chosen by measurement (docs/performance.md, "Do the faster formats answer like float32?"): a
# weight-only format only for a preset whose answers with it agree with the float32 model's on
# >= 0.98 of the answer tokens; the checkpoint's floats elsewhere — bf16 on SmolLM2 (0.987, 1.69x
# faster decode), on Gemma a format of the LM head alone (the float layers: bf16 layers agree on
# 0.973; mlp-bf16 agrees on 0.9986 but was no faster, docs/performance.md) — head-int4, whose
# greedy tokens are proven to be the float head's and whose head step is 3x head-bf16's speed
# (docs/performance.md, "head-int4 as Gemma's default"); float on any model not measured. Where
# torch lacks the int4 CPU kernel, head-int4 falls back to head-bf16
# (`model.loading.load_model`).
DEFAULT_WEIGHTS = "float"
PRESET_WEIGHTS_DEFAULTS: dict[str, str] = {"smollm2-135m": "bf16", "gemma-3-270m": "head-int4"}
# what `ingest` stores by default (`core/quant.py` parses it; kept here, torch-free, for the CLI's
# option defaults), chosen by measurement (docs/storage.md, "Default and targets"): the smallest
# storage whose teacher-forced top-1 agreement with the float32 cache is >= 0.98 — int4 on SmolLM2
# (int4+alloc has its size and a third of its KL, but opens and answers 1.2x slower), int8 on Gemma
# (int4+alloc: 0.97 at 8K and 32K) and on any model not measured
DEFAULT_KV_DTYPE = "int8"
PRESET_KV_DTYPE_DEFAULTS: dict[str, str] = {"smollm2-135m": "int4"}


def default_weights(model_id: str) -> str:
    """The weight format model `model_id` loads with when none is named (`PRESET_WEIGHTS_DEFAULTS`,
    else `DEFAULT_WEIGHTS`)."""
    return PRESET_WEIGHTS_DEFAULTS.get(model_id, DEFAULT_WEIGHTS)


def default_kv_dtype(model_id: str) -> str:
    """The storage `ingest` uses for model `model_id` when none is given (a preset's measured
    choice, `PRESET_KV_DTYPE_DEFAULTS`, else `DEFAULT_KV_DTYPE`)."""
    return PRESET_KV_DTYPE_DEFAULTS.get(model_id, DEFAULT_KV_DTYPE)


DEFAULT_MODEL = "gemma-3-270m"  # the model used where none is named (a preset of `model.resolve.PRESETS`)

# Stage-1 settings chosen per preset by measurement: they replace PrefillConfig's own defaults for that
# model only, and never a field the user set. The store and the answering budget follow the measured
# frontier (docs/frontier.md, "Default rule"): the smallest file whose answers keep >= 98% of full
# attention's score and >= 0.98 of its top-1 choices is, on both presets, every token stored
# (`store_budget` "all": no question-agnostic pruning) with each question re-selecting its working
# set of t's prompt budget by its own queries (t as the rule chose it: the faster decode step of those
# that hold the bar, timed side by side). The observation (SmolLM2: context reconstruction,
# docs/stage1-methods.md) scores tokens when a user asks for a smaller store (`--store-budget N`).
PRESET_PREFILL_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "observation": "reconstruct",
        "pool_kernel_size": 7,
        "store_budget": STORE_ALL,
        "token_budget": 1024,
    },
    "gemma-3-270m": {"store_budget": STORE_ALL, "token_budget": 1024},
}


def check_stage1_method(selection: str, observation: str, options: Iterable[str] = ()) -> None:
    """Refuse a (selection, observation) pair that no registered stage-1 method answers to, or
    `options` (names of `PrefillConfig.method_options`) that the method does not declare.

    Raises:
        ValueError: an unknown selection, an observation that no method of it takes (the message
            lists the valid values), or an option the method does not have.
    """
    matches = [(o, names) for s, o, names in STAGE1_METHODS if s == selection]
    if not matches:
        raise ValueError(f"selection must be one of {tuple(dict.fromkeys(s for s, _, _ in STAGE1_METHODS))}, "
                         f"got {selection!r}")  # fmt: skip
    known = next((names for o, names in matches if o == observation), None)
    known = known if known is not None else next((names for o, names in matches if o is None), None)
    if known is None:
        observations = tuple(o for _, o, _ in STAGE1_METHODS if o is not None)
        raise ValueError(f"observation must be one of {observations}, got {observation!r}")
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"method_options names {', '.join(unknown)}, which this stage-1 method does not have"
                         + (f" (it has {', '.join(sorted(known))})" if known else " (it has none)"))  # fmt: skip


def _positive(name: str, value: int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class PrefillConfig:
    """Stage-1 (SnapKV++) settings, fixed at ingest time.

    token_budget: t, the decode-time budget in tokens from which the rest is derived (docs/algorithm.md §1).
    max_new_tokens: answer length the budget plans for (S = n + max_new_tokens).
    window_size: W, observation-window queries used to score (and always kept).
    pool_kernel_size: odd max-pool kernel in tokens, or 0 for the `auto` rule by length.
    selection, observation: together they name the stage-1 method (`rocketkv_cli.methods`,
        one class per method, e.g. selection "snapkv" with observation "tail" (the document's
        last W queries), "probe" (those plus a generic probe text) or "reconstruct" (the model
        re-reading the document, KVzip §3); selection "sink_recent", a baseline keeping the
        first `n_sink_tokens` tokens plus the most recent ones, any observation). A pair that
        no registered method answers to is refused (`check_stage1_method`).
    method_options: the method's own options that are not fields here, as (name, value) pairs
        (a dict is accepted and sorted by name; values int, float, str or bool); checked against
        the options the method declares; recorded in the file's `config` only when given.
    store_budget: a token budget (≥ token_budget) for what the file keeps: it stores the prompt
        budget derived from this budget instead of from t (None = t), or `STORE_ALL` ("all"):
        every token of the document (no question-agnostic pruning). Each question then
        re-selects its working set of t's prompt budget from the stored tokens, with its own
        queries as the observation window (docs/algorithm.md §4): the file grows with the store
        budget, decode traffic stays with the token budget.
    prompt_budget, topk, page_size, n_score_dims: overrides of the derived values (None = derive).
    chunk_tokens: prefill chunk length in tokens (bounds activation memory).
    n_sink_tokens: attention-sink tokens kept at the start by "sink_recent".
    n_first_tokens: leading framed tokens SnapKV++ always keeps (attention sinks, the framing, the
        document's first tokens: titles, instructions); 0 in files written before it existed.
    layer_budgets: "uniform" (every full-attention layer keeps the prompt budget per KV head) or
        "adaptive" (the same total over the layers, split by where the selection scores put the
        heads' attention mass: `core.stage1.allocate_layer_budgets`; SnapKV++ selection only).
    """

    token_budget: int = DEFAULT_TOKEN_BUDGET
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    window_size: int = DEFAULT_WINDOW_SIZE
    pool_kernel_size: int = DEFAULT_POOL_KERNEL_SIZE
    observation: str = "tail"
    prompt_budget: int | None = None
    topk: int | None = None
    page_size: int | None = None
    n_score_dims: int | None = None
    chunk_tokens: int = 1024
    selection: str = "snapkv"
    n_sink_tokens: int = 4
    n_first_tokens: int = DEFAULT_FIRST_TOKENS
    store_budget: int | str | None = None
    layer_budgets: str = "uniform"
    method_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        options = dict(self.method_options) if isinstance(self.method_options, (dict, list, tuple)) else None
        if options is None or not all(isinstance(k, str) and k.isidentifier() for k in options):
            raise ValueError(f"method_options must map option names to values, got {self.method_options!r}")
        if not all(isinstance(v, (int, float, str, bool)) for v in options.values()):
            raise ValueError(f"method_options values must be numbers, strings or booleans, got {options!r}")
        object.__setattr__(self, "method_options", tuple(sorted(options.items())))
        check_stage1_method(self.selection, self.observation, options)
        for name in ("n_sink_tokens", "n_first_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("token_budget", "max_new_tokens", "window_size", "chunk_tokens"):
            _positive(name, getattr(self, name), allow_none=False)
        for name in ("prompt_budget", "topk", "page_size", "n_score_dims"):
            _positive(name, getattr(self, name))
        if self.store_budget != STORE_ALL:
            _positive("store_budget", self.store_budget)  # type: ignore[arg-type]
        if isinstance(self.store_budget, int) and self.store_budget < self.token_budget:
            raise ValueError(f"store_budget must be at least the token budget ({self.token_budget}), "
                             f"got {self.store_budget}")  # fmt: skip
        if self.store_budget is not None and self.selection != "snapkv":
            raise ValueError(
                f"store_budget needs selection 'snapkv' (re-selection is SnapKV++), got {self.selection!r}"
            )
        if self.layer_budgets not in LAYER_BUDGETS:
            raise ValueError(f"layer_budgets must be {' or '.join(LAYER_BUDGETS)}, got {self.layer_budgets!r}")
        if self.layer_budgets != "uniform" and self.selection != "snapkv":
            raise ValueError(f"layer_budgets {self.layer_budgets!r} needs selection 'snapkv' (it splits by its "
                             f"scores), got {self.selection!r}")  # fmt: skip
        if self.layer_budgets != "uniform" and self.store_budget is not None:
            raise ValueError(f"layer_budgets {self.layer_budgets!r} does not combine with store_budget (each question "
                             "re-selects the same prompt budget in every layer)")  # fmt: skip
        k = self.pool_kernel_size
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or (k > 0 and k % 2 == 0):
            raise ValueError(f"pool_kernel_size must be an odd positive integer or 0 (auto), got {k!r}")
        if self.page_size is not None and self.page_size > (self.topk or self.token_budget // 2 or 1):
            raise ValueError(f"page_size must not exceed topk (tokens attended per step), got {self.page_size}")
        if self.prompt_budget is not None and self.prompt_budget < self.window_size:
            raise ValueError(
                f"prompt_budget must be at least window_size ({self.window_size}), got {self.prompt_budget}"
            )
        if self.prompt_budget is None and self.selection == "snapkv" and self.token_budget < self.window_size:
            raise ValueError(
                f"token_budget {self.token_budget} is below the observation window (window_size {self.window_size}), "
                "which stage 1 always keeps: raise the token budget, or lower window_size"
            )

    def to_dict(self) -> dict:
        """All fields, except the selection fields while at their defaults: a default cache's
        `config` metadata stays exactly what rocketkv wrote before they existed (older readers
        reject unknown keys), and a file without them reads back as SnapKV++."""
        d = asdict(self)
        if self.selection == "snapkv" and self.n_sink_tokens == 4:
            del d["selection"], d["n_sink_tokens"]
        if self.store_budget is None:
            del d["store_budget"]
        if self.layer_budgets == "uniform":
            del d["layer_budgets"]
        if self.method_options:
            d["method_options"] = dict(self.method_options)
        else:
            del d["method_options"]
        return d

    def pool_kernel(self, n_context_tokens: int) -> int:
        """The max-pool kernel in tokens for a document of `n_context_tokens`: `pool_kernel_size`,
        or the `auto` rule by length when it is 0 (`auto_pool_kernel_size`)."""
        return self.pool_kernel_size or auto_pool_kernel_size(n_context_tokens)

    def stored_tokens(self, n_context_tokens: int, prompt_budget: int) -> int:
        """Tokens per KV head per layer the file keeps for a document of `n_context_tokens`,
        given the working set's `prompt_budget`: the prompt budget derived from `store_budget`
        (docs/algorithm.md §1), never less than the working set; all of them for `STORE_ALL`."""
        if self.store_budget is None:
            return prompt_budget
        if not isinstance(self.store_budget, int):  # STORE_ALL
            return n_context_tokens
        stored = derive_budgets(n_context_tokens, self.max_new_tokens, self.store_budget, 1).prompt_budget
        return max(prompt_budget, stored)


class PageOverTopk(ValueError):
    """Budgets whose page holds more tokens than a decode step attends (`ingest --topk` below the
    derived page wrote such files before 2026-12-06)."""

    def __init__(self, page_size: int, topk: int):
        super().__init__(f"page_size must not exceed topk ({topk}), got {page_size}")
        self.page_size, self.topk = page_size, topk


@dataclass(frozen=True)
class Budgets:
    """Derived per-layer, per-KV-head budgets in tokens (docs/algorithm.md §1)."""

    prompt_budget: int  # tokens stage 1 keeps (observation window included)
    capacity_budget: int  # prompt_budget + max_new_tokens
    topk: int  # tokens attended exactly per decode step
    page_size: int  # tokens per key min/max page
    n_score_dims: int  # head dimensions used for approximate page scores

    def __post_init__(self) -> None:
        for name in ("prompt_budget", "capacity_budget", "topk", "page_size", "n_score_dims"):
            _positive(name, getattr(self, name), allow_none=False)
        if self.page_size > self.topk:  # derive_budgets never gives one: a page never exceeds a step's top-k
            raise PageOverTopk(self.page_size, self.topk)

    def to_dict(self) -> dict:
        return asdict(self)


def derive_budgets(n_context_tokens: int, max_new_tokens: int, token_budget: int, head_dim: int) -> Budgets:
    """Split a token budget t into stage-1 and stage-2 budgets (paper §3.6; docs/algorithm.md §1).

    With S = n + max_new_tokens: c = max(1, S/t); r = min(0.2 + 0.06·log2(c), 0.8);
    prompt_budget = max(floor(S / c^r) − max_new_tokens, min(n, t)); capacity = prompt_budget +
    max_new_tokens; topk = t/2; c2 = max(1, capacity/t); page_size = ceil(sqrt(c2)) (1 if that
    exceeds c2); n_score_dims = floor(head_dim · page_size / c2) clamped to [1, head_dim].

    The floor min(n, t): a document that fits the token budget is kept whole, and a longer one
    keeps at least t tokens. Without it a short answer plan would squeeze stage 1 to a handful of
    tokens (S / c^r − max_new_tokens is small when n is a little over t), and a document would be
    pruned harder than a longer one at the same budget.

    Args:
        n_context_tokens: n, document tokens.
        max_new_tokens: tokens an answer may add.
        token_budget: t, in tokens per KV head per layer.
        head_dim: d.
    Returns:
        `Budgets`; the caller keeps everything when n ≤ prompt_budget.
    Raises:
        ValueError: a non-positive argument, naming it.
    """
    for name, value in (
        ("n_context_tokens", n_context_tokens),
        ("max_new_tokens", max_new_tokens),
        ("token_budget", token_budget),
        ("head_dim", head_dim),
    ):
        _positive(name, value, allow_none=False)
    seq = n_context_tokens + max_new_tokens
    c = max(1.0, seq / token_budget)
    r = min(0.2 + 0.06 * math.log2(c), 0.8)
    prompt_budget = max(math.floor(seq / c**r) - max_new_tokens, min(n_context_tokens, token_budget))
    capacity = prompt_budget + max_new_tokens
    topk = max(1, token_budget // 2)
    c2 = max(1.0, capacity / token_budget)
    page_size = math.ceil(math.sqrt(c2))
    if page_size > c2:
        page_size = 1
    page_size = min(page_size, topk)  # a page never exceeds what one step attends
    n_score_dims = min(head_dim, max(1, math.floor(head_dim * page_size / c2)))
    return Budgets(
        prompt_budget=prompt_budget,
        capacity_budget=capacity,
        topk=topk,
        page_size=page_size,
        n_score_dims=n_score_dims,
    )


def resolve_budgets(cfg: PrefillConfig, n_context_tokens: int, head_dim: int) -> Budgets:
    """`derive_budgets` for `cfg`, with its explicit overrides applied. Shapes: scalars in tokens."""
    b = derive_budgets(n_context_tokens, cfg.max_new_tokens, cfg.token_budget, head_dim)
    prompt_budget = cfg.prompt_budget if cfg.prompt_budget is not None else b.prompt_budget
    topk = cfg.topk if cfg.topk is not None else b.topk
    return Budgets(
        prompt_budget=prompt_budget,
        capacity_budget=prompt_budget + cfg.max_new_tokens,
        topk=topk,
        page_size=cfg.page_size if cfg.page_size is not None else min(b.page_size, topk),
        n_score_dims=min(head_dim, cfg.n_score_dims) if cfg.n_score_dims is not None else b.n_score_dims,
    )


def auto_pool_kernel_size(n_context_tokens: int) -> int:
    """The `auto` pooling rule: a kernel that grows with the document, in tokens (odd).

    7 below 4K tokens, 15 below 16K, 31 below 64K, 63 from there (the paper's final fixed value).
    """
    for limit, kernel in ((4096, 7), (16384, 15), (65536, 31)):
        if n_context_tokens < limit:
            return kernel
    return 63


@dataclass(frozen=True)
class DecodeConfig:
    """Stage-2 (hybrid sparse attention) settings used while answering.

    sparse: False = exact attention over the whole stored cache (the "stage 1 only" method).
    topk, page_size, n_score_dims: tokens attended per step, tokens per page, score dims.
    min_hsa_tokens: a layer whose stored context holds at most max(topk, this) tokens is attended
        exactly — below the measured size where HSA's page scoring and gather cost more than
        reading every token (0: HSA wherever the context holds more than topk).
    n_sink_tokens: the first tokens of the context, attended at every step (attention sinks).
    The question and the tokens decoded so far are always attended exactly (docs/algorithm.md §3).
    """

    topk: int
    page_size: int
    n_score_dims: int
    sparse: bool = True
    min_hsa_tokens: int = 0
    n_sink_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("topk", "page_size", "n_score_dims"):
            _positive(name, getattr(self, name), allow_none=False)
        for name in ("min_hsa_tokens", "n_sink_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.page_size > self.topk:
            raise ValueError(f"page_size must not exceed topk ({self.topk}), got {self.page_size}")

    def uses_hsa(self, n_context_tokens: int) -> bool:
        """Whether a layer whose stored context holds `n_context_tokens` is attended with HSA."""
        return self.sparse and n_context_tokens > max(self.topk, self.min_hsa_tokens)


@dataclass(frozen=True)
class AttentionChoice:
    """The user's choice of decode attention, checked here once for every caller (the CLI before
    any model loads, `RocketKV.ask`/`session`, the server): `dense` = exact attention over the
    stored cache; `hsa` = stage-2 HSA even where the device's measured crossover says exact
    attention is faster; neither = the crossover decides (`DecodeConfig.min_hsa_tokens`).

    Raises:
        UsageError: both `dense` and `hsa`.
    """

    dense: bool = False
    hsa: bool = False

    def __post_init__(self) -> None:
        for name in ("dense", "hsa"):
            if not isinstance(getattr(self, name), bool):  # "no" was taken as true
                raise UsageError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dense and self.hsa:
            raise UsageError("--dense and --hsa contradict each other", "give one of them")


def preset_config(model_id: str, fields: Mapping[str, Any]) -> PrefillConfig:
    """A `PrefillConfig` of the user's `fields` with the measured stage-1 defaults of preset
    `model_id` (`PRESET_PREFILL_DEFAULTS`) in the others. The fields are checked against the
    preset's token budget, the default `--help` and the docs name, never silently against another
    (`--window-size 800` fits the presets' 1024, not the generic 512; `--store-budget 600` under
    it is an error, not a budget of 512); the preset's other defaults give way where they do not
    combine with the user's fields (`with_preset_defaults`).

    Raises:
        ValueError: the user's fields are invalid with that budget. TypeError: a name no field has.
    """
    given = dict(fields)
    preset = PRESET_PREFILL_DEFAULTS.get(model_id, {})
    budget = {k: v for k, v in preset.items() if k == "token_budget" and k not in given}
    return with_preset_defaults(PrefillConfig(**{**budget, **given}), model_id, [*given, *budget])


def with_preset_defaults(cfg: PrefillConfig, model_id: str, explicit: Iterable[str]) -> PrefillConfig:
    """`cfg` with the measured stage-1 defaults of preset `model_id` (`PRESET_PREFILL_DEFAULTS`)
    in every field not named in `explicit` (the fields the user set). A preset default that does
    not combine with what the user chose gives way to it (a store budget beside `--layer-budgets
    adaptive` or a baseline selection, a re-selection budget below the user's token budget). Other
    models: `cfg`.

    Raises:
        ValueError: the user's own combination is invalid (as `PrefillConfig`).
    """
    given = set(explicit)
    changes = {k: v for k, v in PRESET_PREFILL_DEFAULTS.get(model_id, {}).items() if k not in given}
    for name, value in changes.items():
        try:
            cfg = replace(cfg, **{name: value})
        except ValueError:
            continue  # the user's choice wins over a preset default it rules out
    return cfg
