"""RULER-style synthetic long-context tasks for `rocketkv eval` (docs/accuracy.md), generated locally.

Every generator is deterministic in (task, sample index, seed, length, tokenizer) and returns a
`Sample`: the document text, one or more questions with their expected values, and where each
needle sits (its requested depth as a fraction of the document's tokens, and its character
offset). Lengths are counted with the caller's tokenizer (`count_tokens`), so "4096 tokens" means
4096 tokens of the model being evaluated. Haystacks: a generated noise text (RULER's) or real text
(the caller passes it, e.g. `../shared/data/kjv.txt`). No downloads, no torch.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

CountTokens = Callable[[str], int]

TASKS = ("niah_noise", "niah_text", "multikey", "multivalue", "multiquery", "vt", "fwe")
NEEDS_HAYSTACK_TEXT = ("niah_text",)
DEPTH_RANGE = (0.1, 0.9)  # needles are placed between 10% and 90% of the document
# answer length (tokens) each task needs: a sentence around the values, more for several values
ANSWER_TOKENS = {"niah_noise": 32, "niah_text": 32, "multikey": 32, "multivalue": 64, "multiquery": 32,
                 "vt": 48, "fwe": 32}  # fmt: skip

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
               "lively", "mellow", "nimble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upbeat",
               "vivid", "wary", "young", "zesty")  # fmt: skip
_NOUNS = ("anchor", "badger", "candle", "dragon", "ember", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "ribbon", "saddle", "tunnel",
          "umbrella", "violin", "walnut", "yarrow", "zephyr")  # fmt: skip


@dataclass(frozen=True)
class Needle:
    """One inserted fact. depth: requested start, as a fraction of the document's tokens;
    char_offset: where its text starts in the document."""

    text: str
    depth: float
    char_offset: int


@dataclass(frozen=True)
class Question:
    """A question, the values a correct answer contains (case-insensitive substrings), and the
    depths of the needles that hold them (empty when the answer is spread over the document)."""

    text: str
    expected: tuple[str, ...]
    depths: tuple[float, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One generated document with its questions. `questions` has several entries only for
    multi-query (all asked against the same cache)."""

    task: str
    index: int
    seed: int
    document: str
    questions: tuple[Question, ...]
    needles: tuple[Needle, ...]
    max_new_tokens: int


def _rng(task: str, index: int, seed: int, n_tokens: int) -> random.Random:
    """A generator seeded by all of the sample's identity (stable across processes and runs)."""
    return random.Random(f"rocketkv-eval:{task}:{seed}:{index}:{n_tokens}")


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


def _depths(rng: random.Random, k: int) -> list[float]:
    """k depths spread over DEPTH_RANGE: one uniform draw in the middle 80% of each of k equal
    slices (sorted; neighbours at least a fifth of a slice apart, so needles do not overlap)."""
    lo, hi = DEPTH_RANGE
    step = (hi - lo) / k
    return [round(lo + step * (i + 0.1 + 0.8 * rng.random()), 3) for i in range(k)]


def noise_sentences(rng: random.Random) -> Callable[[], str]:
    """RULER's noise haystack: the same five sentences, over and over."""
    parts = [s.strip() + "." for s in NOISE.split(".") if s.strip()]
    state = {"i": 0}

    def nxt() -> str:
        s = parts[state["i"] % len(parts)]
        state["i"] += 1
        return s

    return nxt


def text_sentences(text: str, rng: random.Random) -> Callable[[], str]:
    """Sentences of a real text (lines split after . ; : ? !), from a random one onwards, wrapping
    around; blank lines skipped. Short pieces keep needle depths accurate."""
    lines = [piece for line in text.splitlines() for piece in re.split(r"(?<=[.;:?!])\s+", line.strip()) if piece]
    if not lines:
        raise ValueError("haystack text has no lines")
    state = {"i": rng.randrange(len(lines))}

    def nxt() -> str:
        s = lines[state["i"] % len(lines)]
        state["i"] += 1
        return s

    return nxt


def assemble(
    next_sentence: Callable[[], str], inserts: list[tuple[float, str]], n_tokens: int, count_tokens: CountTokens
) -> tuple[str, tuple[Needle, ...]]:
    """Haystack sentences up to about `n_tokens` tokens with each insert placed at its depth.

    Args:
        next_sentence: yields haystack sentences. inserts: (depth in [0, 1], text), any order.
        n_tokens: target length of the whole document in tokens (haystack + inserts).
        count_tokens: the model's token count of a text.
    Returns:
        (document text, needles in document order with their character offsets).
    """
    inserts = sorted(inserts)
    insert_tokens = sum(count_tokens(" " + text) for _, text in inserts)
    sentences, sizes, total = [], [], 0
    while total < n_tokens - insert_tokens:
        s = next_sentence()
        sentences.append(s)
        sizes.append(count_tokens(" " + s))
        total += sizes[-1]
    cumulative = [0]
    for size in sizes:
        cumulative.append(cumulative[-1] + size)
    pieces_at: dict[int, list[tuple[float, str]]] = {}
    placed, slot = 0, 0  # tokens of inserts placed before the current one; slot of the previous one
    for depth, text in inserts:
        target = depth * (total + insert_tokens) - placed  # haystack tokens that should precede it
        slot = min(range(slot, len(cumulative)), key=lambda j: abs(cumulative[j] - target))  # in depth order
        pieces_at.setdefault(slot, []).append((depth, text))
        placed += count_tokens(" " + text)
    pieces: list[str] = []
    needles: list[Needle] = []
    offset = 0  # character offset of the next piece (pieces are joined by one space)
    for j in range(len(sentences) + 1):
        for depth, text in pieces_at.get(j, []):
            needles.append(Needle(text=text, depth=depth, char_offset=offset))
            pieces.append(text)
            offset += len(text) + 1
        if j < len(sentences):
            pieces.append(sentences[j])
            offset += len(sentences[j]) + 1
    return " ".join(pieces), tuple(needles)


def _niah_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah_question(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the provided text?"


def generate(
    task: str, index: int, seed: int, n_tokens: int, count_tokens: CountTokens, haystack_text: str | None = None
) -> Sample:
    """Generate sample `index` of `task` with a document of about `n_tokens` tokens.

    Args:
        task: one of TASKS. index, seed: the sample's identity (same → same sample).
        n_tokens: document length in tokens of `count_tokens`' tokenizer (at least 64).
        haystack_text: real text for `niah_text` (required there, unused elsewhere).
    Raises:
        ValueError: unknown task, too short a length, or `niah_text` without haystack text.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks are {', '.join(TASKS)}")
    if n_tokens < 64:
        raise ValueError(f"n_tokens must be at least 64, got {n_tokens}")
    rng = _rng(task, index, seed, n_tokens)
    keys: set[str] = set()
    values: set[str] = set()
    if task == "fwe":
        return _fwe(rng, index, seed, n_tokens, count_tokens)
    if task == "niah_text":
        if haystack_text is None:
            raise ValueError("task niah_text needs a haystack text")
        sentences = text_sentences(haystack_text, rng)
    else:
        sentences = noise_sentences(rng)
    questions: tuple[Question, ...]
    if task in ("niah_noise", "niah_text", "multikey"):
        n_needles = 4 if task == "multikey" else 1
        pairs = [(_key(rng, keys), _number(rng, values)) for _ in range(n_needles)]
        depths = _depths(rng, n_needles)
        rng.shuffle(depths)  # the target (pairs[0]) lands anywhere among the distractors
        inserts = [(d, _niah_needle(k, v)) for d, (k, v) in zip(depths, pairs)]
        questions = (Question(_niah_question(pairs[0][0]), (pairs[0][1],), (depths[0],)),)
    elif task == "multivalue":
        key = _key(rng, keys)
        vals = [_number(rng, values) for _ in range(4)]
        depths = _depths(rng, 4)
        inserts = [(d, _niah_needle(key, v)) for d, v in zip(depths, vals)]
        questions = (Question(f"What are all the special magic numbers for {key} mentioned in the provided text?",
                              tuple(vals), tuple(depths)),)  # fmt: skip
    elif task == "multiquery":
        pairs = [(_key(rng, keys), _number(rng, values)) for _ in range(4)]
        depths = _depths(rng, 4)
        inserts = [(d, _niah_needle(k, v)) for d, (k, v) in zip(depths, pairs)]
        questions = tuple(Question(_niah_question(k), (v,), (d,)) for d, (k, v) in zip(depths, pairs))
    else:  # vt: a chain of assignments, one hop per depth
        names: list[str] = []
        while len(names) < 4:
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = _depths(rng, 4)
        inserts = list(zip(depths, chain))
        questions = (Question(f"Find all variables that are assigned the value {value} in the text above.",
                              tuple(names), tuple(depths)),)  # fmt: skip
    document, needles = assemble(sentences, inserts, n_tokens, count_tokens)
    return Sample(task, index, seed, document, questions, needles, ANSWER_TOKENS[task])


def _fwe(rng: random.Random, index: int, seed: int, n_tokens: int, count_tokens: CountTokens) -> Sample:
    """Frequent-word extraction: coded words drawn from a Zipf(α=2) law; the top 3 are the answer."""
    vocab: list[str] = []
    while len(vocab) < 200:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 6)))
        if word not in vocab:
            vocab.append(word)
    weights = [1.0 / (rank + 1) ** 2 for rank in range(len(vocab))]
    words: list[str] = []
    total = 0
    while total < n_tokens or len(set(words)) < 4:  # a third place needs a fourth word to beat
        chunk = rng.choices(vocab, weights=weights, k=16)
        words += chunk
        total += count_tokens(" " + " ".join(chunk))
    counts = Counter(words)
    top = [w for w, _ in counts.most_common(4)]
    if counts[top[2]] == counts[top[3]]:  # make the third place unambiguous
        words[rng.randrange(len(words))] = top[2]
    top3 = tuple(w for w, _ in Counter(words).most_common(3))
    question = Question("What are the three most frequently appeared words in the above coded text?", top3)
    return Sample("fwe", index, seed, " ".join(words), (question,), (), ANSWER_TOKENS["fwe"])
