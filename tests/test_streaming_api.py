"""The Python API's streaming, sessions and sampling (what `ask --stream`, `chat` and
`--temperature` run), on a tiny random model."""

import pytest
from conftest import text_of_bytes

from rocketkv_cli import RocketKV
from rocketkv_cli.errors import InputError

QS = ["What is the code?", "Which word is first?", "Where is the river?"]


@pytest.fixture(scope="module")
def rk(tiny_model_dir):
    return RocketKV.load(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="module")
def cache(rk):
    return rk.ingest(text=text_of_bytes(900) + "\nThe secret code is 4242.\n", token_budget=64, max_new_tokens=40).cache


def test__stream__pieces_arrive_before_the_answer_ends_and_join_to_it(rk, cache):
    stream = rk.stream(cache, QS[0], max_new_tokens=40, temperature=1.5, seed=1)
    pieces = iter(stream)
    first = next(pieces)
    assert stream.answer is None  # still decoding
    rest = list(pieces)
    assert stream.answer is not None and len(rest) >= 1
    assert "".join([first, *rest]) == stream.answer.text
    answer = stream.answer
    assert list(stream) == [] and stream.answer is answer  # read again: nothing more, the answer kept (it was None)


def test__ask_on_text__pieces_of_each_answer_join_to_it(rk, cache):
    pieces: list[str] = []
    for answer in rk.ask(cache, QS, max_new_tokens=40, temperature=1.5, seed=2, on_text=pieces.append):
        assert "".join(pieces) == answer.text
        pieces.clear()


def test__session__answers_as_ask_does_even_after_an_abandoned_answer(rk, cache):
    expected = [a.text for a in rk.ask(cache, QS, max_new_tokens=20)]
    session = rk.session(cache, max_new_tokens=20)
    abandoned = iter(session.stream(QS[2]))
    next(abandoned, None)
    abandoned.close()  # as Ctrl-C in `chat` does: the decoder goes back to the stored context
    assert [session.ask(q).text for q in QS] == expected


@pytest.mark.parametrize(
    "options, says",
    [({"temperature": -1.0}, "temperature"), ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"seed": -3}, "seed"),
     ({"cite": -1}, "--cite")],
    ids=["temperature", "top_p", "seed", "cite"],
)  # fmt: skip
def test__bad_sampling_options__input_errors(rk, cache, options, says):
    with pytest.raises(InputError, match=says):
        list(rk.ask(cache, QS[:1], **options))
    with pytest.raises(InputError, match=says):
        rk.session(cache, **options)


def test__session_over_a_segmented_cache__routes_and_cites_like_ask(rk):
    long = rk.ingest(text=text_of_bytes(3000).replace(" ", "\n", 80), token_budget=64, max_new_tokens=8,
                     segment_tokens=800).cache  # fmt: skip
    expected = [a.to_dict(cache="x") for a in rk.ask(long, QS, max_new_tokens=8, cite=2)]
    session = rk.session(long, max_new_tokens=8, cite=2)
    got = [session.ask(q).to_dict(cache="x") for q in QS]
    drop = lambda row: {k: v for k, v in row.items() if k not in ("prefill_s", "decode_s")}
    assert [drop(r) for r in got] == [drop(r) for r in expected]
    assert all(len(r["segments"]) == 1 and len(r["citations"]) == 2 for r in got)
    with pytest.raises(InputError, match="one segment"):
        rk.session(long, cite=2, segments=2)


def _fresh(rk, cache, question, **options):
    """The answer of a RocketKV that has answered nothing yet (its own decoder, built for it)."""
    return next(iter(RocketKV(rk.engine).ask(cache, question, **options)))


def test__ask__keeps_one_decoder_per_cache_and_answers_as_a_fresh_one(rk, cache):
    """`ask` reuses the decoder (and the question prefix it prefilled) over the cache it last
    answered from, whatever the settings; each answer equals a fresh RocketKV's, also after an
    answer abandoned by an `on_text` that raised (the error kept alive, as a debugger keeps it)."""
    import weakref

    calls = [(QS[0], {"max_new_tokens": 20}), (QS[1], {"max_new_tokens": 8}),
             (QS[2], {"max_new_tokens": 12, "temperature": 1.3, "seed": 5}),
             (QS[0], {"max_new_tokens": 20})]  # fmt: skip
    mine = RocketKV(rk.engine)
    kept = []
    for question, options in calls:
        got = next(iter(mine.ask(cache, question, **options)))
        assert got.token_ids == _fresh(rk, cache, question, **options).token_ids, (question, options)
        kept.append(weakref.ref(mine._kept._kept))
    assert len({id(k()) for k in kept}) == 1 and kept[0]() is not None, "the decoder was built again"

    def fail(piece):
        raise RuntimeError("the consumer failed")

    with pytest.raises(RuntimeError) as failed:
        list(mine.ask(cache, QS[1], max_new_tokens=20, on_text=fail))
    assert failed.value is not None  # the traceback (and its frames) stay alive here
    decoder = mine._kept._kept.decoder  # back at the stored context and the kept prefix, not mid-answer
    assert decoder.position == cache.n_context_tokens + len(rk.engine.question_prefix), decoder.position
    assert next(iter(mine.ask(cache, QS[2], max_new_tokens=20))).token_ids == _fresh(
        rk, cache, QS[2], max_new_tokens=20).token_ids  # fmt: skip
    other = rk.ingest(text=text_of_bytes(700, seed=9), token_budget=64, max_new_tokens=40).cache
    mine.release(other)  # not the one kept: nothing changes
    assert kept[0]() is not None
    del failed  # its frames hold the decoder too
    mine.release(cache)
    assert mine._kept._kept is None and kept[0]() is None, "release left the decoder alive"


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 1e-30])
def test__choose_token__a_tiny_temperature_samples_the_argmax(temperature):
    """logits / 1e-320 overflowed to inf and softmax gave NaN (a RuntimeError in multinomial); the
    limit of a vanishing temperature is the argmax, and so is the sample."""
    import torch

    from rocketkv_cli.engine.answer import Sampling, choose_token

    logits = torch.tensor([[1.5, 7.25, -3.0, 7.0, 0.0]])
    rng = torch.Generator().manual_seed(0)
    picks = {choose_token(logits, Sampling(temperature=temperature, seed=0), rng) for _ in range(20)}
    assert picks == {1}, picks


def test__two_streams_read_in_turn_on_one_model__refused_not_mixed(rk, cache):
    """Two streams (or two sessions' streams) read a piece at a time in turn shared rocketkv's
    attention session, so each step of one attended over the other's cache: tracebacks, then
    answers mixed from both with no error (an adversarial trial). A stream resumed after another
    was decoded is refused now; the model answers as before afterwards. A whole answer read while
    another is paused (nested, as from an on_text) stays fine."""
    from rocketkv_cli.errors import UsageError

    opts = {"max_new_tokens": 12, "temperature": 1.5, "seed": 3}  # sampled: the answers run their 12 tokens
    alone = ["".join(rk.stream(cache, q, **opts)) for q in QS[:2]]
    for make in (lambda q: iter(rk.stream(cache, q, **opts)), lambda q: iter(rk.session(cache, **opts).stream(q))):
        first, second = make(QS[0]), make(QS[1])
        next(first)
        with pytest.raises(UsageError, match="two answers were decoded in turn on one model"):
            for _ in range(12):
                next(second)
                next(first)
    assert ["".join(rk.stream(cache, q, **opts)) for q in QS[:2]] == alone
    pieces, inner = [], []  # a whole answer read while another is paused: its session restored after it
    for piece in rk.stream(cache, QS[0], **opts):
        pieces.append(piece)
        inner.append("".join(rk.stream(cache, QS[1], **opts)))
    assert "".join(pieces) == alone[0] and inner and set(inner) == {alone[1]}
