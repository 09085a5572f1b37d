"""Focus (`api/focus.py`): passages of whole lines, BM25 picks, and `RocketKV.ask_focused`, which
must answer exactly as `ask` over a cache of the chosen passages' text alone."""

import pytest
import torch
from conftest import make_engine

from rocketkv_cli.api.focus import best_passages, focus_text, passages, stored_passages
from rocketkv_cli.api.rocketkv import RocketKV
from rocketkv_cli.errors import UsageError


def test__passages__cut_at_blank_lines_and_before_the_line_that_overflows():
    text = "aaaa\nbbbb\n\ncccc\ndddd\neeee\n\n\nffffffffffff\n"
    # limit 10: "aaaa\nbbbb" (9 chars) ends at the blank line 3; "cccc\ndddd" is 9, adding "eeee"
    # would make 14 > 10, so line 6 starts a passage; line 9 is longer than 10 and stands alone
    got = [(p.first_line, p.last_line, p.text) for p in passages(text, max_chars=10)]
    assert got == [(1, 2, "aaaa\nbbbb"), (4, 5, "cccc\ndddd"), (6, 6, "eeee"), (9, 9, "ffffffffffff")]
    # characters: line 1 starts at 0, line 4 at 11 (after "aaaa\nbbbb\n\n"), line 9 at 28
    assert [(p.start, p.end) for p in passages(text, max_chars=10)] == [(0, 9), (11, 20), (21, 25), (28, 40)]
    longer = text + "tail without end"
    assert all(longer[p.start : p.end] == p.text for p in passages(longer, 10))
    crlf = passages("ab\r\ncd\r\n\r\nef", 100)
    assert [(p.text, p.start, p.end) for p in crlf] == [("ab\ncd", 0, 6), ("ef", 10, 12)]
    assert passages("", 10) == [] and passages("\n\n", 10) == []
    with pytest.raises(UsageError):
        passages(text, max_chars=0)


def test__best_passages__rank_by_the_question_words_and_keep_document_order():
    paras = ["the harbour master keeps a compass", "bread and salt", "a blue chest under the stairs",
             "the compass of the harbour master is silver", "bread again"]  # fmt: skip
    text = "\n\n".join(paras) + "\n"
    q = "Where does the harbour master keep the silver compass?"
    # shared words: paragraph 0 has harbour, master, compass (and "the"); paragraph 3 has those and
    # silver; 2 has only "the"; 1 and 4 share no word
    two = best_passages(text, q, n=2)
    assert [p.text for p in two] == [paras[0], paras[3]]  # document order, not score order
    every = best_passages(text, q, n=10)
    assert [p.text for p in every] == [paras[0], paras[2], paras[3]], "a passage with no shared word was kept"
    assert best_passages(text, "zebra quagga?", n=3) == []
    # "bread" once in paragraphs 1 and 4: BM25 ranks the shorter (4, 2 words against 3) first
    start = best_passages(text, "bread?", n=1, keep_start=True)
    assert [(p.text, p.score > 0) for p in start] == [(paras[0], False), (paras[4], True)]
    assert best_passages(text, "zebra?", n=1, keep_start=True) == []  # nothing chosen: no start either
    with pytest.raises(UsageError):
        best_passages(text, q, n=0)


def test__ask_focused__answers_as_ask_over_the_chosen_passages_alone():
    rk = RocketKV(make_engine("llama", torch.float32))
    paras = [f"line {i} river stone paper light" for i in range(12)] + ["the quagga sleeps in the north cloud"]
    doc = "\n\n".join(paras) + "\n"
    cache = rk.ingest(text=doc).cache
    assert [p.text for _, p in stored_passages(rk.engine, cache)] == paras
    q = "Where does the quagga sleep?"
    got = rk.ask_focused(cache, q, passages=1, max_new_tokens=6)
    assert [p.text for p in got.passages] == [paras[-1]]
    short = rk.ingest(text=focus_text(list(got.passages))).cache
    want = next(iter(rk.ask(short, q, max_new_tokens=6)))
    assert got.answer.text == want.text and got.answer.token_ids == want.token_ids
    cited = rk.ask_focused(cache, q, passages=2, max_new_tokens=6, cite=True)
    # the quagga paragraph (line 25, after 12 paragraphs of one line and a blank line each) shares
    # "the" and "quagga" with the question; the others share no word, so one passage alone
    [c] = cited.answer.citations
    assert (c.first_line, c.last_line, c.weight, c.text) == (25, 25, 1.0, paras[-1])
    assert doc[c.start : c.end] == paras[-1] and cited.answer.text == want.text
    whole = rk.ask_focused(cache, "zebra?", passages=2, max_new_tokens=6)  # no shared word: the whole cache
    assert whole.passages == () and whole.answer.text == next(iter(rk.ask(cache, "zebra?", max_new_tokens=6))).text
    # the stream (`chat --focus`): the same passages first, then pieces that join to the same answer
    chosen = []
    stream = rk.stream_focused(cache, q, passages=1, max_new_tokens=6, on_chosen=chosen.append)
    pieces = list(stream)
    assert [p.text for p in chosen[0].passages] == [paras[-1]] and chosen[0].answer is None
    assert "".join(pieces) == want.text and stream.answer.token_ids == want.token_ids


def test__ask_focused__cites_source_characters_and_lines_in_a_segmented_cache():
    rk = RocketKV(make_engine("llama", torch.float32))
    paras = [f"line {i} river stone paper light green" for i in range(30)] + ["the quagga sleeps in the north cloud"]
    doc = "   " + "\n\n".join(paras) + "\n"  # leading spaces: characters are the source's, not the decoded text's
    cache = rk.ingest(text=doc, segment_tokens=300).cache
    assert cache.n_segments > 2, "the planted paragraph should sit in a later segment"
    got = rk.ask_focused(cache, "Where does the quagga sleep?", passages=1, max_new_tokens=4, cite=True)
    (c,) = got.answer.citations
    # the quagga paragraph is the 31st: line 61 (one line and one blank line per paragraph before it)
    assert (c.first_line, c.last_line, c.text) == (61, 61, paras[-1])
    assert doc[c.start : c.end] == paras[-1]
    assert got.sources == got.answer.citations  # also without cite=True
    assert rk.ask_focused(cache, "Where does the quagga sleep?", passages=1, max_new_tokens=4).sources == (c,)


def test__ask_focused__decodes_a_caches_text_once_for_many_questions(monkeypatch):
    """The passages of the last cache asked are kept: a second question does not decode its whole
    stored text again (about a second per question on a book); another cache is read anew."""
    import rocketkv_cli.api.rocketkv as api

    rk = RocketKV(make_engine("llama", torch.float32))
    calls = []
    real = api.stored_passages
    monkeypatch.setattr(api, "stored_passages", lambda engine, cache: calls.append(cache) or real(engine, cache))
    one = rk.ingest(text="the quagga sleeps in the north cloud\n\nriver stone paper\n").cache
    two = rk.ingest(text="the zebra runs by the south river\n\nlight and paper\n").cache
    first = rk.ask_focused(one, "Where does the quagga sleep?", passages=1, max_new_tokens=4)
    again = rk.ask_focused(one, "Where does the quagga sleep?", passages=1, max_new_tokens=4)
    other = rk.ask_focused(two, "Where does the zebra run?", passages=1, max_new_tokens=4)
    assert calls == [one, two]
    assert again.passages == first.passages and again.answer.token_ids == first.answer.token_ids
    assert [p.text for p in other.passages] == ["the zebra runs by the south river"]


def test__mixed_and_ranked__by_hand():
    from rocketkv_cli.api.focus import mixed, ranked

    assert mixed([3, 1, 2], [1, 4, 0], 4) == [3, 1, 4, 2]  # 3 (first), 1 (second), 1 again skipped, 4, 2
    assert mixed([], [5, 6], 3) == [5, 6] and mixed([2], [], 2) == [2]
    texts = ["red fox", "blue whale", "green frog", "red whale"]
    attention = [0.1, 0.9, 0.0, 0.5]
    assert ranked(texts, "Where is the red whale?", 2, ranking="attention", attention=attention) == [(1, 0.9), (3, 0.5)]
    # BM25 ranks 3 ("red whale": both words) first, then 0 and 1; attention ranks 1, 3, 0, 2
    got = ranked(texts, "Where is the red whale?", 3, ranking="mixed", attention=attention)
    assert [i for i, _ in got] == [0, 1, 3] and dict(got)[3] == 1.0 and dict(got)[1] == 0.5
    assert [i for i, _ in ranked(texts, "red?", 1, keep_start=True, ranking="attention", attention=attention)] == [0, 1]
    with pytest.raises(UsageError):
        ranked(texts, "red?", 1, ranking="vibes")
    with pytest.raises(UsageError):
        ranked(texts, "red?", 1, ranking="attention")  # no scores


def test__ask_focused_by_attention__the_passage_of_the_best_token_then_as_ask_over_it(monkeypatch):
    """ranking="attention": the passage holding the token the question attends to most (set by hand
    here: a random tiny model attends anywhere) is re-read, and the answer is `ask`'s over its text."""
    from rocketkv_cli.api.focus import QuestionAttention

    rk = RocketKV(make_engine("llama", torch.float32))
    paras = [f"line {i} river stone paper light" for i in range(12)] + ["the quagga sleeps in the north cloud"]
    doc = "\n\n".join(paras) + "\n"
    cache = rk.ingest(text=doc).cache
    q = "Where does the quagga sleep?"
    reader = QuestionAttention(rk.engine, cache)
    real = reader.scores(q, cache)
    assert real.shape == (cache.n_context_tokens,) and torch.isfinite(real).all() and real.max() > 0
    # asked the generic question itself, every query attends as the baseline's did: each layer's share
    # over the baseline's share is b / (b + eps) (`attribution.token_scores`), whatever the model
    from rocketkv_cli.model.templates import read_prompt

    same = reader.scores(read_prompt("probe.txt"), cache)
    base = torch.stack([m / m.sum() for m in reader._baseline.layers.values()])  # [L_full, n]
    want = (base / (base + 0.5 / cache.n_context_tokens)).mean(dim=0)
    assert torch.allclose(same, want, atol=1e-5), f"max error {(same - want).abs().max():.2e}"
    target = cache.token_offsets.tolist().index(doc.index("line 7"))  # a passage sharing no word with q
    fixed = torch.zeros(cache.n_context_tokens)
    fixed[target] = 1.0
    monkeypatch.setattr(QuestionAttention, "scores", lambda self, question, part: fixed)
    got = rk.ask_focused(cache, q, passages=1, max_new_tokens=6, ranking="attention", cite=True)
    assert [p.text for p in got.passages] == [paras[7]]
    (c,) = got.answer.citations
    assert (c.first_line, doc[c.start : c.end]) == (15, paras[7])  # paragraph 8 of one line and a blank each
    want = next(iter(rk.ask(rk.ingest(text=focus_text(list(got.passages))).cache, q, max_new_tokens=6)))
    assert got.answer.token_ids == want.token_ids
    mixed = rk.ask_focused(cache, q, passages=2, max_new_tokens=6, ranking="mixed")
    assert [p.text for p in mixed.passages] == [paras[7], paras[-1]]  # BM25's best and attention's, document order
    # a segmented cache: each part's passages scored by the question over that part (lines of the source)
    book = "".join(f"page {i}: " + doc for i in range(6))
    segmented = rk.ingest(text=book, segment_tokens=300).cache
    assert segmented.n_segments > 2
    late = book.index("line 7", book.index("page 4"))

    def at_late(self, question, part):
        return torch.tensor([float(off == late) for off in part.token_offsets.tolist()])

    monkeypatch.setattr(QuestionAttention, "scores", at_late)
    got = rk.ask_focused(segmented, q, passages=1, max_new_tokens=4, ranking="attention", cite=True)
    (c,) = got.answer.citations
    assert book[c.start : c.end] == paras[7] and c.start <= late < c.end
    with pytest.raises(UsageError, match="unknown focus ranking"):
        rk.ask_focused(cache, q, ranking="vibes")
    # the memo of the last cache asked holds no strong reference to it (a server's LRU can free it)
    import gc
    import weakref

    gone = weakref.ref(segmented)
    del segmented, got
    gc.collect()
    assert gone() is None


def test__passages__lines_end_at_newlines_only_as_the_caches_token_lines_count_them():
    text = "one\ftwo\n\u2028three\n\nfour\x0bfive\n"
    got = [(p.first_line, p.last_line, p.text) for p in passages(text)]
    assert got == [(1, 2, "one\ftwo\n\u2028three"), (4, 4, "four\x0bfive")]
