"""Answering questions from a compressed cache: the decode loop over a `Decoder`, and `Answer`.

Per question (RocketKV §3.4; docs/algorithm.md §4): prefill its framed tokens exactly over the
stored cache at positions n, n+1, …, decode one token at a time with HSA (greedy, or sampled
with `Sampling`), stop at an EOS id, a stop string or a loop (`stopping.py`), then drop the
question's tail. Questions are independent. `Answerer` keeps one `Decoder` for any number of
questions (the interactive `chat`); `stream_answer` yields the answer's text as it becomes final.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.cache import CompressedKVCache
from ..core.config import DecodeConfig
from ..errors import BudgetError, UsageError
from ..model.hf import AttentionMass, attention_mass
from .attribution import Citer, baseline_mass, token_scores
from .decoder import Decoder
from .engine import QUESTION_RESERVE_TOKENS, Engine
from .inputs import check_questions, overflow_error
from .stopping import ANSWER_ECHO, AnswerTokens

__all__ = ["Answer", "Answerer", "KeptAnswerer", "Sampling", "answer", "decode_config_for", "drain", "generate"]

TextCallback = Callable[[str], None]


@dataclass(frozen=True)
class Sampling:
    """How each answer token is chosen. temperature 0 (the default) is greedy decoding: exact and
    deterministic. temperature > 0 samples from softmax(logits / temperature), restricted to the
    smallest set of most likely tokens whose probability reaches `top_p` (nucleus sampling).
    seed: the sampler's seed, reset for every question (an answer depends only on the cache, the
    question and the seed, never on the order of questions); None = a fresh random seed per
    answer, reported in `Answer.sampling`.
    Raises:
        ValueError: temperature < 0 or not finite, top_p outside (0, 1], a negative seed.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number ≥ 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}


GREEDY = Sampling()


@dataclass(frozen=True)
class Answer:
    """One answer. Times in seconds; token counts in tokens.

    stop_reason: "eos", "stop_string", "repetition" (output that started looping is cut) or
    "length". segments: for a segmented cache, the segments it was answered from. sampling: the
    sampling settings with the seed used (None = greedy). citations: the passages of the source
    the answer drew on most, best first (`api.citations.Citation`s, made by the `Citer` the
    answer loop was given; None unless asked for).
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
    sampling: Sampling | None = None
    citations: tuple[Any, ...] | None = None
    n_decoded_tokens: int | None = None  # tokens decoded, those cut (a loop's repeat, a stop string) included

    def to_dict(self, cache: str | os.PathLike) -> dict:
        """The `ask --json` record (stable keys; `segments` only for segmented caches, `sampling`
        only when sampled, `n_decoded_tokens` only when some decoded tokens were cut). cache: the
        path of the cache file answered from (its `cache` key). Raises UsageError: anything else as
        `cache` (an opened cache object would make a record that is no JSON)."""
        if not isinstance(cache, (str, os.PathLike)):
            raise UsageError(f"cache must be the cache file's path (str or Path), got {type(cache).__name__}",
                             "pass the path you opened, e.g. answer.to_dict(cache='doc.kv')")  # fmt: skip
        cache = os.fspath(cache)
        row = {"question": self.question, "answer": self.text, "cache": cache,
               "n_question_tokens": self.n_question_tokens, "n_answer_tokens": self.n_answer_tokens,
               "stop_reason": self.stop_reason, "prefill_s": round(self.prefill_s, 4),
               "decode_s": round(self.decode_s, 4)}  # fmt: skip
        if self.n_decoded_tokens is not None and self.n_decoded_tokens != self.n_answer_tokens:
            row["n_decoded_tokens"] = self.n_decoded_tokens
        if self.segments is not None:
            row["segments"] = list(self.segments)
        if self.sampling is not None:
            row["sampling"] = self.sampling.to_dict()
        if self.citations is not None:
            row["citations"] = [c.to_dict() for c in self.citations]
        return row


# Up to this many stored tokens in a layer, exact attention is faster than HSA on this device (page
# scoring, top-k and gather cost more than reading every key): measured with `rocketkv bench
# --crossover` at the default budget (docs/performance.md, "Where stage 2 pays"): on CPU HSA wins from
# about 3K tokens (Gemma 3 270M) and 6K (SmolLM2); CUDA is not measured yet (0: HSA wherever the
# context holds more than topk). `ask --hsa` uses HSA anyway; `rocketkv eval` always measures both.
HSA_MIN_TOKENS = {"cpu": 4096, "cuda": 0}


def hsa_min_tokens(device_type: str) -> int:
    """The measured HSA crossover for a device type (tokens per layer and KV head)."""
    return HSA_MIN_TOKENS.get(device_type, 0)


def decode_config_for(cache: CompressedKVCache, sparse: bool = True, exact_working_set: int | None = 0,
                      **overrides: int | None) -> DecodeConfig:  # fmt: skip
    """Stage-2 settings from the cache's budgets, with explicit overrides (None = keep).

    exact_working_set: true (a flag typed as the other overrides) for a cache whose questions
    re-select their working set (a store budget): attend that working set exactly (HSA only above
    it), the answering mode docs/frontier.md measured, on every device; `ask --hsa` leaves it off.
    A `topk` override below the stored page size, without a `page_size` override, caps the page
    at `topk` (as `resolve_budgets` does at ingest). Raises ValueError: overrides that do not make
    a valid `DecodeConfig`."""
    for name, value in overrides.items():  # "5" from a caller would fail deep in a comparison
        if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    b = cache.info.budgets
    vals = {"topk": b.topk, "page_size": b.page_size, "n_score_dims": b.n_score_dims}
    vals.update({k: v for k, v in overrides.items() if v is not None})
    if overrides.get("page_size") is None:  # a --topk below the stored page: pages of topk tokens
        vals["page_size"] = min(vals["page_size"], vals["topk"])
    if exact_working_set and cache.info.config.store_budget is not None:
        vals["min_hsa_tokens"] = max(vals.get("min_hsa_tokens") or 0, b.prompt_budget)
    vals["n_score_dims"] = min(vals["n_score_dims"], cache.info.identity.head_dim)
    return DecodeConfig(sparse=sparse, **vals)


def prepare_questions(
    engine: Engine,
    cache: CompressedKVCache,
    questions: Iterable[str],
    max_new_tokens: int,
    numbered: tuple[int, int] | None = None,
) -> list[tuple[str, list[int]]]:
    """Each question with its framed token ids, checked against the room left after the document.
    numbered: (number of the first question, questions in all) for the error's "question 2 of 3",
    where the questions are checked one call at a time (default: these questions, from 1).

    Raises:
        InputError: an empty question. BudgetError: a question that does not fit the context.
    """
    context = engine.shape.max_context_tokens
    room = context - cache.n_context_tokens - max_new_tokens
    prepared, qs = [], list(questions)
    first, total = numbered or (1, len(qs))
    for i, question in enumerate(check_questions(qs) if qs else [], first):  # empty, not UTF-8: InputError
        ids = engine.question_ids(question)
        if room <= 0:  # no question could fit: the answer's length is what to change
            raise BudgetError(f"an answer of up to {max_new_tokens:,} tokens leaves no room for a question: the "
                              f"document holds {cache.n_context_tokens:,} of the model's {context:,}",
                              "lower --max-new-tokens")  # fmt: skip
        if len(ids) > room:
            raise BudgetError(
                f"{f'question {i} of {total}' if total > 1 else 'question'} is {len(ids):,} tokens; "
                f"only {max(room, 0):,} fit after the document and the answer",
                "shorten the question or lower --max-new-tokens",
            )
        prepared.append((question, ids))
    return prepared


def tail_tokens(question_tokens: int, max_new_tokens: int) -> int:
    """Room an `Answerer`'s decoder keeps after the stored context: the question (at least
    QUESTION_RESERVE_TOKENS) and the answer, in tokens."""
    return max(QUESTION_RESERVE_TOKENS, question_tokens) + max_new_tokens


class Answerer:
    """Answers questions one at a time from one cache with one `Decoder` (its static buffers are
    made once; a longer question grows the tail). Each answer starts from the stored context.

    decode: stage-2 settings (None = exact attention). stop_strings: None = the framing's.
    cite: turns each answer's attention scores into its citations (`attribution.py`; None = no
    citations, no attention captured; `api.citations.citer` builds one).
    """

    def __init__(
        self,
        engine: Engine,
        cache: CompressedKVCache,
        max_new_tokens: int,
        decode: DecodeConfig | None,
        stop_strings: tuple[str, ...] | None = None,
        sampling: Sampling = GREEDY,
        question_tokens: int = QUESTION_RESERVE_TOKENS,
        cite: Citer | None = None,
    ):
        self._baseline: AttentionMass | None = None
        self.engine, self.cache = engine, cache
        context = engine.shape.max_context_tokens
        if max_new_tokens >= context - cache.n_context_tokens:  # before buffers of that size (an overflow, or GBs)
            raise BudgetError(f"an answer of up to {max_new_tokens:,} tokens does not fit after the document: it "
                              f"holds {cache.n_context_tokens:,} of the model's {context:,}",
                              "lower --max-new-tokens")  # fmt: skip
        self.tail_tokens = tail_tokens(question_tokens, max_new_tokens)
        self.decoder = Decoder(engine, cache, self.tail_tokens, decode)
        cache.compact()  # the decoder holds its own copy: the float layers go, the verified codes stay
        self.configure(max_new_tokens, decode, stop_strings, sampling, cite)

    def configure(self, max_new_tokens: int, decode: DecodeConfig | None, stop_strings: tuple[str, ...] | None,
                  sampling: Sampling, cite: Citer | None) -> None:  # fmt: skip
        """The settings of the answers to come (as the constructor's); the buffers stay."""
        self.max_new_tokens, self.sampling, self.cite = max_new_tokens, sampling, cite
        self.stops = self.engine.prompt.stop_strings if stop_strings is None else stop_strings
        self.decoder.decode = decode

    def prepare(self, question: str) -> list[int]:
        """The framed ids of `question`. Raises InputError, BudgetError (see `prepare_questions`)."""
        return prepare_questions(self.engine, self.cache, [question], self.max_new_tokens)[0][1]

    def stream(self, question: str, ids: list[int] | None = None) -> Generator[str, None, Answer]:
        """Yield the answer's text in pieces as they become final; return the `Answer`.

        The pieces joined equal `Answer.text`. Closing the generator early (or an interrupt)
        abandons the answer; the decoder is back at the stored context either way.
        """
        ids = self.prepare(question) if ids is None else ids
        self.decoder.reset()  # from the stored context, whatever an earlier caller left in the tail
        steps = stream_answer(self.engine, self.decoder, question, ids, self.max_new_tokens, self.stops, self.sampling)
        try:
            if self.cite is None:
                return (yield from steps)
            with attention_mass(self.cache.n_context_tokens, self.engine.loaded.device) as mass:
                ans = yield from steps
            if self._baseline is None:  # once per cache: what a generic question attends to
                self._baseline = baseline_mass(self.engine, self.decoder, self.cache)
            scores, share = token_scores(mass, self._baseline)
            return dataclasses.replace(ans, citations=self.cite(scores, share))
        finally:
            self.decoder.reset()

    def ask(self, question: str, ids: list[int] | None = None, on_text: TextCallback | None = None) -> Answer:
        """The answer to `question`; `on_text(piece)` is called with each final piece of its text."""
        return drain(self.stream(question, ids), on_text)


class KeptAnswerer:
    """One `Answerer` kept from one call of `answer` to the next over the same cache object, so
    that its decode buffers and its prefilled question prefix (`Decoder.prefill`) are made once:
    a server answering request after request, a script calling `RocketKV.ask` in a loop. One call
    uses it at a time; a call that finds it busy (another thread) builds an `Answerer` of its own.
    Reuse changes no answer: each starts from the stored context (`Answerer.stream`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: Answerer | None = None

    @contextlib.contextmanager
    def use(self, engine: Engine, cache: CompressedKVCache, max_new_tokens: int, decode: DecodeConfig | None,
            stop_strings: tuple[str, ...] | None, sampling: Sampling, question_tokens: int,
            cite: Citer | None) -> Iterator[Answerer]:  # fmt: skip
        """An `Answerer` with these settings (as its constructor's) for the block."""
        if not self._lock.acquire(blocking=False):
            yield Answerer(engine, cache, max_new_tokens, decode, stop_strings, sampling, question_tokens, cite)
            return
        try:
            kept = self._kept
            tail = tail_tokens(question_tokens, max_new_tokens)
            if kept is None or kept.engine is not engine or kept.cache is not cache or kept.tail_tokens < tail:
                self._kept = kept = None  # the old buffers go before the new ones are made
                kept = self._kept = Answerer(engine, cache, max_new_tokens, decode, stop_strings, sampling,
                                             question_tokens, cite)  # fmt: skip
            else:
                kept.configure(max_new_tokens, decode, stop_strings, sampling, cite)
            yield kept
        finally:
            self._lock.release()

    def held_bytes(self) -> int:
        """Bytes of memory the kept `Answerer`'s decode buffers hold (0: none kept)."""
        kept = self._kept
        return 0 if kept is None else kept.decoder.cache.nbytes

    def release(self, caches: Iterable[CompressedKVCache] | None = None) -> None:
        """Drop the kept `Answerer` (only if it answers from one of `caches`, when given) unless in use."""
        if self._lock.acquire(blocking=False):
            try:
                if caches is None or (self._kept is not None and any(self._kept.cache is c for c in caches)):
                    self._kept = None
            finally:
                self._lock.release()


def answer(
    engine: Engine,
    cache: CompressedKVCache,
    questions: Iterable[str],
    max_new_tokens: int,
    decode: DecodeConfig | None,
    stop_strings: tuple[str, ...] | None = None,
    sampling: Sampling = GREEDY,
    on_text: TextCallback | None = None,
    cite: Citer | None = None,
    kept: KeptAnswerer | None = None,
) -> Iterator[Answer]:
    """Answer each question from `cache`, independently, in order.

    decode: stage-2 settings (None = exact attention). stop_strings: None = the prompt's.
    on_text: called with the pieces of the answer being decoded (see `Answerer.stream`).
    cite: each answer's citations from its attention scores (`Answer.citations`; see `Answerer`).
    kept: where an `Answerer` is kept between calls (None: one for this call).
    All questions are checked before any is answered; the model's buffers are sized once.
    Raises:
        InputError: an empty question. BudgetError: a question that does not fit the context.
    """
    prepared = prepare_questions(engine, cache, questions, max_new_tokens)
    longest = max((len(ids) for _, ids in prepared), default=0)
    settings = (engine, cache, max_new_tokens, decode, stop_strings, sampling, longest, cite)
    with kept.use(*settings) if kept is not None else contextlib.nullcontext(Answerer(*settings)) as answerer:
        for question, ids in prepared:
            yield answerer.ask(question, ids, on_text)


def generate(
    engine: Engine,
    decoder: Decoder,
    question: str,
    ids: list[int],
    max_new_tokens: int,
    stops: tuple[str, ...],
    sampling: Sampling = GREEDY,
    on_text: TextCallback | None = None,
) -> Answer:
    """The answer to one framed question `ids` from `decoder`'s current state (see `stream_answer`)."""
    return drain(stream_answer(engine, decoder, question, ids, max_new_tokens, stops, sampling), on_text)


def drain(steps: Generator[str, None, Answer], on_text: TextCallback | None) -> Answer:
    """Run `steps` to its `Answer`, passing each piece to `on_text`. If `on_text` raises, the
    generator is closed before the error leaves (its decoder is back at the stored context
    before anyone else can use it), not whenever the traceback is freed."""
    try:
        while True:
            try:
                piece = next(steps)
            except StopIteration as done:
                return done.value
            if on_text is not None:
                on_text(piece)
    finally:
        steps.close()


def stream_answer(
    engine: Engine,
    decoder: Decoder,
    question: str,
    ids: list[int],
    max_new_tokens: int,
    stops: tuple[str, ...],
    sampling: Sampling = GREEDY,
) -> Generator[str, None, Answer]:
    """Decode one answer, yielding its text in final pieces; returns the `Answer`.

    Each step: choose a token (`choose_token`; at the first step a token of blank lines is
    skipped when the framing's stop strings start a new line: the plain framing's answer follows
    its cue on the same line, and a line break there is the model ending the answer before
    writing it); stop at an EOS id, a stop string (`AnswerText.stop_at`) or a loop
    (`AnswerText.loop_cut`, which also cuts the loop's last copy) or `max_new_tokens`.
    """
    seed = None if sampling.greedy else (sampling.seed if sampling.seed is not None else secrets.randbits(63))
    rng = torch.Generator().manual_seed(seed) if seed is not None else None
    skip_blank = any(not s.strip() for s in stops)  # a blank first token would end the answer at once
    stops = stops + engine.prompt.echo_stops(question) + (ANSWER_ECHO,)
    decode_text = lambda tokens: engine.tokenizer.decode(tokens, skip_special_tokens=True)
    t0 = time.perf_counter()
    state = AnswerTokens(decode_text, stops)
    reason, decoded = "length", 0
    with decoder.attention():
        logits = decoder.prefill(ids)
        t1 = time.perf_counter()
        while len(state.tokens) < max_new_tokens:
            token = choose_token(logits, sampling, rng)
            while skip_blank and not state.tokens and _blank_line(decode_text([token])):
                logits = logits.clone()
                logits[0, token] = float("-inf")
                token = choose_token(logits, sampling, rng)
            if token in engine.stop_ids:
                reason = "eos"
                break
            decoded += 1
            stopped = state.add(token)
            if stopped is not None:
                reason = stopped
                break
            if piece := state.take_final():
                yield piece
                decoder.check_attending()  # another answer decoded while this one was paused: refused
            if len(state.tokens) == max_new_tokens:
                break
            logits = decoder.decode_one_token(token)
    state.finish(at_limit=reason == "length")
    if piece := state.take_final():
        yield piece
    out = state.tokens
    return Answer(
        question=question, text=state.text(), n_question_tokens=len(ids), n_answer_tokens=len(out),
        stop_reason=reason, token_ids=tuple(out), prefill_s=t1 - t0, decode_s=time.perf_counter() - t1,
        sampling=None if seed is None else Sampling(sampling.temperature, sampling.top_p, seed),
        n_decoded_tokens=decoded,
    )  # fmt: skip


def choose_token(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator | None) -> int:
    """The next token from logits `[1, V]`: the argmax when greedy; else a sample (on the CPU, in
    float64, so a seed gives the same tokens on any device) from the temperature-scaled softmax
    restricted to the top-p nucleus (the most likely tokens until their mass reaches top_p).
    Raises InputError (`inputs.overflow_error`): NaN logits, or no finite one (a model that
    overflowed its dtype: Gemma in float16), whose "answer" would be garbage that looks like one."""
    if sampling.greedy or rng is None:
        best = logits.max(dim=-1)  # argmax's first maximum; ~3× faster than argmax on a CPU
        token = int(best.indices)
        if not math.isfinite(float(best.values)):  # max propagates NaN
            raise overflow_error()
        return token
    scores = logits[0].detach().to("cpu", torch.float64)  # [V]
    if not math.isfinite(float(scores.max())):
        raise overflow_error()
    # shifted by the maximum before the division (softmax is unchanged by a shift): a temperature so
    # small that logit / temperature overflows (1e-320) still gives the argmax, not inf / inf = NaN
    probs = torch.softmax((scores - scores.max()) / sampling.temperature, dim=-1)  # [V]
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < sampling.top_p  # the mass before a token is below top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=rng))


def _blank_line(text: str) -> bool:
    return "\n" in text and not text.strip()
