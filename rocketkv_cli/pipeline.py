"""Orchestration: document → pruned KV cache (`prefill_document`), cache + questions → answers (`answer`).

No argument parsing or printing here; progress goes through a callback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import torch

from .cache_io import PrunedKVCache, check_compatible
from .config import DecodeConfig, PrefillConfig, auto_pool_kernel_size, resolve_budgets
from .errors import BudgetError, InputError
from .hf import ModelShape, RocketCache, RocketLayer, empty_cache, forward_tokens, model_shape, rocketkv_attention
from .ingest import Document, tokenize
from .models import LoadedModel, chat_template_digest, model_digest, stop_token_ids, tokenizer_digest
from .ops import observation_scores, snapkv_select
from .prefill import gather_tokens, sink_recent_select
from .templates import PromptFormat, prompt_format, read_prompt

QUESTION_RESERVE_TOKENS = 256  # room kept for a question when checking a document against the context
TokenProgress = Callable[[int, int], None]  # (tokens done, tokens total)


class Engine:
    """A loaded model plus what rocketkv derives from it once (shape, prompt format, digests)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.shape: ModelShape = model_shape(loaded.model)
        self.prompt: PromptFormat = prompt_format(loaded.tokenizer)
        self.stop_ids = stop_token_ids(loaded.model, loaded.tokenizer)

    @cached_property
    def identity(self) -> dict[str, str]:
        """Metadata that a cache must match to be used with this model."""
        return {
            "model_digest": model_digest(self.model, self.loaded.weights_digest),
            "tokenizer_digest": tokenizer_digest(self.tokenizer),
            "chat_template_digest": chat_template_digest(self.tokenizer),
            "prompt_template_id": self.prompt.template_id,
            "n_layers": str(len(self.shape.layers)),
            "n_kv_heads": str(self.shape.n_kv_heads),
            "head_dim": str(self.shape.head_dim),
            "layer_windows": json.dumps([s.sliding_window for s in self.shape.layers]),
        }

    def ids(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor([token_ids], dtype=torch.long, device=self.loaded.device)


def document_token_ids(engine: Engine, document: Document) -> list[int]:
    """Token ids of the framed document (template text before the document + the document)."""
    return tokenize(engine.tokenizer, engine.prompt.document_text(document.text), engine.prompt.add_special_tokens)


def context_limit(engine: Engine, max_new_tokens: int) -> int:
    """Most framed document tokens one prefill may hold: the model's context minus room for a
    question (QUESTION_RESERVE_TOKENS) and the answer. Raises BudgetError when nothing is left."""
    shape = engine.shape
    limit = shape.max_context_tokens - max_new_tokens - QUESTION_RESERVE_TOKENS
    if limit < 1:
        raise BudgetError(
            f"max_new_tokens {max_new_tokens} leaves no room in this model's {shape.max_context_tokens}-token context",
            "lower --max-new-tokens",
        )
    return limit


def prefill_document(
    engine: Engine,
    document: Document,
    cfg: PrefillConfig,
    progress: TokenProgress = lambda done, total: None,
) -> PrunedKVCache:
    """Prefill the framed document exactly, in chunks, then prune with SnapKV++ (SPEC §3.2).

    Returns:
        `PrunedKVCache`: full-attention layers keep `prompt_budget` tokens per KV head (all when the
        document is shorter), sliding-window layers their last `sliding_window` tokens.
    Raises:
        BudgetError: the document (plus room for a question and the answer) exceeds the context.
    """
    doc_ids = document_token_ids(engine, document)
    limit = context_limit(engine, cfg.max_new_tokens)
    if len(doc_ids) > limit:
        raise BudgetError(
            f"document is {len(doc_ids)} tokens; this model's context fits {limit} "
            "(after room for a question and answer)",
            "ingest it in segments: rocketkv ingest DOC (documents longer than the context are segmented)",
        )
    return prefill_ids(
        engine, doc_ids, cfg, {"document_sha256": document.sha256, "document_source": document.source}, progress
    )


def prefill_ids(
    engine: Engine,
    doc_ids: list[int],
    cfg: PrefillConfig,
    document_meta: dict[str, str],
    progress: TokenProgress = lambda done, total: None,
) -> PrunedKVCache:
    """Prefill framed document token ids `doc_ids` (RoPE positions 0 … n−1) and prune (SPEC §3.2).

    document_meta: metadata naming the document (`document_sha256`, `document_source`, …).
    The caller checks `doc_ids` against `context_limit`.
    Raises:
        BudgetError: the prompt budget falls below the observation window.
    """
    n = len(doc_ids)
    shape = engine.shape
    budgets = resolve_budgets(cfg, n, shape.head_dim)
    if n > budgets.prompt_budget and budgets.prompt_budget < cfg.window_size:
        raise BudgetError(
            f"token budget {cfg.token_budget} with max_new_tokens {cfg.max_new_tokens} leaves a prompt budget of "
            f"{budgets.prompt_budget} tokens, below the observation window ({cfg.window_size})",
            "raise --budget or lower --max-new-tokens",
        )
    probe_ids = []
    if cfg.observation == "probe":
        probe_ids = tokenize(engine.tokenizer, engine.prompt.question_text(read_prompt("probe.txt")), False)
    capture_from = max(0, n - cfg.window_size)
    cache = empty_cache(engine.model, shape, n + len(probe_ids))
    with rocketkv_attention(engine.model, cache, shape, capture_from=capture_from) as session:
        _prefill_chunks(engine, cache, doc_ids, 0, cfg.chunk_tokens, progress)
        sliding_kept = {i: cache.layers[i].view() for i, s in enumerate(shape.layers) if s.sliding_window}
        sliding_kept = {i: tuple(t.clone() for t in kv) for i, kv in sliding_kept.items()}
        if probe_ids:
            _prefill_chunks(engine, cache, probe_ids, n, cfg.chunk_tokens, lambda d, t: None)
    kernel = cfg.pool_kernel_size or auto_pool_kernel_size(n)
    layers = []
    for i, spec in enumerate(shape.layers):
        if spec.sliding_window is not None:
            k, v, p = sliding_kept[i]
            keep = min(spec.sliding_window, k.shape[2])
            layers.append(tuple(t[:, :, -keep:].contiguous() for t in (k, v, p)))
            continue
        keys, values, positions = cache.layers[i].view()  # [1, Hkv, n + probe, D]
        if n <= budgets.prompt_budget:
            layers.append(tuple(t[:, :, :n].contiguous() for t in (keys, values, positions)))
            continue
        if cfg.selection == "sink_recent":  # eval baseline: no scoring
            kept = sink_recent_select(n, budgets.prompt_budget, cfg.n_sink_tokens, keys.shape[1], keys.device)
            layers.append(tuple(gather_tokens(t[:, :, :n], kept) for t in (keys, values, positions)))
            continue
        queries = torch.cat(session.captured[i], dim=2)  # [1, H, W(+probe), D]
        q_pos = torch.arange(capture_from, n + len(probe_ids), device=keys.device)
        assert queries.shape[2] == q_pos.shape[0], (queries.shape, q_pos.shape)
        scores = observation_scores(queries, keys, q_pos, positions[0, 0], spec.scaling, spec.softcap)[..., :n]
        kept = snapkv_select(scores, budgets.prompt_budget, cfg.window_size, kernel)
        layers.append(tuple(gather_tokens(t[:, :, :n], kept) for t in (keys, values, positions)))
    metadata = dict(engine.identity)
    metadata.update(
        model_id=engine.loaded.model_id,
        dtype=str(engine.loaded.dtype).removeprefix("torch."),
        n_context_tokens=str(n),
        **document_meta,
        config=json.dumps(cfg.to_dict(), sort_keys=True),
        budgets=json.dumps(budgets.to_dict() | {"pool_kernel_size": kernel}, sort_keys=True),
    )
    return PrunedKVCache(layers=list(layers), metadata=metadata)


def _prefill_chunks(
    engine: Engine, cache: RocketCache, ids: list[int], start: int, chunk: int, progress: TokenProgress
) -> None:
    for offset in range(0, len(ids), chunk):
        piece = ids[offset : offset + chunk]
        forward_tokens(engine.model, cache, engine.ids(piece), start + offset)
        for layer, spec in zip(cache.layers, engine.shape.layers):
            if spec.sliding_window is not None:
                layer.keep_last(spec.sliding_window)
        progress(offset + len(piece), len(ids))


def repeated_tail(tokens: list[int], min_tokens: int = 24, max_period: int = 64) -> int:
    """Length of a loop at the end of greedy output, or 0.

    A loop is a period p ≤ max_period whose last span repeats the span before it, with the
    repeated span at least `min_tokens` long (so "very very" is not one). Returns the number of
    trailing tokens to drop (one copy of the repeated span).
    """
    n = len(tokens)
    for p in range(1, min(max_period, n // 2) + 1):
        span = p * max(1, -(-min_tokens // p))  # whole periods, ≥ min_tokens
        if 2 * span <= n and tokens[n - span :] == tokens[n - 2 * span : n - span]:
            return span
    return 0


@dataclass(frozen=True)
class Answer:
    """One answer. Times in seconds; token counts in tokens."""

    question: str
    text: str
    n_question_tokens: int
    n_answer_tokens: int
    stop_reason: str  # "eos", "stop_string", "repetition" or "length"
    token_ids: tuple[int, ...]  # generated tokens (stop token excluded)
    prefill_s: float
    decode_s: float


def decode_config_for(stored: PrunedKVCache, sparse: bool = True, **overrides: int | None) -> DecodeConfig:
    """Stage-2 settings from the cache's budgets, with explicit overrides (None = keep)."""
    b = json.loads(stored.metadata["budgets"])
    vals = {k: b[k] for k in ("topk", "page_size", "n_score_dims")}
    vals.update({k: v for k, v in overrides.items() if v is not None})
    vals["n_score_dims"] = min(vals["n_score_dims"], int(stored.metadata["head_dim"]))
    return DecodeConfig(sparse=sparse, **vals)


def open_cache(engine: Engine, stored: PrunedKVCache, path: str) -> None:
    """Check that `stored` was built for this engine's model (raises CacheFormatError)."""
    rebuild = (
        f"rebuild it with: rocketkv ingest {stored.metadata.get('document_source', 'DOC')} -o {path} "
        f"--model {engine.loaded.model_id} --force"
    )
    check_compatible(stored, engine.identity, path, rebuild)


def to_rocket_cache(engine: Engine, stored: PrunedKVCache, extra_tokens: int) -> RocketCache:
    """A `RocketCache` over `stored` on the model's device/dtype, with room for `extra_tokens`."""
    dev, dtype = engine.loaded.device, engine.loaded.dtype
    layers = [RocketLayer(k.to(dev, dtype), v.to(dev, dtype), p.to(dev), extra_tokens) for k, v, p in stored.layers]
    return RocketCache(layers)


def prepare_questions(
    engine: Engine, stored: PrunedKVCache, questions: Iterable[str], max_new_tokens: int
) -> list[tuple[str, list[int]]]:
    """Each question with its framed token ids, checked against the room left after the document.

    Raises:
        InputError: an empty question. BudgetError: a question that does not fit the context.
    """
    room = engine.shape.max_context_tokens - stored.n_context_tokens - max_new_tokens
    prepared = []
    for question in questions:
        if not question.strip():
            raise InputError("empty question", "give a question with text")
        ids = tokenize(engine.tokenizer, engine.prompt.question_text(question), False)
        if len(ids) > room:
            raise BudgetError(
                f"question is {len(ids)} tokens; only {max(room, 0)} fit after the document and the answer",
                "shorten the question or lower --max-new-tokens",
            )
        prepared.append((question, ids))
    return prepared


def answer(
    engine: Engine,
    stored: PrunedKVCache,
    questions: Iterable[str],
    max_new_tokens: int,
    decode: DecodeConfig | None,
) -> Iterator[Answer]:
    """Answer each question from the stored cache, independently (SPEC §3.4).

    Per question: prefill its tokens exactly over the stored cache at positions n, n+1, …, then
    decode greedily with HSA (`decode`; None = exact attention), then drop the question's tail.
    Raises:
        InputError: an empty question. BudgetError: a question that does not fit the context.
    """
    n_ctx = stored.n_context_tokens
    prepared = prepare_questions(engine, stored, questions, max_new_tokens)  # all checked before any is answered
    cache = to_rocket_cache(engine, stored, QUESTION_RESERVE_TOKENS + max_new_tokens)
    for question, ids in prepared:
        try:
            yield _answer_one(engine, cache, question, ids, n_ctx, max_new_tokens, decode)
        finally:
            cache.crop_to_context()


def _answer_one(engine, cache, question, ids, n_ctx, max_new_tokens, decode) -> Answer:
    t0 = time.perf_counter()
    out: list[int] = []
    reason = "length"
    with rocketkv_attention(engine.model, cache, engine.shape, decode=decode):
        logits = forward_tokens(engine.model, cache, engine.ids(ids), n_ctx)
        t1 = time.perf_counter()
        position = n_ctx + len(ids)
        while len(out) < max_new_tokens:
            token = int(logits.argmax(dim=-1))
            if token in engine.stop_ids:
                reason = "eos"
                break
            out.append(token)
            loop = repeated_tail(out)
            if loop:
                del out[len(out) - loop :]
                reason = "repetition"
                break
            stops = engine.prompt.stop_strings
            if stops and any(s in engine.tokenizer.decode(out, skip_special_tokens=True).lstrip() for s in stops):
                reason = "stop_string"
                break
            if len(out) == max_new_tokens:
                break
            logits = forward_tokens(engine.model, cache, engine.ids([token]), position)
            position += 1
    text = engine.tokenizer.decode(out, skip_special_tokens=True).lstrip()
    for s in engine.prompt.stop_strings:
        text = text.split(s)[0]
    return Answer(
        question=question,
        text=text.strip(),
        n_question_tokens=len(ids),
        n_answer_tokens=len(out),
        stop_reason=reason,
        token_ids=tuple(out),
        prefill_s=t1 - t0,
        decode_s=time.perf_counter() - t1,
    )
