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
