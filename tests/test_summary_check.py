"""The summary check (`api/summary_check.py`, issue 37): hand-written inputs, hand-worked results.

Each expected value below is worked out in the comment beside it from the rules in the module's
docstring, so a change of rule fails here.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rocketkv_cli.api import summary_check as sc

PLAIN = "The following is a document.\n\n{document}\n\nSummary:"
QUESTION = "Summarize the document above in a few sentences."
FIFTEEN = "Naomi and Ruth walked from Moab to Bethlehem at the start of the barley harvest together"  # 16 words


@pytest.mark.parametrize(
    "summary, reasons",
    [
        # the Book of Ruth's summary in issue 37: a framing line of summarize_plain.txt, 5 words
        ("The following is a document.", ["echo of the prompt", "under 15 words"]),
        ("Summary:", ["echo of the prompt", "under 15 words"]),  # a 1-word line echoed as a whole line
        # a 7-word prompt sentence inside a longer text (3+ words: contained counts)
        (f"{FIFTEEN}. Question: {QUESTION}", ["echo of the prompt"]),
        # the whole KJV's summary in issue 37: not a prompt line, but its content words (following,
        # summary, following) are all words of the prompts; 9 words
        ("The following is a summary of the following:", ["echo of the prompt", "under 15 words"]),
        # issue 16's GPL summary: content words document above summary document above summary document
        # above, 8 of 8 in the prompts (summary: of PLAIN; document, above: of QUESTION); 18 words
        (
            "The document above is a summary of the document above. It is a summary of the document above.",
            ["echo of the prompt"],
        ),
        ("2Jn1:1", ["under 15 words", "bare reference"]),
        ("1 Cor 15:1-14", ["under 15 words", "bare reference"]),
        ("Ruth1:1; Ruth1:2.\nRuth1:3", ["under 15 words", "bare reference"]),
        (f"{FIFTEEN}.", []),  # 16 words, no prompt line, nothing repeated
        (f"Ruth1:1 {FIFTEEN}.", []),  # a reference with words after it is not bare
        # "summary" alone is a 1-word prompt line: only a whole sentence or line equal to it is an echo
        (f"The summary is short. {FIFTEEN}.", []),
    ],
)
def test__degenerate_reasons__echo_length_reference(summary, reasons):
    assert sc.degenerate_reasons(summary, [PLAIN, QUESTION]) == reasons


def test__degenerate_reasons__echo_when_half_the_content_words_are_the_prompts():
    padding = " of the and to in on at by for with as from into the of and to in on"  # 20 stopwords
    # content words: document, summary (prompt words), naomi, ruth: 2 of 4 = 0.5, an echo
    assert sc.degenerate_reasons("document summary Naomi Ruth" + padding, [PLAIN, QUESTION]) == ["echo of the prompt"]
    # 2 of 5 = 0.4: not one
    assert sc.degenerate_reasons("document summary Naomi Ruth Boaz" + padding, [PLAIN, QUESTION]) == []


def test__degenerate_reasons__repeated_sentence_and_line():
    # "naomi went home" appears twice as a sentence (2+ words): repeated
    text = f"Naomi went home. {FIFTEEN}. Naomi went home."
    assert sc.degenerate_reasons(text, []) == ["repeated sentence"]
    # the same as two lines without full stops (issue 37's "repeated lines")
    assert sc.degenerate_reasons(f"{FIFTEEN}\nAnd the LORD said\nAnd the LORD said", []) == ["repeated sentence"]
    # a 1-word sentence twice is not counted ("Amen." twice, 2+ words needed)
    assert sc.degenerate_reasons(f"Amen. {FIFTEEN}. Amen.", []) == []


def test__degenerate_reasons__a_loop_inside_one_sentence():
    # Jonah's summary by Gemma: an 8-word run ("i will pay the debt that i have") occurs twice
    text = "I will pay the debt that I have made unto the LORD, and I will pay the debt that I have made unto the LORD"
    assert sc.degenerate_reasons(text, []) == ["repeated sentence"]


def test__repeats_a_run__needs_two_non_overlapping_runs_of_eight():
    assert not sc._repeats_a_run(["x"] * 15)  # runs at 0 and 7 overlap
    assert sc._repeats_a_run(["x"] * 16)  # runs at 0 and 8 do not
    assert not sc._repeats_a_run("a b c d e f g h a b c d e f g".split())  # 7 words again, not 8
    assert sc._repeats_a_run("a b c d e f g h a b c d e f g h".split())


def test__under_15_words__boundary():
    assert "under 15 words" in sc.degenerate_reasons(" ".join(["word"] * 14), [])
    assert "under 15 words" not in sc.degenerate_reasons(" ".join(f"w{i}" for i in range(15)), [])


def test__grounding__share_and_names():
    source = "Naomi and Ruth went to Bethlehem in the spring."
    g = sc.grounding("Ruth went to Bethlehem with Orpah in winter", source)
    # content words: ruth went bethlehem orpah winter (to, with, in are stopwords); 3 of 5 in the source
    assert g.share == pytest.approx(0.6) and g.n_content_words == 5
    assert g.missing_words == ("orpah", "winter")
    # names (capitalised, not at a sentence start): Bethlehem, Orpah; Orpah is not in the source
    assert g.missing_names == ("Orpah",) and not g.passed


def test__grounding__passes_at_exactly_nine_of_ten():
    source = "alpha beta gamma delta epsilon zeta eta theta iota"
    g = sc.grounding("alpha beta gamma delta epsilon zeta eta theta iota kappa", source)  # kappa is missing: 9/10
    assert g.share == pytest.approx(0.9) and g.passed
    g = sc.grounding("alpha beta gamma delta epsilon zeta eta theta kappa lambda", source)  # 8/10
    assert g.share == pytest.approx(0.8) and not g.passed


def test__grounding__a_name_must_be_spelled_as_in_the_source():
    # every word is in the source lower-cased, but "Lord" (mid-sentence) never appears so spelled
    g = sc.grounding("and the Lord spoke", "the LORD spoke")
    assert g.share == 1.0 and g.missing_names == ("Lord",) and not g.passed
    assert sc.grounding("and the LORD spoke", "the LORD spoke").passed


def test__grounding__no_content_words_is_zero():
    assert sc.grounding("and the of", "the").share == 0.0


def test__document_names__capitalised_not_sentence_initial_only():
    # Abel: 3 times, always capitalised, inside sentences; Cain: 2 times; River: 1 of 2 capitalised;
    # Suddenly: capitalised but only where a sentence starts; Then: a stopword
    text = "Then Abel met Cain. Abel saw the River. the river was cold. Suddenly Cain left Abel."
    assert sc.document_names(text) == ["Abel", "Cain"]


def test__document_names__ninety_percent_capitalised():
    # Gog: 9 of 10 capitalised = 0.90, a name; Magog: 8 of 9 = 0.89, not one
    text = " ".join(["x Gog"] * 9 + ["x gog"] + ["y Magog"] * 8 + ["y magog"])
    assert sc.document_names(text) == ["Gog"]


def test__document_names__frequency_order_ties_by_first_seen_and_spelling():
    # Zed 3, Bo 2, Al 2 (Bo seen first); LORD: 2 as LORD, 1 as Lord, so spelled LORD, 3 in all
    text = "x Bo x Al x Zed x Zed x Bo x Al x Zed x LORD x LORD x Lord"
    assert sc.document_names(text) == ["Zed", "LORD", "Bo", "Al"]
    assert sc.document_names(text, top=2) == ["Zed", "LORD"]


def test__document_names__references_and_addresses_are_not_words():
    # "Ruth1" is part of a reference, and "Now" follows one, so it starts a sentence there
    assert sc.document_names("Ruth1:1 Now Boaz came.\nRuth1:2 Now Boaz went.") == ["Boaz"]
    # gnu in www.gnu.org is not an occurrence, so GNU is capitalised 2 of 2 times
    assert sc.document_names("see www.gnu.org and the GNU site, the GNU rules.") == ["GNU"]


def test__coverage__five_of_the_names_or_all_when_fewer():
    source = "x Ann x Ben x Cal x Dan x Eve x Fay x Ann"  # names: Ann (2), Ben, Cal, Dan, Eve, Fay
    c = sc.coverage("Then Ann, Ben, Cal, Dan and Eve met.", source)
    assert c.required == 5 and c.named == ("Ann", "Ben", "Cal", "Dan", "Eve") and c.passed
    c = sc.coverage("Then Ann, Ben, Cal and Dan met; eve did not.", source)  # eve lower-cased: not named
    assert c.named == ("Ann", "Ben", "Cal", "Dan") and not c.passed
    c = sc.coverage("Ann met Ben.", "x Ann x Ben x Cal")  # only 3 names: all 3 are required
    assert c.required == 3 and not c.passed
    assert sc.coverage("Ann met Ben and Cal.", "x Ann x Ben x Cal").passed


def test__check_summary__passes_only_when_all_three_pass():
    source = "x Ann x Ben x Cal x Dan x Eve went home to the river by the hill."
    good = "So Ann, Ben, Cal, Dan and Eve went home to the river by the hill, and went home again."
    result = sc.check_summary(good, source, [PLAIN])
    assert result.degenerate == () and result.grounding.passed and result.coverage.passed and result.passed
    row = result.to_dict()
    assert row["passed"] is True and row["grounding"] == 1.0 and row["named"] == ["Ann", "Ben", "Cal", "Dan", "Eve"]
    short = sc.check_summary("Ann, Ben, Cal, Dan and Eve went home.", source, [PLAIN])  # 7 words
    assert short.degenerate == ("under 15 words",) and not short.passed


def test__split_sentences__references_removed_and_lines_joined():
    kjv = "Ge1:1 In the beginning God created the heaven.\nGe1:2 And the earth was void. And dark."
    assert sc.split_sentences(kjv) == [
        "In the beginning God created the heaven.",
        "And the earth was void.",
        "And dark.",
    ]
    gpl = 'This License\n  applies to any "program". It is free.\n\nTERMS AND CONDITIONS\n\ne.g. not split'
    assert sc.split_sentences(gpl) == ['This License applies to any "program".', "It is free.", "TERMS AND CONDITIONS",
                                       "e.g. not split"]  # fmt: skip


CATS = ("The cat sat on the mat. The cat ate the fish near the mat. A cat and a mat are here. "
        "Stocks fell sharply in Tokyo today.")  # fmt: skip


def test__extract_sentences__tf_idf_centrality_in_document_order():
    # N = 4; idf(cat) = idf(mat) = ln(1 + 4/3) = 0.847, every other content word ln(5) = 1.609.
    # Whole-text vector: cat, mat 3 × 0.847 = 2.542; 9 other words 1.609 each; norm 6.020.
    # cosines: sat-on-mat 6.898 / (2.007 × 6.020) = 0.571; ate-fish 12.078 / (3.034 × 6.020) = 0.661;
    # cat-and-mat 4.308 / (1.198 × 6.020) = 0.597; stocks 12.952 / (3.599 × 6.020) = 0.598.
    assert sc.extract_sentences(CATS, 1) == ["The cat ate the fish near the mat."]
    # the top 3 leave out the sat-on-mat sentence, and come back in document order
    assert sc.extract_sentences(CATS, 3) == ["The cat ate the fish near the mat.", "A cat and a mat are here.",
                                             "Stocks fell sharply in Tokyo today."]  # fmt: skip


def test__extract_sentences__skips_short_and_repeated_sentences():
    text = CATS + " Cat mat cat. The cat ate the fish near the mat."  # a 3-word sentence; a repeat
    out = sc.extract_sentences(text, 3)
    assert "Cat mat cat." not in out and len(out) == 3 and len(set(out)) == 3
    assert sc.extract_sentences("Cat mat. Dog.", 3) == ["Cat mat.", "Dog."]  # too few of 6+ words: all of them


def test__extract_sentences__prefers_whole_sentences_to_clauses_that_lead_on():
    # The GPL's "… in one of these ways:" (its list follows) was extracted beside an unrelated
    # sentence; a KJV verse ending in ":" or ";" leads into the next verse the same way.
    lead = "You may convey the cat and the fish and the mat in one of these ways:"  # the most central
    text = (lead + "\n\n" + CATS + "\n\nThe cat may keep the fish on the mat; "
            "\n\nThe dog barked at the cat on the mat all day long.")  # fmt: skip
    assert sc.extract_sentences(lead + "\n\n" + CATS, 1) == ["The cat ate the fish near the mat."]
    out = sc.extract_sentences(text, 3)
    assert all(s[-1] in ".!?" for s in out), out
    # ended by a closing quote or bracket still ends a sentence; too few whole sentences: all candidates
    quoted = 'He said "the cat ate the fish near the mat."'
    assert sc.extract_sentences(quoted, 1) == [quoted]
    clause = "The cat and the fish and the mat and more:"
    assert sc.extract_sentences(clause, 1) == [clause]


def test__extract_sentences__a_paragraph_without_full_stops_is_cut_at_60_words():
    listing = " ".join(f"item{i} river" for i in range(40))  # letter words: item (digits split it), river: 80
    (out,) = sc.extract_sentences(listing)
    assert out == " ".join(f"item{i} river" for i in range(30)) + " …"  # 60 letter words: 30 pairs


def test__extract_sentences__three_to_five_by_default():
    many = " ".join(f"Sentence number {i} tells of the river and the stone {i}." for i in range(200))
    assert len(sc.extract_sentences(many)) == 5  # 200 / 25 = 8, kept at most 5
    assert (
        len(sc.extract_sentences(". ".join(many.split(". ")[:10]) + ".")) == 3
    )  # 10 / 25 rounds to 0, kept at least 3
    assert sc.extract_sentences("") == []


STORY = (
    "Every morning the baker sold bread and cakes to the village by the river. "  # central, no names
    "Every morning the baker sold bread and cakes to the people of the river village. "
    "The baker sold bread and cakes by the river every morning of the year. "
    "Then Mara and Tobin came from Kesh with Olwen to buy bread from the baker. "  # four names
    "Later Mara met Brannock at the river and they sold cakes together. "  # a fifth name, and Mara again
    "Mara said the bread of the baker was the best bread by the river. "
    "Tobin told Olwen that the cakes were sold out by the river. "
    "Brannock and Kesh and Olwen and Mara and Tobin were all named here once more for counting. "
)


def test__extract_sentences__default_adds_the_sentences_that_name_the_main_names():
    names = sc.document_names(STORY)
    assert set(names) >= {"Mara", "Tobin", "Olwen", "Brannock", "Kesh"}  # 5 required
    central = sc.extract_sentences(STORY, 3)  # exactly 3 when n is given: no coverage step
    assert not sc.coverage(" ".join(central), STORY).passed
    out = sc.extract_sentences(STORY)
    assert sc.coverage(" ".join(out), STORY).passed, out
    assert set(central) <= set(out) and len(out) == 4  # the central ones stay; one sentence names all five
    assert out == [s for s in sc.split_sentences(STORY) if s in out]


# Twelve parts of a long document, each summarized by one sentence of its own topic (6+ words) and
# one too short to be a candidate.
TOPICS = ["apples", "boats", "candles", "drums", "eagles", "ferns", "glass", "harps", "inks", "jars", "kites", "looms",
          "maps"]  # fmt: skip
PARTS = [f"The makers of {t} worked all winter on the {t} of the town. Short {t}." for t in TOPICS]


def test__outline_sentences__one_stretch_after_another_in_order():
    out = sc.outline_sentences(PARTS[:12], [], groups=12)  # 12 stretches: 1 sentence each (ceil(4 / 12))
    assert out == [f"The makers of {t} worked all winter on the {t} of the town." for t in TOPICS[:12]], out
    two = sc.outline_sentences(PARTS[:4], [], groups=2)  # 2 stretches of 2 parts: ceil(4 / 2) = 2 each
    assert two == [f"The makers of {t} worked all winter on the {t} of the town." for t in TOPICS[:4]], two
    thirteen = sc.outline_sentences(PARTS, [], groups=12)  # 13 parts in 12 stretches: one holds two parts
    assert len(thirteen) == 12 and thirteen == sorted(thirteen, key=lambda s: TOPICS.index(s.split()[3]))
    assert sc.outline_sentences(["", "…"], []) == []


def test__outline_sentences__no_repeat_across_parts():
    same = "The makers of bells worked all winter on the bells of the town."
    out = sc.outline_sentences([same, same + " Then the fair came to the valley with music and lanterns."], [])
    assert out == [same, "Then the fair came to the valley with music and lanterns."], out


def test__outline_sentences__names_from_the_parts_texts_when_the_summaries_lack_them():
    names = ["Anna", "Boris", "Clara", "Dmitri", "Elena"]
    summaries = [
        "In the spring Anna planted the orchard above the river.",
        "The orchard gave fruit in the autumn rains.",
    ]
    texts = ["In the spring Anna planted the orchard above the river. Boris and Clara carried water up the hill.",
             "Dmitri pressed the apples. Dmitri pressed the apples in the old mill. "  # the short one: no candidate
             "Elena sold the cider at the market in town. The autumn rains came."]  # fmt: skip
    assert not sc.coverage(" ".join(sc.outline_sentences(summaries, names)), " ".join(texts), names).passed
    out = sc.outline_sentences(summaries, names, texts)
    assert sc.coverage(" ".join(out), " ".join(texts), names).passed, out
    assert out == [summaries[0], "Boris and Clara carried water up the hill.", summaries[1],
                   "Dmitri pressed the apples in the old mill.",
                   "Elena sold the cider at the market in town."], out  # fmt: skip


def _sentence_starts_by_definition(text: str) -> list[tuple[str, bool]]:
    """`_tokens`'s docstring, read literally: strip the openers off everything before the word,
    then look at the last character left (quadratic; the module's version must agree)."""
    text = sc.REFERENCE.sub("\n", sc.URL.sub(" ", text))
    out = []
    for m in sc._LETTERS.finditer(text):
        before = text[: m.start()].rstrip(sc._OPENERS)
        out.append((m.group(), not before or before[-1] in ".!?\n"))
    return out


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab Z.!?\n\t\"'“‘([1:é")), max_size=60))
def test__tokens__starts_sentences_as_the_docstring_says(text):
    assert sc._tokens(text) == _sentence_starts_by_definition(text)


def test__tokens__hand_worked_starts():
    # "Hello" starts the text (after an opening quote); "world" follows a space; "Yes" follows ". (";
    # "x" follows a quote after a space; "Z" a line break and openers; "a" a tab after "Z)": not a start
    text = '"Hello" world. (Yes\' x\n  (Z) \t"a'
    assert sc._tokens(text) == [("Hello", True), ("world", False), ("Yes", True), ("x", False), ("Z", True),
                                ("a", False)]  # fmt: skip


@pytest.mark.parametrize("text, kept", [
    ("Mail john@x.com now", "Mail   now"),
    ("Mail <john@x.com>, now", "Mail   now"),
    ("Name<john@x.com> wrote", "  wrote"),
    ("Write to (jane.doe@x.org) today", "Write to   today"),
    ("see http://x.com/a. Then www.gnu.org/licenses/ ok", "see   Then   ok"),
    ("contact:bob@y.io.", " "),
    ("no address @ here or a@b", "no address @ here or a@b"),
])  # fmt: skip
def test__url__links_and_addresses_removed(text, kept):
    assert sc.URL.sub(" ", text) == kept


def test__a_long_word_without_spaces__checked_in_linear_time():
    """A base64 blob (or minified code) summarized: the address pattern matched from every
    character of a word, so 100 KB took seconds and 2 MB hours (an adversarial trial). A 1 MB word,
    and 1 MB of words holding an @ each, now take well under a second; the bound here is loose."""
    import base64
    import random
    import time

    blob = base64.b64encode(random.Random(0).randbytes(750_000)).decode()  # 1 MB, no spaces
    minified = json.dumps([{"id": i, "name": f"n{i}", "tags": ["a", "b"]} for i in range(25_000)], separators=",:")
    for text in (blob, minified, "(" * 200_000, "'<[" * 100_000, "ab@cd" * 200_000, "x." * 500_000 + "@"):
        started = time.perf_counter()
        sc.URL.sub(" ", text)
        sc.document_names(text)
        assert time.perf_counter() - started < 10, len(text)  # quadratic: hours


@pytest.mark.parametrize("text, sentences", [
    ("Москва большая. Город красивый. Я люблю его.", ["Москва большая.", "Город красивый.", "Я люблю его."]),
    ("北京是首都。上海很大。广州在南方！", ["北京是首都。", "上海很大。", "广州在南方！"]),
    ("Il fait beau. École fermée. « Oui », dit-il.", ["Il fait beau.", "École fermée.", "« Oui », dit-il."]),
    ("The code is 5. It works. e.g. this stays", ["The code is 5.", "It works. e.g. this stays"]),
])  # fmt: skip
def test__split_sentences__non_latin_and_accented_sentences_end_too(text, sentences):
    """A sentence ended only before an ASCII capital or digit: Russian, Chinese and French text with
    an accented capital was one "sentence", so a summary of it was its first words cut off with " …"
    or the whole document verbatim (an adversarial trial)."""
    assert sc.split_sentences(text) == sentences


def test__a_log_without_sentences__is_not_said_to_hold_no_words():
    """`summarize` of a log (lines without . ! ?, repeating each other) said "it holds no words";
    the reason is said now. A text of no words still says so."""
    from rocketkv_cli.api.summaries import extracted_sentences
    from rocketkv_cli.errors import InputError

    log = "\n".join(f"2026-12-07 10:{i:02d} WARN disk usage high on node0 retrying backup job" for i in range(60))
    with pytest.raises(InputError, match=r"no \. ! \? ends its text, or each part repeats the words around it"):
        extracted_sentences(log)
    with pytest.raises(InputError, match=r"it holds no words"):
        extracted_sentences("123 456 --- ...")
