"""Answering questions one at a time from one loaded cache (what `rocketkv chat` runs), and one
answer as a stream of text pieces. Built by `RocketKV.session` / `RocketKV.stream` (api.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator

from ..core.cache import AnyCache, CompressedKVCache, SegmentedKVCache
from ..engine.answer import Answer, Answerer, Sampling, TextCallback, decode_config_for, drain
from ..engine.engine import Engine
from .citations import citer
from .segments import merge_segments, route

Log = Callable[[str], None]


class AnswerStream:
    """One answer's text as it is decoded: iterate for the pieces (joined, they equal the
    answer's text); `answer` is the `Answer` once the iteration has ended (None before)."""

    def __init__(self, steps: Generator[str, None, Answer]):
        self._steps = steps
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        if self.answer is not None:  # read to its end before: no pieces again, and the answer stays (it was None)
            return
        self.answer = yield from self._steps

    def steps(self) -> Generator[str, None, Answer]:
        """The pieces, returning the `Answer` (for `yield from` in a generator that wraps this one)."""
        self.answer = yield from self._steps
        return self.answer


class Session:
    """Questions answered one at a time from one cache, with the model and the decode buffers
    kept between them (build with `RocketKV.session`). A segmented cache routes each question
    (`segments.route`) and keeps the buffers of the segments last used."""

    def __init__(self, engine: Engine, cache: AnyCache, max_new_tokens: int, sparse: bool,
                 overrides: dict[str, int | None], sampling: Sampling, n_segments: int, segment: int | None,
                 log: Log, cite: int = 0) -> None:  # fmt: skip
        self.engine, self.cache, self.max_new_tokens, self.sparse = engine, cache, max_new_tokens, sparse
        self.overrides, self.sampling, self.n_segments, self.segment, self.log = (
            overrides, sampling, n_segments, segment, log)  # fmt: skip
        self.cite = cite
        self._answerer: tuple[tuple[int, ...] | None, Answerer] | None = None

    def _for(self, question: str) -> tuple[tuple[int, ...] | None, Answerer]:
        chosen: tuple[int, ...] | None = None
        part = self.cache
        if isinstance(self.cache, SegmentedKVCache):
            picked = [self.segment] if self.segment is not None else route(self.engine, self.cache, question,
                                                                           self.n_segments)  # fmt: skip
            chosen = tuple(picked)
            part = merge_segments(self.cache, picked)
            self.log(f"answering from segment{'s' * (len(chosen) > 1)} {', '.join(map(str, chosen))}")
        if self._answerer is None or self._answerer[0] != chosen:
            assert isinstance(part, CompressedKVCache)  # a segmented cache was merged above
            decode = decode_config_for(part, self.sparse, **self.overrides)
            answerer = Answerer(self.engine, part, self.max_new_tokens, decode, sampling=self.sampling,
                                cite=citer(self.engine.tokenizer, part, self.cite))  # fmt: skip
            self._answerer = (chosen, answerer)
        return self._answerer

    def stream(self, question: str) -> AnswerStream:
        """The answer to `question` as an `AnswerStream`. Raises InputError, BudgetError (checked
        when the iteration starts)."""

        def steps() -> Generator[str, None, Answer]:
            chosen, answerer = self._for(question)
            ans = yield from answerer.stream(question)
            return ans if chosen is None else dataclasses.replace(ans, segments=chosen)

        return AnswerStream(steps())

    def ask(self, question: str, on_text: TextCallback | None = None) -> Answer:
        """The answer to `question`; `on_text(piece)` gets its text as it becomes final.
        Raises InputError (an empty question), BudgetError (one that does not fit)."""
        return drain(self.stream(question).steps(), on_text)
