"""Answering questions from a compressed cache: the greedy loop over a `Decoder`, and `Answer`.

Per question (RocketKV §3.4; docs/algorithm.md): prefill its framed tokens exactly over the
stored cache at positions n, n+1, …, decode one token at a time with HSA, stop at an EOS id, a
stop string or a greedy loop, then drop the question's tail. Questions are independent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..core.cache import CompressedKVCache
from ..core.config import DecodeConfig
from ..errors import BudgetError, InputError
from .engine import QUESTION_RESERVE_TOKENS, Decoder, Engine


@dataclass(frozen=True)
class Answer:
    """One answer. Times in seconds; token counts in tokens.

    stop_reason: "eos", "stop_string", "repetition" (greedy output that started looping is cut)
    or "length". segments: for a segmented cache, the segments it was answered from.
    """

    question: str
    text: str
    n_question_tokens: int
    n_answer_tokens: int
    stop_reason: str
    token_ids: tuple[int, ...]  # generated tokens (stop token excluded)
    prefill_s: float
    decode_s: float
    segments: tuple[int, ...] | None = None

    def to_dict(self, cache: str) -> dict:
        """The `ask --json` record (stable keys; `segments` only for segmented caches)."""
        row = {"question": self.question, "answer": self.text, "cache": cache,
               "n_question_tokens": self.n_question_tokens, "n_answer_tokens": self.n_answer_tokens,
               "stop_reason": self.stop_reason, "prefill_s": round(self.prefill_s, 4),
               "decode_s": round(self.decode_s, 4)}  # fmt: skip
        if self.segments is not None:
            row["segments"] = list(self.segments)
        return row


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


# Below this many tokens in a layer, exact attention is faster than HSA on this device (page scoring,
# top-k and gather cost more than reading every key): measured by `rocketkv bench`
# (docs/performance.md, "Where stage 2 pays"). `ask --hsa` uses HSA anyway.
HSA_MIN_TOKENS = {"cpu": 0, "cuda": 0}


def hsa_min_tokens(device_type: str) -> int:
    """The measured HSA crossover for a device type (tokens per layer and KV head)."""
    return HSA_MIN_TOKENS.get(device_type, 0)


def decode_config_for(cache: CompressedKVCache, sparse: bool = True, **overrides: int | None) -> DecodeConfig:
    """Stage-2 settings from the cache's budgets, with explicit overrides (None = keep).

    Raises ValueError: overrides that do not make a valid `DecodeConfig`."""
    b = cache.info.budgets
    vals = {"topk": b.topk, "page_size": b.page_size, "n_score_dims": b.n_score_dims}
    vals.update({k: v for k, v in overrides.items() if v is not None})
    vals["n_score_dims"] = min(vals["n_score_dims"], cache.info.identity.head_dim)
    return DecodeConfig(sparse=sparse, **vals)


def prepare_questions(
    engine: Engine, cache: CompressedKVCache, questions: Iterable[str], max_new_tokens: int
) -> list[tuple[str, list[int]]]:
    """Each question with its framed token ids, checked against the room left after the document.

    Raises:
        InputError: an empty question. BudgetError: a question that does not fit the context.
    """
    room = engine.shape.max_context_tokens - cache.n_context_tokens - max_new_tokens
    prepared = []
    for question in questions:
        if not question.strip():
            raise InputError("empty question", "give a question with text")
        ids = engine.question_ids(question)
        if len(ids) > room:
            raise BudgetError(
                f"question is {len(ids)} tokens; only {max(room, 0)} fit after the document and the answer",
                "shorten the question or lower --max-new-tokens",
            )
        prepared.append((question, ids))
    return prepared


def answer(
    engine: Engine,
    cache: CompressedKVCache,
    questions: Iterable[str],
    max_new_tokens: int,
    decode: DecodeConfig | None,
    stop_strings: tuple[str, ...] | None = None,
) -> Iterator[Answer]:
    """Answer each question from `cache`, independently (greedy).

    decode: stage-2 settings (None = exact attention). stop_strings: None = the prompt's.
    All questions are checked before any is answered; the model's buffers are sized once.
    Raises:
        InputError: an empty question. BudgetError: a question that does not fit the context.
    """
    prepared = prepare_questions(engine, cache, questions, max_new_tokens)
    longest = max((len(ids) for _, ids in prepared), default=0)
    decoder = Decoder(engine, cache, max(QUESTION_RESERVE_TOKENS, longest) + max_new_tokens, decode)
    stops = engine.prompt.stop_strings if stop_strings is None else stop_strings
    for question, ids in prepared:
        try:
            yield generate(engine, decoder, question, ids, max_new_tokens, stops)
        finally:
            decoder.reset()


def generate(
    engine: Engine, decoder: Decoder, question: str, ids: list[int], max_new_tokens: int, stops: tuple[str, ...]
) -> Answer:
    """Greedy answer to one framed question `ids` from `decoder`'s current state."""
    t0 = time.perf_counter()
    out: list[int] = []
    reason = "length"
    with decoder.attention():
        logits = decoder.prefill(ids)
        t1 = time.perf_counter()
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
            if stops and any(s in engine.tokenizer.decode(out, skip_special_tokens=True).lstrip() for s in stops):
                reason = "stop_string"
                break
            if len(out) == max_new_tokens:
                break
            logits = decoder.decode_one_token(token)
    text = engine.tokenizer.decode(out, skip_special_tokens=True).lstrip()
    for s in stops:
        text = text.split(s)[0]
    return Answer(
        question=question, text=text.strip(), n_question_tokens=len(ids), n_answer_tokens=len(out),
        stop_reason=reason, token_ids=tuple(out), prefill_s=t1 - t0, decode_s=time.perf_counter() - t1,
    )  # fmt: skip
