"""Checks a summary can fail, and the extractive fallback: standard library only (no torch), so
that `scripts/summary_check_report.py` and tests use it without loading a model.

Words: `[^\\W_]+` runs (letters and digits) are counted for length and echo; letter runs
(`[^\\W\\d_]+`) are the terms of grounding, names and centrality. Verse references such as
"Ruth1:1", "2Jn1:1" or "1 Cor 15:1-14" (`REFERENCE`) are markup, not words: they are removed
before names and sentences are read, and the text after one starts a new sentence. Addresses
(`URL`: http…, www.…, e-mail) are removed before words are read for grounding and names.

Rules (`check_summary` applies all three):

- degenerate (`degenerate_reasons`): an echo of the instruction or of a framing line (a sentence
  or line of the summary equals, once normalised, a line or sentence of the prompt texts given,
  or the summary contains a prompt line of 3 or more words, or at least `ECHO_SHARE` of its
  content words — see grounding — are words of the prompts: "The document above is a summary of
  the document above."); a sentence repeated (two sentences
  or lines of 2+ words with the same normalised text, or a run of `LOOP_WORDS` words that occurs
  twice without overlapping: a loop inside one sentence); under `MIN_WORDS` words; or a bare
  reference (nothing but references and punctuation).
- grounding (`grounding`): the share of the summary's content words (lower-cased letter words,
  `STOPWORDS` removed, counted with repetition) that occur in the source is at least
  `MIN_GROUNDED_SHARE`, and every proper name of the summary (a capitalised word not at a
  sentence start and not a stopword) occurs in the source spelled the same.
- coverage (`coverage`): the summary names at least min(`MIN_NAMES`, number of names) of the
  document's `TOP_NAMES` most frequent proper names (`document_names`).

Normalised text: lower-cased words joined by single spaces (punctuation dropped).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_WORDS = 15
LOOP_WORDS = 8
ECHO_SHARE = 0.5
MIN_GROUNDED_SHARE = 0.90
TOP_NAMES = 20
MIN_NAMES = 5
NAME_CAPITALISED_SHARE = 0.90

REFERENCE = re.compile(r"(?<![^\W_])(?:[1-3] ?)?[A-Z][A-Za-z]*\.? ?\d+:\d+(?:[-–]\d+)?(?![^\W_])")
# an e-mail address is a whole word (one match may start per word) holding an @: a pattern that could
# start inside a word (at any character, or after each bracket or quote) was quadratic in the word's
# length: a 100 KB base64 blob took seconds, minified JSON minutes
URL = re.compile(r"(?:https?://|www\.)\S+|(?<!\S)[^\s@]+@[^\s@]+\.[^\s@]+")
_WORD = re.compile(r"[^\W_]+")
_LETTERS = re.compile(r"[^\W\d_]+")
_UNIT_END = re.compile(r"(?<=[.!?])\s+|\n+")  # sentences of a summary: after . ! ? or at a line end
_ENDED = re.compile(r"[.!?][\"'”’)\]]*\s*$")  # a whole sentence's end, not a clause's (: ; ,)
# a sentence ends at . ! ? before whitespace and a capital, a digit, an opening quote, or a letter
# outside ASCII (a Cyrillic, Greek or accented capital; scripts without case), and at 。！？ (CJK:
# no space follows them); ASCII alone split no Russian, French-accented or Chinese text at all
_SENTENCE_END = re.compile(
    r"(?:(?<=[.!?])|(?<=[.!?][\"'”’)]))\s+(?=[\"'“‘«(]?(?:[A-Z0-9]|[^\x00-\x7f]))"  # . ! ? then a start
    r"|(?<=[。！？])\s*"  # CJK's ends
)
_OPENERS = "\"'“‘([ \t"

STOPWORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before
    being below between both but by can could did do does doing down during each either every few
    for from further had has have having he her here hers herself him himself his how i if in into
    is it its itself just may me might more most must my myself no nor not now of off on once one
    only or other our ours ourselves out over own same shall she should so some such than that the
    their theirs them themselves then there these they this those through thus to too under until
    up upon us very was we were what when where which while who whom whose why will with would
    yet you your yours yourself yourselves s t unto thee thou thy thine ye hath doth saith""".split()
)


def normalise(text: str) -> str:
    """Lower-cased words of `text` joined by single spaces: "Summary:" → "summary"."""
    return " ".join(w.lower() for w in _WORD.findall(text))


def _units(text: str) -> list[str]:
    """Sentences and lines of a summary, normalised, empty ones dropped."""
    return [u for u in (normalise(p) for p in _UNIT_END.split(text)) if u]


def prompt_lines(prompts: Iterable[str]) -> set[str]:
    """Normalised lines and sentences of the prompt texts (placeholders such as {document} removed)."""
    out = set()
    for prompt in prompts:
        text = re.sub(r"\{[a-z_]+\}", "\n", prompt)
        out.update(_units(text))
    return out


def _repeats_a_run(words: list[str]) -> bool:
    """True when some run of LOOP_WORDS consecutive words occurs twice without overlapping."""
    first: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - LOOP_WORDS + 1):
        run = tuple(words[i : i + LOOP_WORDS])
        if i - first.setdefault(run, i) >= LOOP_WORDS:
            return True
    return False


def degenerate_reasons(summary: str, prompts: Iterable[str]) -> list[str]:
    """Why `summary` is degenerate (module docstring, "degenerate"); empty when it is not.

    prompts: the texts of the prompt files used to ask for it (their lines are what an echo
    repeats). Reasons, in this order: "echo of the prompt", "repeated sentence", "under 15 words",
    "bare reference".
    """
    reasons = []
    prompts = list(prompts)
    units = _units(summary)
    lines = prompt_lines(prompts)
    whole = f" {normalise(summary)} "
    vocabulary = set(content_words(re.sub(r"\{[a-z_]+\}", " ", "\n".join(prompts))))
    words = content_words(summary)
    if (any(u in lines for u in units) or any(len(p.split()) >= 3 and f" {p} " in whole for p in lines)
            or (words and sum(w in vocabulary for w in words) >= ECHO_SHARE * len(words))):  # fmt: skip
        reasons.append("echo of the prompt")
    counts = Counter(u for u in units if len(u.split()) >= 2)
    if any(n > 1 for n in counts.values()) or _repeats_a_run(normalise(summary).split()):
        reasons.append("repeated sentence")
    if len(_WORD.findall(summary)) < MIN_WORDS:
        reasons.append(f"under {MIN_WORDS} words")
    if REFERENCE.search(summary) and not _LETTERS.search(REFERENCE.sub(" ", summary)):
        reasons.append("bare reference")
    return reasons


def _tokens(text: str) -> list[tuple[str, bool]]:
    """Letter words of `text` with whether each starts a sentence (references removed first).

    A word starts a sentence when it is the first of the text or of a line, or follows . ! ?
    (opening quotes and brackets between are skipped), or follows a removed reference.
    """
    text = REFERENCE.sub("\n", URL.sub(" ", text))
    out: list[tuple[str, bool]] = []
    for m in _LETTERS.finditer(text):
        i = m.start()  # back over the openers before the word (no copy of the text before it: linear)
        while i and text[i - 1] in _OPENERS:
            i -= 1
        out.append((m.group(), not i or text[i - 1] in ".!?\n"))
    return out


def content_words(text: str) -> list[str]:
    """Lower-cased letter words of `text` that are not `STOPWORDS`, in order, with repetition."""
    return [w.lower() for w, _ in _tokens(text) if w.lower() not in STOPWORDS]


def summary_names(summary: str) -> list[str]:
    """Proper names of a summary: capitalised words not at a sentence start, not stopwords (in order)."""
    return [w for w, start in _tokens(summary) if w[0].isupper() and not start and w.lower() not in STOPWORDS]


def document_names(source: str, top: int = TOP_NAMES) -> list[str]:
    """The `top` most frequent proper names of a document, most frequent first.

    A proper name is a letter word (not a stopword, 2+ letters) that starts with a capital letter
    in at least `NAME_CAPITALISED_SHARE` of its occurrences (all spellings, compared lower-cased)
    and is capitalised at least once where no sentence starts (so a word capitalised only because
    it opens sentences is not one). Frequency counts every occurrence; ties go to the word seen
    first. Each name is given in its most frequent capitalised spelling ("LORD" over "Lord").
    """
    total: Counter[str] = Counter()
    capitalised: Counter[str] = Counter()
    spellings: Counter[str] = Counter()
    inside: set[str] = set()
    first: dict[str, int] = {}
    for i, (word, start) in enumerate(_tokens(source)):
        key = word.lower()
        first.setdefault(key, i)
        total[key] += 1
        if word[0].isupper():
            capitalised[key] += 1
            spellings[word] += 1
            if not start:
                inside.add(key)
    names = [k for k in inside
             if len(k) >= 2 and k not in STOPWORDS and capitalised[k] >= NAME_CAPITALISED_SHARE * total[k]]  # fmt: skip
    names.sort(key=lambda k: (-total[k], first[k]))
    best: dict[str, str] = {}
    for spelling, n in spellings.most_common():
        best.setdefault(spelling.lower(), spelling)
    return [best[k] for k in names[:top]]


@dataclass(frozen=True)
class Grounding:
    """`grounding`'s result: share of content words found in the source, and what was not found."""

    share: float
    n_content_words: int
    missing_words: tuple[str, ...]
    missing_names: tuple[str, ...]

    @property
    def passed(self) -> bool:
        """True when the share reaches `MIN_GROUNDED_SHARE` and no proper name is missing."""
        return self.share >= MIN_GROUNDED_SHARE and not self.missing_names


def grounding(summary: str, source: str) -> Grounding:
    """How much of `summary` comes from `source` (module docstring, "grounding").

    share is 0.0 for a summary with no content words.
    """
    words = content_words(summary)
    exact = {w for w, _ in _tokens(source)}
    known = {w.lower() for w in exact}
    missing = [w for w in words if w not in known]
    names = [n for n in dict.fromkeys(summary_names(summary)) if n not in exact]
    share = (len(words) - len(missing)) / len(words) if words else 0.0
    return Grounding(share, len(words), tuple(dict.fromkeys(missing)), tuple(names))


@dataclass(frozen=True)
class Coverage:
    """`coverage`'s result: the document's top names, those the summary names, and how many it must."""

    names: tuple[str, ...]
    named: tuple[str, ...]
    required: int

    @property
    def passed(self) -> bool:
        """True when at least `required` names are named."""
        return len(self.named) >= self.required


def coverage(summary: str, source: str, names: Iterable[str] | None = None) -> Coverage:
    """Which of the source's top proper names the summary names (module docstring, "coverage").

    A name is named when the summary holds it capitalised (any sentence position, compared
    lower-cased: "Lord" names "LORD"). `names`: the names to look for instead of `source`'s own
    (the document's, when `source` is only the joined summaries of its parts).
    """
    names = list(names) if names is not None else document_names(source)
    used = {w.lower() for w, _ in _tokens(summary) if w[0].isupper()}
    named = tuple(n for n in names if n.lower() in used)
    return Coverage(tuple(names), named, min(MIN_NAMES, len(names)))


@dataclass(frozen=True)
class SummaryCheck:
    """All three rules' results for one summary."""

    degenerate: tuple[str, ...]
    grounding: Grounding
    coverage: Coverage

    @property
    def passed(self) -> bool:
        """Not degenerate, grounded and covering."""
        return not self.degenerate and self.grounding.passed and self.coverage.passed

    def to_dict(self) -> dict:
        """A JSON-ready record (stable keys)."""
        g, c = self.grounding, self.coverage
        return {"degenerate": list(self.degenerate), "grounding": round(g.share, 3),
                "grounding_passed": g.passed, "missing_words": list(g.missing_words),
                "missing_names": list(g.missing_names), "names": list(c.names), "named": list(c.named),
                "names_required": c.required, "coverage_passed": c.passed, "passed": self.passed}  # fmt: skip


def check_summary(summary: str, source: str, prompts: Iterable[str]) -> SummaryCheck:
    """Apply the degenerate, grounding and coverage rules to `summary` of `source`."""
    return SummaryCheck(tuple(degenerate_reasons(summary, prompts)), grounding(summary, source),
                        coverage(summary, source))  # fmt: skip


def split_sentences(text: str) -> list[str]:
    """Sentences of a document, in order: references removed, each sentence's lines joined.

    Paragraphs end at blank lines and at references (a verse per line); inside one, a sentence
    ends at . ! ? (closing quotes or brackets kept) before whitespace and a capital, digit,
    opening quote or letter outside ASCII, and at 。！？ (CJK).
    """
    text = REFERENCE.sub("\n\n", text)
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        out.extend(s for s in _SENTENCE_END.split(flat) if _LETTERS.search(s))
    return out


def extract_sentences(text: str, n: int | None = None, names: Iterable[str] | None = None) -> list[str]:
    """The `n` most central sentences of `text`, in document order, verbatim (`split_sentences`).

    Centrality (TF-IDF, `_centrality`): each sentence is a vector of its content words' counts
    times idf(w) = ln(1 + N/df(w)) (N sentences, df = sentences holding w); its score is the cosine
    with the whole text's vector (the sum of all sentences'). Candidates have 6–60 words and end a
    sentence (. ! ? before any closing quotes or brackets: not a clause that a colon or semicolon
    leads into the next sentence or verse, which reads as a non sequitur beside the next one
    chosen); all sentences are candidates when fewer than n are (one chosen then with more than 60
    words — a paragraph without full stops, such as a list or code — keeps its first 60 words and
    " …"); a sentence equal to
    an earlier one is skipped, and so is one that would make the chosen sentences repeat a sentence
    or an 8-word run (the degenerate rule: KJV verses share whole phrases); ties go to the earlier
    sentence. n defaults to N/25 rounded, kept
    within 3–5; then, for the default n only (a given n is exactly n sentences), coverage: while
    the chosen sentences name fewer than min(MIN_NAMES, names) of the text's `document_names`,
    the candidate that names the most of those still unnamed is added (ties: the more central,
    then the earlier; never one that would repeat a sentence or an 8-word run of those chosen), so
    a summary of a story names its main people and places; at most that many sentences are added.
    """
    sentences = split_sentences(text)
    if not sentences:
        return []
    k = n if n is not None else min(5, max(3, round(len(sentences) / 25)))
    chooser = _Chooser(sentences, _centrality(sentences))
    candidates = chooser.candidates(range(len(sentences)))
    sized = chooser.sized(candidates)
    pool = sized if len(sized) >= k else candidates
    chooser.central(pool, k)
    if n is None:
        chooser.cover(pool, list(names) if names is not None else document_names(text))
    return chooser.sentences()


OUTLINE_GROUPS = 12
OUTLINE_SENTENCES = 4


def outline_sentences(
    summaries: Sequence[str], names: Iterable[str], texts: Sequence[str] = (), groups: int = OUTLINE_GROUPS
) -> list[str]:
    """`outline_placed`'s sentences (the docstring is there)."""
    return [sentence for sentence, _, _ in outline_placed(summaries, names, texts, groups)]


def outline_placed(
    summaries: Sequence[str], names: Iterable[str], texts: Sequence[str] = (), groups: int = OUTLINE_GROUPS
) -> list[tuple[str, int, int]]:
    """An extracted outline of a document from its parts' `summaries`, in order: the final summary
    of a long document, so that it follows the whole document and not its most typical stretch.

    The parts are cut into min(`groups`, parts) stretches of consecutive parts (as equal in number
    as they can be); each gives the ceil(`OUTLINE_SENTENCES` / stretches) most central sentences of
    its summaries (`extract_sentences`' centrality, candidates and repeat rule, centrality within
    the stretch). Then coverage as in `extract_sentences`, for `names` (the whole document's): from
    any of the summaries' sentences first, then, when those cannot name enough, from `texts` (part
    j's own text, its sentences of 6–60 words that end a sentence if it has any, placed after its
    summary's). Sentences verbatim (cut at 60 words), in part order, each with its part j and where
    it was found (0: part j's summary, 1: part j's text); empty when the summaries hold no sentence.
    """
    n = len(summaries)
    g = max(1, min(groups, n))
    bounds = [round(i * n / g) for i in range(g + 1)]
    sentences: list[str] = []
    scores: list[float] = []
    parts: list[int] = []  # the part each sentence summarizes
    stretches: list[range] = []
    for a, b in zip(bounds, bounds[1:]):
        found = [(j, s) for j in range(a, b) for s in split_sentences(summaries[j])]
        stretches.append(range(len(sentences), len(sentences) + len(found)))
        sentences += [s for _, s in found]
        parts += [j for j, _ in found]
        scores += _centrality([s for _, s in found])
    if not sentences:
        return []
    chooser = _Chooser(sentences, scores, parts)
    per = max(1, math.ceil(OUTLINE_SENTENCES / g))
    everything = chooser.candidates(range(len(sentences)))
    for stretch in stretches:
        mine = [i for i in everything if i in stretch]
        sized = chooser.sized(mine)
        chooser.central(sized if len(sized) >= per else mine, per)
    wanted = list(names)
    if not chooser.cover(everything, wanted):
        for j, text in enumerate(texts):  # the parts' own sentences, scored within their part
            own = split_sentences(text)
            chooser.add(own, _centrality(own), part=j, rank=1)
        reserve = chooser.candidates(range(len(sentences), len(chooser.all)))
        chooser.cover(chooser.sized(reserve) or reserve, wanted)
    return chooser.placed()


def _centrality(sentences: Sequence[str]) -> list[float]:
    """Each sentence's TF-IDF cosine with the whole of `sentences` (`extract_sentences`)."""
    counts = [Counter(content_words(s)) for s in sentences]
    df = Counter(w for c in counts for w in c)
    idf = {w: math.log(1 + len(sentences) / d) for w, d in df.items()}
    whole = Counter({w: sum(c[w] for c in counts) * idf[w] for w in df})
    norm_whole = math.sqrt(sum(v * v for v in whole.values())) or 1.0

    def score(c: Counter[str]) -> float:
        dot = sum(c[w] * idf[w] * whole[w] for w in c)
        norm = math.sqrt(sum((c[w] * idf[w]) ** 2 for w in c)) or 1.0
        return dot / (norm * norm_whole)

    return [score(c) for c in counts]


class _Chooser:
    """Sentences chosen one by one, never one that makes the chosen repeat a sentence or an 8-word
    run (the degenerate rule, on their joined text). `parts`/`rank` order the result: by part,
    then rank (a summary's sentences before its part text's), then position."""

    def __init__(self, sentences: list[str], scores: list[float], parts: list[int] | None = None):
        self.all, self.scores = list(sentences), list(scores)
        self.order = [(p, 0, i) for i, p in enumerate(parts or [0] * len(sentences))]
        self.best: list[int] = []
        self.seen: set[str] = set()

    def add(self, sentences: list[str], scores: list[float], part: int, rank: int) -> None:
        """More sentences to choose from (their `part` and `rank` place them in the result)."""
        self.order += [(part, rank, len(self.all) + i) for i in range(len(sentences))]
        self.all += sentences
        self.scores += scores

    def candidates(self, indices: Iterable[int]) -> list[int]:
        """`indices` without a sentence whose normalised text came before (here or in an earlier call)."""
        out = []
        for i in indices:
            key = normalise(self.all[i])
            if key not in self.seen:
                self.seen.add(key)
                out.append(i)
        return out

    def sized(self, indices: list[int]) -> list[int]:
        """Those of `indices` with 6–60 words that end a sentence (`_ENDED`)."""
        return [i for i in indices if 6 <= len(_LETTERS.findall(self.all[i])) <= 60 and _ENDED.search(self.all[i])]

    def repeats(self, chosen: list[int]) -> bool:
        """The degenerate rule "repeated sentence" on the chosen sentences' joined text."""
        joined = " ".join(_cut(self.all[i]) for i in sorted(chosen, key=lambda i: self.order[i]))
        counts = Counter(u for u in _units(joined) if len(u.split()) >= 2)
        return any(c > 1 for c in counts.values()) or _repeats_a_run(normalise(joined).split())

    def central(self, pool: list[int], k: int) -> None:
        """Choose the `k` most central of `pool` (ties: the earlier) that repeat nothing chosen."""
        taken = 0
        for i in sorted(pool, key=lambda i: (-self.scores[i], i)):
            if taken == k:
                break
            if not self.repeats([*self.best, i]):
                self.best.append(i)
                taken += 1

    def cover(self, pool: list[int], names: list[str]) -> bool:
        """Add from `pool` the sentence naming the most of `names` still unnamed (ties: the more
        central, then the earlier) while fewer than min(MIN_NAMES, names) are named; True when
        that many are."""
        targets = {name.lower() for name in names}
        required = min(MIN_NAMES, len(targets))

        def named(i: int) -> set[str]:
            return {w.lower() for w, _ in _tokens(_cut(self.all[i])) if w[0].isupper()} & targets

        covered = set().union(*(named(i) for i in self.best)) if self.best else set()
        for _ in range(required):
            if len(covered) >= required:
                break
            already = self.repeats(self.best)  # a candidate may not be the one that makes it repeat itself
            gain = {i: g for i in pool if i not in self.best and (g := len(named(i) - covered)) > 0}
            ranked = sorted(gain, key=lambda i: (-gain[i], -self.scores[i], i))  # the repeat rule: best first only
            pick = next((i for i in ranked if already or not self.repeats([*self.best, i])), None)
            if pick is None:
                break
            self.best.append(pick)
            covered |= named(pick)
        return len(covered) >= required

    def sentences(self) -> list[str]:
        """The chosen sentences in order (`order`), cut at 60 words."""
        return [sentence for sentence, _, _ in self.placed()]

    def placed(self) -> list[tuple[str, int, int]]:
        """The chosen sentences in order, each with its part and rank (0: a summary's, 1: a part text's)."""
        return [(_cut(self.all[i]), self.order[i][0], self.order[i][1])
                for i in sorted(self.best, key=lambda i: self.order[i])]  # fmt: skip


def _cut(sentence: str, max_words: int = 60) -> str:
    """`sentence` up to the end of its `max_words`-th letter word and " …" when it has more."""
    words = list(_LETTERS.finditer(sentence))
    return sentence if len(words) <= max_words else sentence[: words[max_words - 1].end()] + " …"
