"""When an answer ends, and what may be streamed before it ends (rocketkv_cli/engine/stopping.py).

Expected values are worked out by hand from the rules in docs/algorithm.md §4; the streaming
property runs the real byte-level tokenizer of the tests over random token streams."""

import pytest
from conftest import byte_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from rocketkv_cli.engine.stopping import AFTER_TEXT_STOPS, ANSWER_ECHO, AnswerText, AnswerTokens, find_loop, text_units
from rocketkv_cli.model.templates import PLAIN_STOP_STRINGS

STOPS = PLAIN_STOP_STRINGS  # ("\n\n", "\nQuestion:")


@pytest.mark.parametrize(
    "seq, found",
    [
        ([1, 2, 3] * 20, (3, 57)),
        (list(range(30)) + [7] * 48, (1, 47)),
        (list(range(60)), None),
        ([5, 6] * 11, None),
        ([5, 6] * 13, (2, 24)),
        (list(range(40)) * 2, (40, 40)),
        (list(range(40)) * 2 + [0], (40, 41)),
    ],
    ids=["period3", "period1", "no-loop", "too-short", "24-repeated", "one-copy-of-40", "and-one-more"],
)
def test__find_loop__smallest_period_and_repeated_length(seq, found):
    assert find_loop(seq) == found


def test__answer_that_is_the_template__is_cut_to_nothing():
    """issue 17 item 3: the answer was `Question: Write three … line.\\nAnswer:`."""
    raw = "\nQuestion: Write three separate paragraphs about the harbor, each on its own line.\nAnswer:"
    assert AnswerText(raw, STOPS).stop_at() == 0
    assert AnswerText(raw, STOPS).text() == ""
    assert AnswerText(" 5817.\nQuestion:", STOPS).text() == "5817."
    assert AnswerText("\n1. The keeper.", STOPS).stop_at() is None  # a line break, then an answer


def test__a_line_labelled_answer_after_the_answer__is_cut_one_at_its_start_kept():
    """Gemma 3 270M went on from its answer to a line "Answer: " and the same answer again; an
    answer that begins "Answer: …" (no text before it) is kept whole."""
    stops = STOPS + (ANSWER_ECHO,)
    echoed = "A user product is a consumer product.\nAnswer: A user product is a consumer product."
    assert AnswerText(echoed, stops).text() == "A user product is a consumer product."
    assert AnswerText(echoed, ()).text() == echoed  # without the stop: the echo stays
    for kept in ("Answer: Yes, you can.", "Yes.\nThe Answer: you can.", "Yes. Answer: you can."):
        assert AnswerText(kept, stops).text() == kept, kept
    assert AnswerText("  Answer: yes", stops).stop_at() is None  # leading spaces are no text


def test__chat_framing__an_echo_of_the_prompts_question_line_is_cut():
    """A chat model that goes on, after a blank line, to echo its prompt's last line ("…\\n\\nQuestion:
    <the question>", seen with SmolLM2) is cut there; a chat answer keeps its paragraphs, quotes of
    other questions, and a restatement of this one before its answer (those are answers)."""
    from rocketkv_cli.model.templates import prompt_format

    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
    fmt = prompt_format(tok)
    question = "What does GET /health return for a server that is busy?"
    assert fmt.template_id.startswith("chat-") and fmt.before_question.endswith("Question: ")
    stops = fmt.stop_strings + fmt.echo_stops(question)
    echoed = f"A list of settings.\n\nQuestion: {question}\nAnswer: a list."
    assert AnswerText(echoed, stops).text() == "A list of settings."
    kept = [
        "First part.\n\nSecond part.",
        "The FAQ asks:\nQuestion: Can I sell copies?\n\nQuestion: Can I charge a fee?",
        f"Question: {question} Answer: a list.",
        f"A list.\nQuestion: {question}",  # no blank line before it
    ]
    assert [AnswerText(text, stops).text() for text in kept] == kept
    assert prompt_format(byte_tokenizer()).echo_stops(question) == ()  # the plain framing's stops cut echoes
    for odd in ("What  must I provide?", " What must I provide?", "What must\nI provide?"):  # echoed as written
        echo = f"A list.\n\nQuestion: {odd}"
        assert AnswerText(echo, fmt.echo_stops(odd)).text() == "A list.", odd


def test__counting_loop__ends_the_answer_as_written():
    """issue 17 item 3: "1. 2. … 34." ran to the token limit. Units "0", "." repeat with period
    2: found once 24 whole units repeat the two before them; a progression is kept as written
    (whole units: the last one may still grow), not shortened."""
    counting = "  " + " ".join(f"{i}." for i in range(1, 14))
    assert AnswerText(counting, ()).loop_cut() is None  # the last "." may be part of "...": 23 whole units repeat
    assert AnswerText(counting + " 14", ()).loop_cut() == len(counting.lstrip())


def test__loop_of_text__keeps_its_first_copy_to_the_end_of_the_sentence():
    """The GPL answer that looped with its lines wrapped at different words (issue 16)."""
    one = "It is used for the purpose of shipping and receiving goods.  It is owned by the State."  # 19 units
    raw = f"{one}  It is\n  used for the purpose of shipping and receiving"
    assert AnswerText(raw, ()).loop_cut() is None
    raw += "\n  goods.  It is owned by the State.  It is used for the purpose"  # 25 whole units repeated
    cut = AnswerText(raw, ()).loop_cut()
    assert cut is not None and raw[:cut] == one
    poem = "The harbor is a place of beauty. " + "It is a place of fishing, and it is a place of beauty. " * 3
    cut = AnswerText(poem, ()).loop_cut()  # the repeats start at "is a place of beauty", mid-sentence
    assert cut is not None and poem[:cut] == poem[: poem.index("beauty.", 40) + len("beauty.")]


@pytest.mark.parametrize(
    "raw",
    [
        "1. The keeper\n2. The harbor master\n3. The fishing boat\n4. The ferry\n5. The puffin\n6. The lighthouse\n"
        "7. The lantern room\n8. The sea wall\n9. The spring storm\n10. The church hall\n11. The mayor",
        "You may charge any price or no price for each copy that you convey, and you may offer support or "
        "warranty protection for a fee. You may convey a covered work in object code form.",
        "very " * 11,
    ],
    ids=["numbered-list", "prose", "short-repeat"],
)
def test__no_loop_in_ordinary_text(raw):
    assert AnswerText(raw, ()).loop_cut() is None


def test__units__numbers_alike_whitespace_ignored_long_words_in_pieces():
    assert [u[0] for u in text_units("Item 10:\n  item 9.")] == ["item", "0", ":", "item", "0", "."]
    assert [u[0] for u in text_units("ééééééééééééé")] == ["éééééééééééé", "é"]  # 13 letters: 12 + 1


@pytest.mark.parametrize(
    "raw, final",
    [
        ("The code is 4242.\nQues", "The code is 4242"),  # may still become "\nQuestion:"; "." is the last unit
        ("The code is 4242 and", "The code is 4242"),  # the last unit may still grow ("and" → "andante")
        ("The code is 4242. ", "The code is 4242"),
        ("Quest", ""),  # an answer that starts like the template
        ("The code is \ufffd", "The code"),  # an incomplete character
        ("It is a boat. It is a", "It is a boat."),  # "It is" repeats the text 5 units back: held
        ("The", "The"),  # the first word is shown as soon as it is decoded: no loop can cut it
        ("  Yes", "Yes"),
        ("12", "12"),
        ("Question", ""),  # unless it may still become a stop string
        ("The \ufffd", "The"),
        ("ok__", "ok"),  # "_" is no unit: a loop of "ok" may cut right after the first one
    ],
)
def test__final_prefix__holds_back_what_may_change(raw, final):
    assert AnswerText(raw, STOPS).final_prefix() == final


TOKENIZER = byte_tokenizer()
PIECES = ["\n", "\n\n", "Question", ":", " ", "1", "2", "10", ".", " the", " harbor", "Answer", " code", "é", "字", "_",
          "ok"]  # fmt: skip
PIECE_IDS = [TOKENIZER(p, add_special_tokens=False)["input_ids"] for p in PIECES]


TOKENS = st.lists(st.one_of(st.integers(0, len(PIECES) - 1), st.integers(2, 257).map(lambda t: -t)), max_size=40)


@settings(max_examples=400, deadline=None)
@given(TOKENS, TOKENS, st.integers(0, 12), TOKENS, st.sampled_from([STOPS, (), ("\n\n\n",), (ANSWER_ECHO,)]))
def test__streamed_pieces_join_to_the_final_answer(prefix, chunk, repeats, suffix, stops):
    """Whatever the tokens (words, digits, line breaks, stop strings, a chunk repeated into a
    loop, bytes of a character split across tokens), the pieces taken while decoding, joined,
    equal the final text."""
    decode = lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True)
    state, pieces = AnswerTokens(decode, stops), []
    choices = prefix + chunk * repeats + suffix
    stream = [t for c in choices for t in (PIECE_IDS[c] if c >= 0 else [-c])]
    for token in stream:
        reason = state.add(token)
        pieces.append(state.take_final())
        if reason:
            break
    state.finish()
    pieces.append(state.take_final())
    assert "".join(pieces) == state.text()
    assert not any(s in ("\n" + state.text())[s in AFTER_TEXT_STOPS :] for s in stops)


def test__streamed_pieces__a_loop_of_the_first_word_cut_right_after_it():
    """The first unit is shown while it grows, but only the unit: "ok__" streams "ok", because a
    loop of "ok" (the "_" between is no unit) is cut right after the first "ok"."""
    decode = lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True)
    state, pieces = AnswerTokens(decode, STOPS), []
    for text in ["ok", "__"] + [" ok__"] * 30:
        for token in TOKENIZER(text, add_special_tokens=False)["input_ids"]:
            reason = state.add(token)
            pieces.append(state.take_final())
            if reason:
                break
        if reason:
            break
    state.finish()
    pieces.append(state.take_final())
    assert reason == "repetition" and state.text() == "ok" and "".join(pieces) == "ok", (reason, pieces)


def test__an_answer_cut_by_the_length_limit__drops_a_tail_that_begins_a_stop_string():
    """ "5817.\\nQuestion" at --max-new-tokens 8, "5817." at 7 and 9 (from an adversarial trial): a
    tail that is the framing's next "Question:" begun is dropped at the limit, as one more token
    would have stopped there; a line of text that merely starts like it ("Q", "Qu") is kept, and
    without the limit (EOS) the text is as it ends."""
    stops = ("\n\n", "\nQuestion:")
    assert AnswerText("5817.\nQuestion", stops).text_at_limit() == "5817."
    assert AnswerText(" 5817.\nQues", stops).text_at_limit() == "5817."
    assert AnswerText("Options:\nA\nQu", stops).text_at_limit() == "Options:\nA\nQu"
    assert AnswerText("It is red. Question", stops).text_at_limit() == "It is red. Question"  # not at a line start
    assert AnswerText("Question", stops).text_at_limit() == ""  # the whole answer was the stop string's start
    tokens = {1: "5817.", 2: "\n", 3: "Question"}
    state = AnswerTokens(lambda ids: "".join(tokens[i] for i in ids), stops)
    for t in (1, 2, 3):
        assert state.add(t) is None
    shown = state.take_final()
    state.finish(at_limit=True)
    assert shown + state.take_final() == state.text() == "5817."
    eos = AnswerTokens(lambda ids: "".join(tokens[i] for i in ids), stops)
    for t in (1, 2, 3):
        eos.add(t)
    eos.finish()
    assert eos.text() == "5817.\nQuestion"
