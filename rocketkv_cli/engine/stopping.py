"""When an answer ends, and which part of its text is final while it is being decoded.

Pure text rules over the decoded answer (docs/algorithm.md §4), shared by every decoding mode:

- stop strings: the answer is cut at the first stop string of the framing (for the plain framing
  `\\n\\n` and `\\nQuestion:`; for a chat template, after a blank line, the prompt's question line
  echoed: `PromptFormat.echo_stops`); the answer's start counts as the start of a line, so an
  answer that *is* the template (`Question: … Answer:`) is cut there too (issue 17 item 3); and
  for every framing `\nAnswer:` after some text (`ANSWER_ECHO`: Gemma 3 270M went on from an answer
  to "\nAnswer: " and the same answer again), though an answer may itself begin "Answer: …".
- loops: the text is read as units — numbers (every number the same unit, so that counting
  "1. 2. 3. …" repeats), words (lower-cased, in pieces of at most 12 characters, so scripts
  without spaces still have units) and punctuation marks; whitespace is ignored, so a loop that
  wraps its lines differently still repeats. A loop is a tail of ≥ `MIN_LOOP_UNITS` units (and
  at least one whole period) that repeats, with a period of ≤ `MAX_LOOP_PERIOD` units
  (`find_loop`); the answer ends there, keeping the first copy of repeated text (to the end of
  its sentence), or all of a progression of numbers such as counting (`AnswerText.loop_cut`).
- streaming: `AnswerText.final_prefix` is the part of the text no later token can change: it
  holds back a tail that may still become a stop string, a loop's repeat, trailing whitespace
  (stripped at the end) or an incomplete character. The pieces streamed, joined, equal the
  final answer (tests/test_stopping.py checks this on random token streams).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

ANSWER_ECHO = "\nAnswer:"  # a line that labels the answer again after it (the model echoes the Q/A pattern)
AFTER_TEXT_STOPS = (ANSWER_ECHO,)  # stops that count only after some text: an answer may begin "Answer: …"
MIN_STOP_TAIL_CHARS = 4  # a cut answer's tail dropped as a stop string's start: its line break and 3+ characters
MIN_LOOP_UNITS = 24
MAX_LOOP_PERIOD = 64
_UNIT = re.compile(r"\d+|[^\W\d_]{1,12}|[^\w\s]")


def find_loop(seq: Sequence[Hashable], min_units: int = MIN_LOOP_UNITS,
              max_period: int = MAX_LOOP_PERIOD) -> tuple[int, int] | None:  # fmt: skip
    """A loop at the end of `seq` (text units, or any items): (period p, repeated length L) for
    the smallest period p ≤ max_period whose last L items equal the L items p positions earlier,
    with L ≥ max(min_units, p) (at least one whole copy repeated, and never a short repeat such
    as "very very"); None when there is none. Dropping the last L items leaves one copy."""
    n = len(seq)
    for p in range(1, min(max_period, n // 2) + 1):
        k = _match_at_lag(seq, p)
        if k >= max(min_units, p):
            return p, k
    return None


def repeating_suffix(seq: Sequence[Hashable], max_lag: int = MAX_LOOP_PERIOD) -> int:
    """Longest k such that the last k items equal the k items `lag` positions earlier, for some
    lag ≤ max_lag: the part of the tail that a loop found later could cut (0 if none)."""
    return max((_match_at_lag(seq, lag) for lag in range(1, min(max_lag, len(seq) - 1) + 1)), default=0)


def _match_at_lag(seq: Sequence[Hashable], lag: int) -> int:
    n, k = len(seq), 0
    while k < n - lag and seq[n - 1 - k] == seq[n - 1 - k - lag]:
        k += 1
    return k


def text_units(text: str) -> list[tuple[str, int, int]]:
    """(key, start, end) of each unit of `text`: numbers as "0", words lower-cased, marks as is."""
    out = []
    for m in _UNIT.finditer(text):
        s = m.group()
        out.append(("0" if s[0].isdigit() else s.lower(), m.start(), m.end()))
    return out


@dataclass(frozen=True)
class AnswerText:
    """The rules above applied to `raw`, the decoded text of the answer's tokens so far.

    stops: the framing's stop strings (`model.templates`).
    """

    raw: str
    stops: tuple[str, ...]

    @property
    def body(self) -> str:
        return self.raw.lstrip()

    def stop_at(self) -> int | None:
        """Offset in `body` of the first stop string (the body's start is a line start, except for
        `AFTER_TEXT_STOPS`), or None."""
        line = "\n" + self.body
        hits = [i for s in self.stops if (i := line.find(s, 1 if s in AFTER_TEXT_STOPS else 0)) >= 0]
        return max(0, min(hits) - 1) if hits else None

    def text(self) -> str:
        """The answer as shown: cut at the first stop string, whitespace stripped."""
        cut = self.stop_at()
        return (self.body if cut is None else self.body[:cut]).strip()

    def text_at_limit(self) -> str:
        """`text()` of an answer the length limit cut: a tail that is the start of a stop string
        (the framing's next "Question" on a line of its own) is dropped, as it would have been
        had the limit allowed a few more tokens, so a higher limit never gives a shorter answer."""
        text = self.text()
        line = "\n" + text
        for s in self.stops:  # a line break and 3+ characters of it: "\nQue", not a line "Q" that may be text
            for n in range(min(len(s) - 1, len(line)), MIN_STOP_TAIL_CHARS - 1, -1):
                if line.endswith(s[:n]) and (s[0] == "\n" or s in AFTER_TEXT_STOPS):
                    return text[: max(0, len(line) - n - 1)].rstrip()
        return text

    def loop_cut(self) -> int | None:
        """When the text ends in a loop: the offset in `body` where the kept text ends; else None.

        Only whole units count (the last one may still grow). A loop of text (its period has a
        word) keeps its first copy, extended to the end of the sentence or line the loop began
        in; a progression of numbers and marks (counting: "1. 2. 3.") is kept as written."""
        units = text_units(self.body)[:-1]
        found = find_loop([u[0] for u in units])
        if found is None:
            return None
        period, repeated = found
        n = len(units)
        if not any(key[0].isalpha() for key, _, _ in units[n - period :]):
            return units[-1][2]
        start = n - repeated  # the first unit of the repeats
        end = units[start - 1][2] if start else 0
        if start and units[start - 1][0] in (".", "!", "?"):
            return end
        for j in range(start, min(start + period, n)):
            if "\n" in self.body[units[j - 1][2] if j else 0 : units[j][1]]:
                break
            if units[j][0] in (".", "!", "?"):
                return units[j][2]
        return end

    def final_prefix(self) -> str:
        """The longest prefix of `text()` that no later token can change."""
        body = self.body
        cut = self.stop_at()
        end = len(body[: len(body) if cut is None else cut].rstrip())
        while end and body[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            end -= 1
        line = "\n" + body[:end]
        for s in self.stops:  # a tail that may still grow into a stop string
            for n in range(min(len(s) - 1, len(line)), 0, -1):
                if line.endswith(s[:n]):
                    end = min(end, max(0, len(line) - n - 1))
                    break
        units = text_units(body[:end])
        if len(units) == 1:  # the first unit: no loop cut ends before it (one copy is always kept),
            return body[: units[0][2]]  # and a word that grows ("The" → "There") only adds text: shown
        units = units[:-1]  # the last unit may still grow ("1" → "12") and start a loop's repeat: held
        held = repeating_suffix([u[0] for u in units])
        end = min(end, units[len(units) - held - 1][2] if len(units) > held else 0)
        return body[:end].rstrip()


class AnswerTokens:
    """An answer's tokens as they are decoded, under the rules above.

    `add(token)` appends a token and returns the stop reason it causes ("repetition": the loop's
    last copy is removed from `tokens`; "stop_string") or None; `take_final()` returns the text
    that became final since the last call. Once stopped (or at EOS or the length limit),
    `take_final()` returns the rest of `text()`: the pieces joined equal the answer's text.
    decode: token ids → text (the tokenizer's decode, special tokens skipped).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.shown = ""
        self._state = AnswerText("", stops)
        self._done = self._at_limit = False

    def add(self, token: int) -> str | None:
        self.tokens.append(token)
        self._state = AnswerText(self.decode(self.tokens), self.stops)
        cut = self._state.loop_cut()
        if cut is not None:
            self.tokens = self._covering(cut)
            self._state = AnswerText(self.decode(self.tokens), self.stops)
            self._done = True
            return "repetition"
        if self._state.stop_at() is not None:
            self._done = True
            return "stop_string"
        return None

    def finish(self, at_limit: bool = False) -> None:
        """No more tokens (EOS or, `at_limit`, the length limit): the whole text is final; at the
        limit without a tail that begins a stop string (`AnswerText.text_at_limit`)."""
        self._done, self._at_limit = True, at_limit

    def text(self) -> str:
        return self._state.text_at_limit() if self._at_limit else self._state.text()

    def take_final(self) -> str:
        final = self.text() if self._done else self._state.final_prefix()
        if not final.startswith(self.shown):  # cannot happen (tests/test_stopping.py); never repeat text
            return ""
        piece, self.shown = final[len(self.shown) :], final
        return piece

    def _covering(self, n_chars: int) -> list[int]:
        """The shortest prefix of the tokens whose text (leading whitespace stripped) starts with
        the first n_chars characters of the answer (whole characters, not bytes of one)."""
        target = self._state.body[:n_chars]
        for i in range(len(self.tokens) + 1):
            if self.decode(self.tokens[:i]).lstrip().startswith(target):
                return self.tokens[:i]
        return self.tokens
