"""`rocketkv eval`: full attention vs rocketkv vs baselines on RULER-style tasks (docs/accuracy.md).

Every method answers through the saved-file path the CLI uses: its cache is written with
`store.format.save_cache`, read back with `load_cache`, checked with `Engine.check` and answered
with `engine.answer.answer` (the code `rocketkv ask` runs). The document is prefilled once per
sample (`Engine.prefill`) and compressed for every method's stage-1 settings (`Engine.compress`,
through the same stage-1 methods and kernel dispatch as `ingest`). No printing here: progress goes
through a callback.

Methods: `eval/plan.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.cache import CompressedKVCache
from ..core.config import PrefillConfig, default_kv_dtype
from ..core.quant import KVStorage
from ..engine.answer import decode_config_for, prepare_questions
from ..engine.answer import generate as generate_answer
from ..engine.decoder import Decoder
from ..engine.engine import QUESTION_RESERVE_TOKENS, Engine
from ..engine.inputs import Document, tokenize
from ..errors import BudgetError
from ..methods import method_for, registry
from ..store.format import load_cache, save_cache
from .plan import EvalConfig, Run, plan, pool_label, stage2_only_budgets
from .tasks import NEEDS_HAYSTACK_TEXT, Sample, generate

REPORT_FORMAT = "rocketkv.eval"
REPORT_VERSION = 1
Progress = Callable[[int, int, str], None]  # (steps done, steps total, what is running)


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
