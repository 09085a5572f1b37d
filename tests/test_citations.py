"""`api.citations.cite`: which characters of the source a cited passage covers, given the scores
the answer loop hands it (here set by hand on a tiny model's cache, one token per character)."""

import torch
from conftest import make_engine

from rocketkv_cli.api.citations import cite
from rocketkv_cli.api.rocketkv import RocketKV


def _cited(doc: str, at: str, window: int = 240):
    """The one passage cited when the token at the first character of `at` in `doc` has the best score."""
    rk = RocketKV(make_engine("llama", torch.float32))
    cache = rk.ingest(text=doc).cache
    offsets = cache.token_offsets.tolist()
    scores = torch.zeros(len(offsets))
    scores[offsets.index(doc.index(at))] = 1.0
    (c,) = cite(rk.engine.tokenizer, cache, scores, torch.ones(len(offsets)), 1, window_chars=window)
    return c


def test__cite__a_line_shorter_than_the_window_is_cited_whole_wherever_its_best_token_is():
    line = " ".join(f"w{i:03d}" for i in range(40))  # 199 characters: under the 240 of the window
    doc = "intro words here\n" + line + "\nclosing words\n"
    exact = " ".join(f"w{i:03d}" for i in range(47)) + " abcde"  # the window's own width
    assert len(exact) == 240
    for text, at in ((line, "w000"), (line, "w039"), (exact, "abcde"), (exact, "w000")):
        doc = "intro words here\n" + text + "\nclosing words\n"
        c = _cited(doc, at)
        assert doc[c.start : c.end] == text, (at, len(doc[c.start : c.end]), doc[c.start : c.end][:60])
        assert (c.first_line, c.last_line) == (2, 2)


def test__cite__the_window_of_a_line_of_indent_and_words_is_its_words():
    line = "    " + " ".join(f"w{i:03d}" for i in range(47))  # 4 + 235 characters: its words fit the window
    doc = "intro words here\n" + line + "\nclosing words\n"
    for at in ("w000", "w046"):  # the best token at the line's start, then at its end
        c = _cited(doc, at)
        assert doc[c.start : c.end] == line.strip(), (at, len(doc[c.start : c.end]), doc[c.start : c.end][:60])


def test__cite__a_longer_line_gets_a_full_window_of_whole_words_inside_it():
    line = " ".join(f"w{i:03d}" for i in range(120))  # 599 characters
    doc = "intro words here\n" + line + "\n"
    start = doc.index(line)
    for at, word in (("w000", "w000"), ("w060", "w060"), ("w119", "w119")):
        c = _cited(doc, at)
        text = doc[c.start : c.end]
        assert word in text.split() and start <= c.start and c.end <= start + len(line), (at, c.start, c.end)
        # whole words of a 240-character window: at least 230 characters even at the line's ends
        assert 230 <= len(text) <= 240, (at, len(text))
        assert (c.start == start or doc[c.start - 1] == " ") and doc[c.end] in " \n", (at, text[:20], text[-20:])


def _passages(doc: str, best: dict[str, float], n: int) -> list[tuple[int, int, str]]:
    """(first line, last line, text) of the `n` passages cited when the tokens at the first
    characters of `best`'s words in `doc` get those scores (every other token 0)."""
    rk = RocketKV(make_engine("llama", torch.float32))
    cache = rk.ingest(text=doc).cache
    offsets = cache.token_offsets.tolist()
    scores = torch.zeros(len(offsets))
    for word, score in best.items():
        scores[offsets.index(doc.index(word))] = score
    cited = cite(rk.engine.tokenizer, cache, scores, torch.ones(len(offsets)), n)
    return [(c.first_line, c.last_line, doc[c.start : c.end]) for c in cited]


def test__cite__neighbouring_whole_lines_are_one_passage_a_blank_line_apart_two():
    """Hard-wrapped prose: a sentence wrapped over lines 2 and 3 is cited once, as lines 2-3 (it
    was two fragments, each using a place); lines with a blank line between stay apart."""
    doc = "intro words\nYou may charge any price\nfor each copy you convey.\n\nThe warranty is void.\nend\n"
    got = _passages(doc, {"charge": 1.0, "each": 0.9, "warranty": 0.5}, 2)
    assert got == [(2, 3, "You may charge any price\nfor each copy you convey."), (5, 5, "The warranty is void.")]
    got = _passages(doc, {"each": 1.0, "warranty": 0.9}, 2)  # line 3, then line 5: not neighbours
    assert got == [(3, 3, "for each copy you convey."), (5, 5, "The warranty is void.")]


def test__cite__neighbouring_lines_join_only_under_twice_the_window():
    one, two, three = (" ".join(f"{c}{i:03d}" for i in range(40)) for c in "abc")  # 199 characters each
    doc = f"intro\n{one}\n{two}\n{three}\nend\n"
    got = _passages(doc, {"a000": 1.0, "b000": 0.9, "c000": 0.8}, 2)  # the window: 240 characters
    assert [(a, b) for a, b, _ in got] == [(2, 3), (4, 4)]  # 3 lines would span 599 characters, over 480
    assert got[0][2] == f"{one}\n{two}"
    for n in (1, 2, 3):  # the first passage is the same however many are asked for
        assert _passages(doc, {"a000": 1.0, "b000": 0.9, "c000": 0.8}, n)[0] == got[0]


def test__cite__a_neighbour_joins_only_if_the_answer_drew_on_it():
    """A neighbouring line with no score, or under `JOIN_SHARE` of the cited line's best, stays out
    (it was taken in while passage places were free: "intro" and "end" scored 0)."""
    from rocketkv_cli.api.citations import JOIN_SHARE

    doc = "intro words\nYou may charge any price\nfor each copy you convey.\n\nThe warranty is void.\nend\n"
    got = _passages(doc, {"charge": 1.0, "warranty": 0.9}, 3)  # line 3 ("each"): 0
    assert [(a, b) for a, b, _ in got][:2] == [(2, 2), (5, 5)], got
    low = _passages(doc, {"charge": 1.0, "each": JOIN_SHARE * 0.9, "warranty": 0.9}, 2)
    assert [(a, b) for a, b, _ in low] == [(2, 2), (5, 5)], low
    high = _passages(doc, {"charge": 1.0, "each": JOIN_SHARE * 1.1, "warranty": 0.9}, 2)
    assert [(a, b) for a, b, _ in high] == [(2, 3), (5, 5)], high
