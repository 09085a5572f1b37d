"""The decode side of the engine: `Decoder(engine, cache, …)` holds static KV buffers over one
compressed cache (the stored context followed by a preallocated per-question tail) and the two
verbs of the field, `prefill(question ids)` and `decode_one_token(token)`, at explicit RoPE
positions n, n+1, …; `reset()` goes back to the stored context. A cache stored with a store
budget (`ingest --store-budget`) gets per-question re-selection (`methods/reselect.py`).

No argument parsing or printing here.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..core.cache import CompressedKVCache
from ..core.config import DecodeConfig
from ..errors import UsageError
from ..methods.reselect import Reselection, reselection_for
from ..model.hf import (
    RocketCache,
    RocketLayer,
    active_attention_mass,
    attending,
    attention_mass_paused,
    forward_tokens,
    rocketkv_attention,
)
from ..model.weights import decode_step
from .inputs import overflow_error

if TYPE_CHECKING:
    from .engine import Engine


QUESTION_CHUNK_TOKENS = 1024
"""A question's prefill runs in forwards of at most this many tokens (as a document's does):
its attention over its own tokens stays linear in its length and an interrupt is honoured within
a chunk. Questions this short or shorter run in one forward."""

PrefillProgress = Callable[[int, int], None]
_PROGRESS: contextvars.ContextVar[PrefillProgress | None] = contextvars.ContextVar("rocketkv_progress", default=None)


@contextlib.contextmanager
def question_progress(callback: PrefillProgress) -> Iterator[None]:
    """Inside the block, a prefill of more than `QUESTION_CHUNK_TOKENS` ids (a long question)
    calls `callback(done, total)`, in tokens: (0, total) before its first chunk, then after each.
    The callback may raise (an interrupt, a request whose client left) to abandon the prefill
    between chunks; the answer's decoder is reset as after any error (`Answerer.stream`)."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


class Decoder:
    """Answering state over one compressed cache: static KV buffers holding the stored context
    followed by a preallocated tail of `tail_tokens` (question + answer), and the two verbs.

    `prefill(ids)` runs a question's tokens with exact attention over context + themselves at
    positions n, n+1, …; `decode_one_token(token)` runs one generated token at the next position
    with stage-2 HSA (`decode`; None = exact attention). `reset()` drops the tail: the stored
    context is never written, so one question cannot change another's answer.
    """

    def __init__(
        self,
        engine: Engine,
        cache: CompressedKVCache,
        tail_tokens: int,
        decode: DecodeConfig | None,
        reselect: bool = True,
    ):
        dev, dtype = engine.loaded.device, engine.loaded.dtype
        layers = [RocketLayer(layer.keys.to(dev, dtype), layer.values.to(dev, dtype), layer.positions.to(dev),
                              tail_tokens) for layer in cache.layers]  # fmt: skip
        self.engine, self.decode = engine, decode
        self.reselection = reselection_for(cache) if reselect else None
        self.cache = RocketCache(layers)
        self.n_context_tokens = cache.n_context_tokens
        self.position = self.n_context_tokens  # RoPE position of the next token
        # the question prefix every framed question starts with: prefilled once, its keys and values kept
        # at the head of the tail (`reset` keeps them) and its re-selection scores here
        self.prefix = engine.question_prefix
        self._prefix_scores: dict[int, torch.Tensor] | None = None  # set while the tail holds the prefix
        self._base = self.n_context_tokens  # position of a question's first token after `reset`
        self._token = torch.zeros(1, 1, dtype=torch.long, device=dev)  # [1, 1] static input
        self._position = torch.zeros(1, dtype=torch.long, device=dev)  # [1]
        self._session: Any = None  # `rocketkv_attention`'s session while inside `attention()`

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """rocketkv's attention over this decoder's cache (around a question's prefill + decode)."""
        with rocketkv_attention(self.engine.model, self.cache, self.engine.shape, decode=self.decode) as session:
            self._session = session
            try:
                yield
            finally:
                self._session = None

    def check_attending(self) -> None:
        """After a pause inside `attention()` (an answer's generator resumed): raise UsageError when
        another answer on this model was decoded meanwhile, which replaced this one's attention
        session (its steps would attend over the other's cache: a wrong answer, or a crash)."""
        if self._session is not None and not attending(self.engine.model, self._session):
            raise UsageError("two answers were decoded in turn on one model (a stream read while another was "
                             "paused): each would attend over the other's cache",
                             "read each stream to its end before the next starts, or answer the second with "
                             "another RocketKV")  # fmt: skip

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` at the next positions; returns the last position's logits `[1, V]` float32.

        The first prefill after the stored context (a question) attends the whole stored context
        exactly; with `reselection` set, each full-attention layer then narrows its context to the
        question's working set (`select_working_set`) for the decode steps that follow. A question
        that starts with the engine's `question_prefix` runs it as a forward of its own, once per
        decoder (kept at the head of the tail across `reset`s), and then only the rest of its ids:
        the same computation wherever the prefix came from, so answers do not depend on whether
        it was kept. Ids run in forwards of at most `QUESTION_CHUNK_TOKENS`, of even sizes
        (re-selection scores summed over them), each reported to a `question_progress` callback
        when there are several. Raises ValueError: no ids."""
        if not ids:
            raise ValueError("prefill needs at least one token id")
        first = self.position == self._base  # a question's first prefill
        scores: dict[int, torch.Tensor] | None = None
        p = len(self.prefix)
        if first and p >= 2 and len(ids) >= p + 2 and tuple(ids[:p]) == self.prefix:
            scores = self._prefill_prefix()
            ids = ids[p:]
        elif first and self._base != self.n_context_tokens:  # the tail holds a prefix these ids lack
            self._drop_prefix()
        reselect = self.reselection if first else None  # a question's working set is chosen after its prefill
        mass = active_attention_mass()
        report = _PROGRESS.get() if len(ids) > QUESTION_CHUNK_TOKENS else None
        if report is not None:
            report(0, len(ids))
        logits = torch.empty(0)
        # chunks of even size: a last chunk of one token would be attended as a decode step (HSA)
        n_chunks = -(-len(ids) // QUESTION_CHUNK_TOKENS)  # ceil
        size = -(-len(ids) // n_chunks)  # ceil: every chunk holds size or size - 1 ids, so 2+ when there are 2+
        for start in range(0, len(ids), size):
            piece = ids[start : start + size]
            positions = torch.arange(self.position, self.position + len(piece), device=self._position.device)
            # an AttentionMass of "last" queries wants the question's last one, not each chunk's
            last = start + len(piece) == len(ids)
            pause = mass is not None and mass.queries == "last" and not last
            with attention_mass_paused() if pause else contextlib.nullcontext():
                if reselect is None:
                    logits = forward_tokens(self.engine.model, self.cache, self.engine.ids(piece), positions)
                else:
                    with rocketkv_attention(self.engine.model, self.cache, self.engine.shape, decode=self.decode,
                                            question=True, question_scores=scores) as session:  # fmt: skip
                        logits = forward_tokens(self.engine.model, self.cache, self.engine.ids(piece), positions)
                    scores = session.question_scores
            self.position += len(piece)
            if report is not None:
                report(start + len(piece), len(ids))
        if not bool(torch.isfinite(logits).all()):  # e.g. Gemma in float16: its activations overflow it
            raise overflow_error(self.engine.dtype_name)
        if reselect is not None:
            self.select_working_set(scores or {}, reselect)
        return logits

    def _prefill_prefix(self) -> dict[int, torch.Tensor]:
        """The tail holding only `prefix`, prefilled (once, or again while an `AttentionMass`
        collects every query's weights: the prefix's count as the question's); returns its re-selection scores
        per full-attention layer (`{}` without re-selection)."""
        mass = active_attention_mass()
        if self._prefix_scores is not None and (mass is None or mass.queries == "last"):
            return self._prefix_scores  # "last" would not collect the prefix's queries anyway
        self._drop_prefix()
        n, p = self.n_context_tokens, len(self.prefix)
        positions = torch.arange(n, n + p, device=self._position.device)
        paused = attention_mass_paused() if mass is not None and mass.queries == "last" else contextlib.nullcontext()
        with paused, rocketkv_attention(self.engine.model, self.cache, self.engine.shape, decode=None,
                                        question=self.reselection is not None) as session:  # fmt: skip
            forward_tokens(self.engine.model, self.cache, self.engine.ids(list(self.prefix)), positions)
        self._prefix_scores = session.question_scores or {}
        self.position = self._base = n + p
        return self._prefix_scores

    def _drop_prefix(self) -> None:
        self.cache.crop_to_context()
        self.position = self._base = self.n_context_tokens
        self._prefix_scores = None

    def select_working_set(self, scores: dict[int, torch.Tensor], plan: Reselection) -> None:
        """Per-question re-selection (docs/algorithm.md §4): in each full-attention layer whose
        stored context holds more than `plan.prompt_budget` tokens, take the attention the
        question's queries gave the stored keys (`scores[layer]` `[1, Hkv, S]`, from its prefill:
        `ops.question_attention`), max-pool, keep the top `plan.prompt_budget` per KV head (the
        stored first and last tokens included) and narrow the layer to them
        (`RocketLayer.select_context`). Where the working set is attended exactly (not by
        stage-2 HSA) and without a logit soft-cap, it is held in `Engine.working_set_dtype`."""
        exact = self.decode is None or not self.decode.uses_hsa(plan.prompt_budget)
        for i, spec in enumerate(self.engine.shape.layers):
            layer = self.cache.layers[i]
            if spec.sliding_window is not None or layer.n_context <= plan.prompt_budget or i not in scores:
                continue
            dtype = self.engine.working_set_dtype if exact and spec.softcap is None else None
            layer.select_context(plan.keep(scores[i]), dtype)  # [1, Hkv, prompt_budget]

    def decode_one_token(self, token: int) -> torch.Tensor:
        """Run one token at the next position; returns its logits `[1, V]` float32."""
        self._token.fill_(token)
        self._position.fill_(self.position)
        with decode_step():
            if self.engine.step is not None:
                logits = self.engine.step(self.cache, self._token, self._position)
            else:
                logits = forward_tokens(self.engine.model, self.cache, self._token, self._position)
        self.position += 1
        return logits

    def score(self, ids: list[int], answer: list[int]) -> torch.Tensor:
        """Teacher forcing: the logits `[len(answer), V]` float32 that predict each token of
        `answer` after the question `ids` and the answer's earlier tokens. The question is
        prefilled as `prefill` does it (it also chooses a re-selected working set), then the
        answer's tokens run in one forward, each position attending with stage 2 and the decode
        weights (`decode_step`) exactly as the decode step at that position would, so the logits
        equal step-by-step decode (`tests/test_decode.py`). Leaves the tokens in the tail;
        `reset()` drops them."""
        with self.attention():
            first = self.prefill(ids)  # [1, V]
        if len(answer) == 1:
            return first
        rest = answer[:-1]
        positions = torch.arange(self.position, self.position + len(rest), device=self._position.device)
        with (
            rocketkv_attention(self.engine.model, self.cache, self.engine.shape, decode=self.decode,
                               hsa_from=self.position),
            decode_step(),
        ):  # fmt: skip
            logits = forward_tokens(self.engine.model, self.cache, self.engine.ids(rest), positions, len(rest))
        self.position += len(rest)
        return torch.cat([first, logits.view(len(rest), -1)], dim=0)

    def reset(self) -> None:
        """Back to the stored context (the tail's tokens are forgotten, but for a kept question
        prefix: see `prefill`)."""
        self.cache.crop_to_context(self._base - self.n_context_tokens)
        self.position = self._base
