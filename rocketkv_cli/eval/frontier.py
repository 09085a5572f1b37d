"""The accuracy frontier (docs/frontier.md): how small a stored cache can be, and how each question
should attend over it, before answers stop being full attention's.

Two axes, every point derived from one prefill of each document:
- the store: tokens per KV head per full-attention layer that the `.kv` file keeps, chosen before
  any question by the preset's stage-1 method (`everything`, a share of the document, or a count);
- the answering mode over what is stored: `exact` (exact attention over all of it), `hsa@t` (stage
  2 at every decode step: HSA at token budget t, top-k = t/2 tokens per step, pages and score
  dimensions derived for the stored count, docs/algorithm.md §1 and §3) or `reselect@t` (once per
  question: SnapKV++ scores of the question's own queries pick t's prompt budget of the stored
  tokens, sinks and the local window kept, then exact attention over that working set; §4).

Each point answers every question teacher-forced along full attention's answer (top-1 agreement,
KL(full ‖ point) per answer token) and generates its own answer only where it disagrees (the
substring score). Samples are independent, so a report is resumable per sample.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.cache import CompressedKVCache
from ..core.config import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_WINDOW_SIZE,
    DecodeConfig,
    PrefillConfig,
    auto_pool_kernel_size,
    derive_budgets,
)
from ..core.quant import KVStorage
from ..engine.answer import decode_config_for, prepare_questions
from ..engine.answer import generate as generate_answer
from ..engine.decoder import Decoder
from ..engine.engine import QUESTION_RESERVE_TOKENS, Engine
from ..engine.inputs import Document
from ..errors import BudgetError
from ..methods.reselect import Reselection
from ..store.format import load_cache, save_cache
from .plan import FULL_TOKEN_BUDGET, stage2_only_budgets
from .runner import _logp, _teacher_forced, compress_variants, match_fraction
from .tasks import TASKS, Sample

MODES = ("exact", "hsa", "reselect")
DECODE_TIMING_STEPS = 12  # decode steps timed per point, on the first sample only


@dataclass(frozen=True)
class FrontierConfig:
    """One preset's frontier grid. Lengths and budgets in tokens.

    stores: what the file keeps per KV head per full-attention layer: "all", a share of the
        document ("50%") or a count ("2048"); points that come out equal or ≥ the document are
        measured once. hsa_budgets: token budgets t of the per-step mode (top-k = t/2).
        reselect_budgets: token budgets t of the one-shot mode (working set = t's prompt budget,
        docs/algorithm.md §1). stage1: the PrefillConfig fields of the preset's stage-1 method
        (observation, pool kernel), as `ingest` uses them. kv_dtype: storage (a `KVStorage` name).
    Raises:
        ValueError: an unknown task or store spec, an empty or repeated axis, a bad count.
    """

    context_tokens: int
    tasks: tuple[str, ...]
    samples: int
    kv_dtype: str
    stores: tuple[str, ...] = ("all", "50%", "25%", "4096", "2048", "1024")
    hsa_budgets: tuple[int, ...] = (256, 512, 1024)
    reselect_budgets: tuple[int, ...] = (512, 1024)
    stage1: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    plan_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    window_size: int = DEFAULT_WINDOW_SIZE
    chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage1", tuple(sorted(dict(self.stage1).items())))
        if not self.tasks or len(set(self.tasks)) != len(self.tasks) or any(t not in TASKS for t in self.tasks):
            raise ValueError(f"tasks must be distinct values from {', '.join(TASKS)}, got {self.tasks}")
        for name in ("stores", "hsa_budgets", "reselect_budgets"):
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name} must be distinct, got {getattr(self, name)}")
        if "all" not in self.stores:
            raise ValueError("stores must include 'all' (full attention is the reference)")
        for spec in self.stores:
            store_tokens(spec, 1 << 20)  # ValueError on a bad spec
        for name in ("context_tokens", "samples", "plan_new_tokens", "window_size", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if min(self.hsa_budgets + self.reselect_budgets, default=2) < 2:
            raise ValueError("budgets must be at least 2 tokens")
        KVStorage.parse(self.kv_dtype)
        if fixed := {"store_budget", "token_budget", "prompt_budget"} & set(dict(self.stage1)):
            raise ValueError(f"stage1 must not set {', '.join(sorted(fixed))}: the stores are the grid's")
        PrefillConfig(**dict(self.stage1))  # the stage-1 fields must make a valid config

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"stage1": dict(self.stage1)}

    def digest(self) -> str:
        """What a resumed report must share with the run it continues (everything but `samples`)."""
        d = self.to_dict()
        del d["samples"]
        return hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()[:16]


SCREEN_STORES = ("all", "50%", "25%")  # the stores a stage-1 method is screened at (`screen_config`)


def screen_config(base: FrontierConfig, stage1: dict[str, Any], tasks: tuple[str, ...], budget: int) -> FrontierConfig:
    """A smaller grid to try another stage-1 method against the preset's own (docs/frontier.md,
    "Pushing the frontier down"): `base` with `stage1` fields replaced (e.g. {"observation":
    "probe"}), only `tasks` (those full attention solves: the only ones a score counts), the
    stores `SCREEN_STORES` and two answering modes, exact attention and re-selection at the
    preset's own token budget `budget` (the default's mode); no HSA.

    Raises:
        ValueError: as `FrontierConfig`, or `stage1` is empty or names a store field.
    """
    if not stage1:
        raise ValueError("a screen changes at least one stage-1 field")
    fields = tuple({**dict(base.stage1), **stage1}.items())
    return dataclasses.replace(base, tasks=tuple(tasks), stores=SCREEN_STORES, hsa_budgets=(),
                               reselect_budgets=(budget,), stage1=fields)  # fmt: skip


def store_tokens(spec: str, n: int) -> int:
    """Tokens per KV head a store spec keeps of an n-token document: "all" → n, "P%" → n·P/100,
    a count → itself; never more than n. Raises ValueError on anything else."""
    text = str(spec).strip()
    if text == "all":
        return n
    if text.endswith("%") and text[:-1].isdigit() and 0 < int(text[:-1]) <= 100:
        return max(1, n * int(text[:-1]) // 100)
    if text.isdigit() and int(text) > 0:
        return min(int(text), n)
    raise ValueError(f"a store is 'all', a share like '50%' or a token count, got {spec!r}")


@dataclass(frozen=True)
class Point:
    """One point of the grid: a store (its label, the spec it is measured by, and its size in
    tokens per KV head at the config's nominal length) and an answering mode."""

    store_label: str
    store_spec: str
    nominal_store: int
    mode: str  # one of MODES
    budget: int | None  # t (None for exact)

    @property
    def label(self) -> str:
        return f"{self.store_label} · {self.mode}" + ("" if self.budget is None else f"@{self.budget}")


def grid(cfg: FrontierConfig) -> list[Point]:
    """The points of the grid, decided at the config's nominal length (every sample of a report has
    the same points; a store's actual size follows each document's length). Stores of equal size
    are measured once (their labels joined); a mode is measured only where it prunes further:
    hsa@t when t is below the store, reselect@t when t's prompt budget is. Everything first: the
    reference answers first."""
    n = cfg.context_tokens
    specs: dict[int, list[str]] = {}
    for spec in cfg.stores:
        s = store_tokens(spec, n)
        if s >= cfg.window_size or spec == "all":
            specs.setdefault(s, []).append(spec)
    points = []
    for s in sorted(specs, reverse=True):
        names = sorted(specs[s], key=lambda x: x != "all")
        label = " = ".join("everything" if x == "all" else x for x in names)
        points.append(Point(label, names[0], s, "exact", None))
        points += [Point(label, names[0], s, "hsa", t) for t in cfg.hsa_budgets if t < s]
        points += [Point(label, names[0], s, "reselect", t) for t in cfg.reselect_budgets
                   if reselect_working_set(n, cfg.plan_new_tokens, t) < s]  # fmt: skip
    return points


def reselect_working_set(n: int, max_new_tokens: int, t: int) -> int:
    """Tokens per KV head one question's re-selection keeps at token budget t: t's prompt budget
    for an n-token document (docs/algorithm.md §1), as `ingest --budget t --store-budget …` sets it."""
    return derive_budgets(n, max_new_tokens, t, 1).prompt_budget


def store_config(cfg: FrontierConfig, tokens: int, n: int) -> PrefillConfig:
    """The stage-1 config that keeps `tokens` per KV head (everything when tokens == n)."""
    base = dict(max_new_tokens=cfg.plan_new_tokens, window_size=cfg.window_size, chunk_tokens=cfg.chunk_tokens,
                **dict(cfg.stage1))  # fmt: skip
    if tokens >= n:
        return PrefillConfig(token_budget=FULL_TOKEN_BUDGET, **base)
    return PrefillConfig(token_budget=max(tokens, cfg.window_size), prompt_budget=tokens, **base)


def run_sample(engine: Engine, cfg: FrontierConfig, sample: Sample, workdir: Path, time_decode: bool = False) -> dict:
    """Every point of the grid on one sample, from one prefill; returns {"records", "stores",
    "timing"}: one record per (point, question); per store its file bytes and tokens.

    Raises:
        BudgetError: a document the model's context does not fit.
    """
    doc = Document(sample.document, hashlib.sha256(sample.document.encode()).hexdigest(),
                   f"frontier-{sample.task}-{sample.index}")  # fmt: skip
    t0 = time.perf_counter()
    n = len(engine.document_ids(doc))
    points = grid(cfg)
    stores = {p.store_label: store_tokens(p.store_spec, n) for p in points}  # label → tokens per KV head
    caches = compress_variants(engine, doc, [store_config(cfg, s, n) for s in stores.values()],
                               storage=KVStorage.parse(cfg.kv_dtype))  # fmt: skip
    prefill_s = time.perf_counter() - t0
    store_info: dict[str, dict[str, Any]] = {}
    records: list[dict] = []
    reference: dict[int, dict] = {}  # question index → full attention's answer and log-probabilities
    max_new = sample.max_new_tokens
    for (label, s), cache in zip(stores.items(), caches):
        path = save_cache(cache, workdir / f"store-{s}.kv", force=True)
        loaded = load_cache(path)
        if not isinstance(loaded, CompressedKVCache):
            raise BudgetError(f"{path}: frontier documents fit one segment")
        engine.check(loaded, str(path))
        store_info[label] = {"tokens": s, "file_bytes": path.stat().st_size}
        prepared = prepare_questions(engine, loaded, [q.text for q in sample.questions], max_new)
        tail = max(QUESTION_RESERVE_TOKENS, max(len(i) for _, i in prepared)) + max_new + 2
        for point in (p for p in points if p.store_label == label):
            decoder = _point_decoder(engine, loaded, point, n, s, cfg, tail)
            is_full = point.store_spec == "all" and point.mode == "exact"
            for qi, (question, (text, ids)) in enumerate(zip(sample.questions, prepared)):
                records.append(_answer(engine, decoder, point, is_full, qi, question, text, ids, max_new, reference,
                                       sample, n) | {"stored_tokens": s})  # fmt: skip
            if time_decode:
                store_info[label].setdefault("decode_ms", {})[point.label] = _decode_ms(decoder, prepared[0][1])
    timing = {"task": sample.task, "sample": sample.index, "n_context_tokens": n,
              "prefill_s": round(prefill_s, 3), "total_s": round(time.perf_counter() - t0, 3)}  # fmt: skip
    return {"records": records, "stores": store_info, "timing": timing}


def _point_decoder(engine: Engine, cache: CompressedKVCache, point: Point, n: int, stored: int, cfg: FrontierConfig,
                   tail: int) -> Decoder:  # fmt: skip
    """A decoder over one store answering as `point` does: exact attention, HSA at the point's
    budget, or a one-shot re-selection of t's prompt budget (then exact attention over it)."""
    decoder = Decoder(engine, cache, tail, _decode_config(cache, point, stored, cfg, engine.shape.head_dim),
                      reselect=False)  # fmt: skip
    if point.mode == "reselect":
        working = reselect_working_set(n, cfg.plan_new_tokens, point.budget or 0)
        decoder.reselection = Reselection(working, cfg.window_size, auto_pool_kernel_size(stored),
                                          cache.info.config.n_first_tokens)  # fmt: skip
    return decoder


def time_points(engine: Engine, cfg: FrontierConfig, sample: Sample, labels: list[str], workdir: Path,
                rounds: int = 5) -> dict[str, float]:  # fmt: skip
    """Milliseconds per decode step of each point named in `labels`, side by side: one prefill of
    the sample's document, each point's decoder built once, then in each of `rounds` rounds every
    point times `DECODE_TIMING_STEPS` steps after the first question in turn; the median of its
    rounds' medians. Raises ValueError naming a label that is not a point of the grid."""
    points = [p for p in grid(cfg) if p.label in labels]
    if unknown := set(labels) - {p.label for p in points}:
        raise ValueError(f"not points of the grid: {sorted(unknown)}")
    doc = Document(sample.document, hashlib.sha256(sample.document.encode()).hexdigest(), "frontier-timing")
    n = len(engine.document_ids(doc))
    stores = {p.store_label: store_tokens(p.store_spec, n) for p in points}
    caches = compress_variants(engine, doc, [store_config(cfg, s, n) for s in stores.values()],
                               storage=KVStorage.parse(cfg.kv_dtype))  # fmt: skip
    ids = engine.question_ids(sample.questions[0].text)
    tail = max(QUESTION_RESERVE_TOKENS, len(ids)) + DECODE_TIMING_STEPS + 2
    decoders = {}
    for (label, s), cache in zip(stores.items(), caches):
        loaded = load_cache(save_cache(cache, workdir / f"timing-{s}.kv", force=True))
        if not isinstance(loaded, CompressedKVCache):
            raise BudgetError("frontier documents fit one segment")
        for point in (p for p in points if p.store_label == label):
            decoders[point.label] = _point_decoder(engine, loaded, point, n, s, cfg, tail)
    times: dict[str, list[float]] = {label: [] for label in decoders}
    for _ in range(rounds):
        for label, decoder in decoders.items():
            times[label].append(_decode_ms(decoder, ids))
    return {label: sorted(v)[len(v) // 2] for label, v in times.items()}


def _decode_config(cache: CompressedKVCache, point: Point, stored: int, cfg: FrontierConfig,
                   head_dim: int) -> DecodeConfig:  # fmt: skip
    """HSA at the point's budget over `stored` tokens per KV head for hsa@t, else exact attention."""
    if point.mode == "hsa" and point.budget is not None:
        return decode_config_for(cache, True, **stage2_only_budgets(stored, cfg.plan_new_tokens, point.budget,
                                                                    head_dim))  # fmt: skip
    return decode_config_for(cache, sparse=False)


def _answer(engine: Engine, decoder: Decoder, point: Point, is_full: bool, qi: int, question: Any, text: str,
            ids: list[int], max_new: int, reference: dict, sample: Sample, n: int) -> dict:  # fmt: skip
    """One question at one point: the reference (full attention) generates; every other point is
    scored teacher-forced along the reference and generates only where it disagrees."""
    forced: dict = {"top1_agreement": None, "kl": None, "generated": True}
    ans = None
    if not is_full:
        forced, same = _teacher_forced(engine, decoder, ids, reference[qi])
        forced.pop("ref_logprob", None)
        if same:
            ans = reference[qi]["answer"]
    if ans is None:
        ans = generate_answer(engine, decoder, text, ids, max_new, engine.prompt.stop_strings)
        decoder.reset()
        if is_full:
            reference[qi] = {"answer": ans, "logp": _logp(decoder, ids, list(ans.token_ids))}
    return {"task": sample.task, "sample": sample.index, "question_index": qi, "n_context_tokens": n,
            "store": point.nominal_store, "store_label": point.store_label, "mode": point.mode, "budget": point.budget,
            "label": point.label, "answer": ans.text, "expected": list(question.expected),
            "score": match_fraction(ans.text, question.expected), **forced,
            "n_answer_tokens": ans.n_answer_tokens}  # fmt: skip


def _decode_ms(decoder: Decoder, ids: list[int]) -> float:
    """Median milliseconds of one decode step at this point, after a question's prefill."""
    times = []
    with torch.inference_mode(), decoder.attention():
        logits = decoder.prefill(ids)
        token = int(logits.argmax())
        for _ in range(DECODE_TIMING_STEPS):
            t = time.perf_counter()
            token = int(decoder.decode_one_token(token).argmax())
            times.append(time.perf_counter() - t)
    decoder.reset()
    return round(1000 * sorted(times)[len(times) // 2], 2)
