"""`rocketkv eval`: full attention vs rocketkv vs baselines on RULER-style tasks (docs/accuracy.md).

Every method answers through the saved-file path the CLI uses: its cache is written with
`store.format.save_cache`, read back with `load_cache`, checked with `Engine.check` and answered
with `engine.answer.answer` (the code `rocketkv ask` runs). The document is prefilled once per
sample (`Engine.prefill`) and compressed for every method's stage-1 settings (`Engine.compress`,
through the same selectors and kernel dispatch as `ingest`). No printing here: progress goes
through a callback.

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

import dataclasses
import hashlib
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.cache import CompressedKVCache
from ..core.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_WINDOW_SIZE, PrefillConfig, default_kv_dtype
from ..core.quant import KVStorage
from ..engine.answer import decode_config_for, prepare_questions
from ..engine.answer import generate as generate_answer
from ..engine.decoder import Decoder
from ..engine.documents import Document, tokenize
from ..engine.engine import QUESTION_RESERVE_TOKENS, Engine
from ..errors import BudgetError
from ..methods import Stage1Method, method_for, registry
from ..store.format import load_cache, save_cache
from .names import DEFAULT_METHODS, eval_methods
from .tasks import NEEDS_HAYSTACK_TEXT, TASKS, Sample, generate

OBSERVATIONS = ("tail", "probe", "wide")  # stage-1 observation windows compared by the ablation
FULL_TOKEN_BUDGET = 1 << 30  # a budget above any document: stage 1 keeps everything
REPORT_FORMAT = "rocketkv.eval"
REPORT_VERSION = 1
Progress = Callable[[int, int, str], None]  # (steps done, steps total, what is running)


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


def match_fraction(answer_text: str, expected: tuple[str, ...] | list[str]) -> float:
    """RULER's string_match_all: the fraction of expected values found in the answer as
    case-insensitive substrings (1.0 = all found). Raises ValueError when nothing is expected."""
    if not expected:
        raise ValueError("no expected values to match")
    text = answer_text.lower()
    return sum(value.lower() in text for value in expected) / len(expected)


def token_agreement(reference: tuple[int, ...] | list[int], tokens: tuple[int, ...] | list[int]) -> float:
    """Greedy-token agreement with full attention: the length of the common prefix of the two
    greedy answers over the longer one's length (1.0 = identical, 1.0 when both are empty). After
    the first differing token the two continuations see different text, so only the prefix counts."""
    longest = max(len(reference), len(tokens))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        same += 1
    return same / longest


def compress_variants(
    engine: Engine,
    document: Document,
    cfgs: list[PrefillConfig],
    progress: Callable[[int, int], None] = lambda done, total: None,
    storage: KVStorage = KVStorage(),
) -> list[CompressedKVCache]:
    """`Engine.ingest` for several stage-1 configs from one exact prefill of the document.

    The configs may differ in budgets, window size, observation, pool kernel and selection, not
    in `chunk_tokens` (the prefill itself): the widest window's queries are captured once, the
    probe text is prefilled after the document if any config uses it, and `Engine.compress`
    gives each config its cache (equal to its own `Engine.ingest`; tested).
    Raises:
        ValueError: configs with different chunk_tokens. BudgetError: as `Engine.ingest`.
    """
    if len({c.chunk_tokens for c in cfgs}) != 1:
        raise ValueError(f"configs must share chunk_tokens, got {sorted({c.chunk_tokens for c in cfgs})}")
    doc_ids = engine.document_ids(document)
    n = len(doc_ids)
    limit = engine.shape.max_context_tokens - max(c.max_new_tokens for c in cfgs) - QUESTION_RESERVE_TOKENS
    if n > limit:
        raise BudgetError(f"document is {n} tokens; this model's context fits {limit}", "use shorter documents")
    window = max(c.window_size for c in cfgs)
    captures = {method_for(c).capture for c in cfgs}  # what the configs' stage-1 methods need captured
    probe, reconstruct = "probe" in captures, "reconstruct" in captures
    prefill = engine.prefill(doc_ids, window, probe, cfgs[0].chunk_tokens, progress, reconstruct)
    return [engine.compress(prefill, c, document.sha256, document.source, storage=storage) for c in cfgs]


def run_eval(
    engine: Engine,
    cfg: EvalConfig,
    workdir: Path,
    haystack_text: str | None = None,
    progress: Progress = lambda done, total, what: None,
) -> dict:
    """Run every method of `cfg` on every sample, through saved `.kv` files in `workdir`.

    Returns the report: {"format", "format_version", "config", "model", "summary", "samples",
    "records", "elapsed_s"}; each record is one question answered by one method at one budget;
    `samples` has each sample's shared prefill + pruning time and its cache save/load time (s).
    Raises:
        ValueError: a task needing haystack text without it. BudgetError: a length the model's
        context does not fit. OutputError: `workdir` not writable.
    """
    if cfg.kv_dtype is None:  # the report records the storage used
        cfg = dataclasses.replace(cfg, kv_dtype=default_kv_dtype(engine.loaded.model_id))
    tasks = [t for t in cfg.tasks if haystack_text is not None or t not in NEEDS_HAYSTACK_TEXT]
    if len(tasks) != len(cfg.tasks):
        raise ValueError(f"tasks {', '.join(NEEDS_HAYSTACK_TEXT)} need a haystack text")
    room = engine.shape.max_context_tokens - cfg.plan_new_tokens - QUESTION_RESERVE_TOKENS - 64
    if max(cfg.context_tokens) > room:
        raise BudgetError(f"--context-tokens {max(cfg.context_tokens)} exceeds what {engine.loaded.model_id} fits "
                          f"({room} tokens with room for the framing, a question and the answer)",
                          "use shorter --context-tokens")  # fmt: skip
    caches, runs = plan(cfg)
    count = lambda text: len(tokenize(engine.tokenizer, text, False))  # noqa: E731
    total = len(cfg.context_tokens) * len(tasks) * cfg.samples * (len(caches) + len(runs))
    done, t0, records, samples = 0, time.perf_counter(), [], []
    for n in cfg.context_tokens:
        for task in tasks:
            for index in range(cfg.samples):
                sample = generate(task, index, cfg.seed, n, count, haystack_text)
                what = f"{task} #{index + 1}/{cfg.samples} at {n} tokens"

                def step(label: str) -> None:
                    nonlocal done
                    progress(done, total, f"{what}: {label}")
                    done += 1

                progress(done, total, f"{what}: prefill")
                sample_records, timing = _run_sample(engine, cfg, sample, n, caches, runs, workdir, step)
                records += sample_records
                samples.append(timing)
    progress(done, total, "done")
    return {
        "format": REPORT_FORMAT,
        "format_version": REPORT_VERSION,
        "config": cfg.to_dict() | {"tasks": tasks},
        "model": {
            "model_id": engine.loaded.model_id,
            "model_digest": engine.identity.model_digest,
            "device": str(engine.loaded.device),
            "dtype": str(engine.loaded.dtype).removeprefix("torch."),
            "prompt_template_id": engine.prompt.template_id,
            "head_dim": engine.shape.head_dim,
            "n_kv_heads": engine.shape.n_kv_heads,
            "max_context_tokens": engine.shape.max_context_tokens,
            "layer_windows": [s.sliding_window for s in engine.shape.layers],
        },  # fmt: skip
        "summary": summarize(records),
        "samples": samples,
        "records": records,
        "elapsed_s": round(time.perf_counter() - t0, 3),
    }


def _run_sample(engine, cfg, sample: Sample, n: int, caches: dict, runs: list, workdir: Path, step) -> tuple:
    """Prefill the sample once, save and load each cache, answer every run from its file.

    Returns (records, timing): the sample's records and its shared prefill + pruning and cache
    save/load times in seconds. `step(label)` is called once per cache and once per run."""
    doc = Document(sample.document, hashlib.sha256(sample.document.encode()).hexdigest(),
                   f"eval-{sample.task}-{sample.index}")  # fmt: skip
    t0 = time.perf_counter()
    stored = dict(
        zip(
            caches,
            compress_variants(
                engine,
                doc,
                list(caches.values()),
                storage=KVStorage.parse(cfg.kv_dtype or default_kv_dtype(engine.loaded.model_id)),
            ),
        )
    )
    prefill_s, io_s, records = time.perf_counter() - t0, 0.0, []
    reference: dict = {}  # question index → full attention's answer, filled by the `full` run (first)
    for key in caches:
        step(f"cache {key}")
    for key, cache in stored.items():
        t_io = time.perf_counter()
        path = save_cache(cache, workdir / f"{key}.kv", force=True)
        loaded = load_cache(path)
        if not isinstance(loaded, CompressedKVCache):
            raise BudgetError(f"{path}: eval documents fit one segment")
        engine.check(loaded, str(path))
        io_s += time.perf_counter() - t_io
        for run in (r for r in runs if r.cache_key == key):
            step(run.label + (f" t={run.budget}" if run.budget else ""))
            records += _answer_run(engine, loaded, run, sample, n, cfg, reference)
    _agree(records)
    timing = {"context_tokens": n, "n_context_tokens": next(iter(stored.values())).n_context_tokens,
              "task": sample.task, "sample": sample.index, "n_caches": len(caches), "prefill_s": round(prefill_s, 3),
              "save_load_s": round(io_s, 3), "total_s": round(time.perf_counter() - t0, 3)}  # fmt: skip
    return records, timing


def _answer_run(engine: Engine, stored: CompressedKVCache, run: Run, sample: Sample, n: int, cfg: EvalConfig,
                reference: dict) -> list:  # fmt: skip
    """Answer the sample's questions with one run; one record per question.

    `reference` (question index → the full-attention answer and its teacher-forced log-probs) is
    filled by the `full` run, which runs first. Every other run scores that answer teacher-forced
    in one forward over its own cache (`Decoder.score`: stage 2 exactly as decode applies it):
    top-1 agreement per answer token, KL(full ‖ run) per position, the answer's log-probability.
    When it agrees at every token (and on stopping), its greedy answer is the reference's; only
    otherwise is it generated, for the substring score. Times in seconds: `prefill_s`/`decode_s`
    the answer's (for a reference answer taken over, its scoring time and 0), `score_s` the
    teacher-forced scoring's (None for the `full` run, which is not scored)."""
    n_ctx = stored.n_context_tokens
    if run.method == "hsa" and run.budget is not None:
        decode = decode_config_for(stored, True, **stage2_only_budgets(n_ctx, cfg.plan_new_tokens, run.budget,
                                                                         engine.shape.head_dim))  # fmt: skip
    else:
        exact = run.method in ("full", "snapkv") or getattr(registry().get(run.method), "eval_exact", False)
        sparse = cfg.stage2 == "hsa" and not exact
        decode = decode_config_for(stored, sparse=sparse)
    max_new = cfg.max_new_tokens or sample.max_new_tokens
    full_kept = [lay.n_kept_tokens for lay, s in zip(stored.layers, engine.shape.layers) if s.sliding_window is None]
    stored_tokens = round(sum(full_kept) / len(full_kept))  # per layer and KV head (adaptive budgets: the mean)
    reselects = run.method.endswith("reselect")
    kept = min(stored_tokens, stored.info.budgets.prompt_budget) if reselects else stored_tokens
    prepared = prepare_questions(engine, stored, [q.text for q in sample.questions], max_new)
    decoder = Decoder(engine, stored, max(QUESTION_RESERVE_TOKENS, max(len(i) for _, i in prepared)) + max_new + 2,
                      decode)  # fmt: skip
    out = []
    for qi, (question, (text, ids)) in enumerate(zip(sample.questions, prepared)):
        forced: dict = {"top1_agreement": None, "kl": None, "ref_logprob": None, "generated": True}
        ref = reference.get(qi)
        ans, score_s = None, None
        if ref is not None and run.method != "full":
            t0 = time.perf_counter()
            forced, same = _teacher_forced(engine, decoder, ids, ref)
            score_s = time.perf_counter() - t0
            if same:  # its greedy answer is the reference's; the time is its teacher-forced scoring
                ans = dataclasses.replace(ref["answer"], prefill_s=score_s, decode_s=0.0)
        if ans is None:
            ans = generate_answer(engine, decoder, text, ids, max_new, engine.prompt.stop_strings)
            decoder.reset()
            if run.method == "full":
                reference[qi] = {"answer": ans, "logp": _logp(decoder, ids, list(ans.token_ids))}
        score = match_fraction(ans.text, question.expected)
        out.append({
            "context_tokens": n, "n_context_tokens": n_ctx, "task": sample.task, "sample": sample.index,
            "seed": sample.seed, "question_index": qi, "question": question.text, "expected": list(question.expected),
            "needle_depths": list(question.depths), "method": run.method, "label": run.label, "budget": run.budget,
            "observation": run.observation,
            "pool_kernel": None if run.pool_kernel is None else pool_label(run.pool_kernel),
            "kept_tokens": kept, "stored_tokens": stored_tokens, "sparse": decode.sparse, "topk": decode.topk,
            "page_size": decode.page_size,
            "n_score_dims": decode.n_score_dims, "answer": ans.text, "token_ids": list(ans.token_ids),
            "n_answer_tokens": ans.n_answer_tokens, "stop_reason": ans.stop_reason, "score": score,
            "correct": score == 1.0, "agreement": None, **forced, "prefill_s": round(ans.prefill_s, 4),
            "decode_s": round(ans.decode_s, 4), "score_s": None if score_s is None else round(score_s, 4),
        })  # fmt: skip
    return out


def _logp(decoder: Decoder, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities `[len(tokens) + 1, V]` float32 of `tokens` after `ids`
    (the last row: the position after the answer, where it stopped)."""
    logits = decoder.score(ids, tokens + [0])  # the appended token only makes room for the last row
    decoder.reset()
    return torch.log_softmax(logits, dim=-1)


def _teacher_forced(engine: Engine, decoder: Decoder, ids: list[int], ref: dict) -> tuple[dict, bool]:
    """Scores of the reference answer under this run's cache, and whether its greedy output is the
    reference answer itself (every token, and the stop, the same)."""
    tokens = list(ref["answer"].token_ids)
    logp = _logp(decoder, ids, tokens)  # [m + 1, V]
    ref_logp = ref["logp"]
    m = len(tokens)
    greedy = logp.argmax(dim=-1).tolist()
    same_tokens = [greedy[j] == tokens[j] for j in range(m)]
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)  # [m + 1]
    stop_ok = ref["answer"].stop_reason != "eos" or greedy[m] in engine.stop_ids
    forced = {
        "top1_agreement": sum(same_tokens) / m if m else 1.0,
        "kl": float(kl[: m + 1].mean()),
        "ref_logprob": float(sum(logp[j, tokens[j]] for j in range(m))) if m else 0.0,
        "generated": not (all(same_tokens) and stop_ok),
    }
    return forced, not forced["generated"]


def _agree(sample_records: list[dict]) -> None:
    """Fill in each record's agreement with the full-attention answer to the same question."""
    reference = {r["question_index"]: r["token_ids"] for r in sample_records if r["method"] == "full"}
    if not reference:
        return
    for r in sample_records:
        r["agreement"] = token_agreement(reference[r["question_index"]], r["token_ids"])


def _stats(rs: list[dict]) -> dict:
    """Means with 95% intervals of one group of records (fractions in [0, 1]; KL in nats)."""
    from .stats import bootstrap_mean, wilson

    scores = [r["score"] for r in rs]
    correct = sum(bool(r["correct"]) for r in rs)
    out = {"score": sum(scores) / len(scores), "score_ci": bootstrap_mean(scores),
           "correct_rate": correct / len(rs), "correct_ci": wilson(correct, len(rs)), "n": len(rs)}  # fmt: skip
    for key in ("agreement", "top1_agreement", "kl", "ref_logprob"):
        vals = [r[key] for r in rs if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
        if key in ("top1_agreement", "kl"):
            out[f"{key}_ci"] = bootstrap_mean(vals) if vals else None
    out["generated"] = sum(bool(r.get("generated", True)) for r in rs) / len(rs)
    return out


def summarize(records: list[dict]) -> list[dict]:
    """Per (context, task, method label, budget): mean score (share of expected values found) with
    a bootstrap interval, the rate of fully correct answers with a Wilson interval, greedy and
    teacher-forced top-1 agreement with full attention, KL(full ‖ method) per answer token, the
    reference answer's log-probability; plus a "mean" task row per (context, label, budget) over
    all its records. Intervals are 95%."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["context_tokens"], r["task"], r["label"], r["budget"])].append(r)
        groups[(r["context_tokens"], "mean", r["label"], r["budget"])].append(r)
    rows = []
    for (n, task, label, budget), rs in groups.items():
        first = rs[0]
        rows.append({"context_tokens": n, "task": task, "label": label, "method": first["method"],
                     "budget": budget, "observation": first["observation"], "pool_kernel": first["pool_kernel"],
                     **_stats(rs)})  # fmt: skip
    return rows
