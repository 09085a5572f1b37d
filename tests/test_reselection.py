"""Per-question re-selection (two-level budgets, docs/algorithm.md §4): the file stores a larger
question-agnostic set (`store_budget`); each question chooses its working set of prompt_budget
tokens from it with its own queries, and the next question starts from the whole stored set."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_engine, text_of_bytes

from rocketkv_cli.core.cache import CompressedKVCache, LayerKV
from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import Answerer, decode_config_for
from rocketkv_cli.engine.decoder import Decoder
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.methods.reselect import reselection_for

CFG = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5, store_budget=128)
DOC = Document(text_of_bytes(600, seed=4), "0" * 64, "d.txt")


@pytest.fixture(scope="module")
def engine():
    return make_engine("llama")


@pytest.fixture(scope="module")
def stored(engine):
    return engine.ingest(DOC, CFG)


def _full_layers(engine):
    return [i for i, s in enumerate(engine.shape.layers) if s.sliding_window is None]


def test__store_budget__file_keeps_the_store_budget_and_records_the_working_set(engine, stored):
    from rocketkv_cli.core.config import derive_budgets

    p, n = stored.info.budgets.prompt_budget, stored.n_context_tokens
    n_stored = derive_budgets(
        n, CFG.max_new_tokens, CFG.store_budget, 1
    ).prompt_budget  # the store budget's prompt budget
    assert p < n_stored < n, (p, n_stored, n)
    assert {stored.layers[i].n_kept_tokens for i in _full_layers(engine)} == {n_stored}
    plan = reselection_for(stored)
    assert plan is not None and plan.prompt_budget == p
    plain = engine.ingest(DOC, PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5))
    assert reselection_for(plain) is None
    assert {plain.layers[i].n_kept_tokens for i in _full_layers(engine)} == {p}


def test__config__store_budget_below_the_token_budget_is_refused():
    with pytest.raises(ValueError, match="store_budget must be at least the token budget"):
        PrefillConfig(token_budget=512, store_budget=256)
    with pytest.raises(ValueError, match="store_budget"):
        PrefillConfig(token_budget=512, store_budget=0)
    assert "store_budget" not in PrefillConfig().to_dict()  # files without it read as before


def test__question_narrows_each_layer_to_the_working_set_and_reset_restores_the_store(engine, stored):
    p = stored.info.budgets.prompt_budget
    decoder = Decoder(engine, stored, 300, decode_config_for(stored))
    ids = engine.question_ids("Which letter comes first?")
    with decoder.attention():
        decoder.prefill(ids)
        decoder.decode_one_token(5)
    for i in _full_layers(engine):
        layer = decoder.cache.layers[i]
        assert layer.n_context == p and layer.length == p + len(ids) + 1, (i, layer.n_context, layer.length)
        pos = layer.positions[0, :, :p]
        assert bool((pos[:, 1:] > pos[:, :-1]).all()), "a working set keeps the stored order"
        stored_pos = stored.layers[i].positions[0]
        for h in range(pos.shape[0]):  # every kept token is one of the stored ones
            assert set(pos[h].tolist()) <= set(stored_pos[h].tolist())
    decoder.reset()
    n_prefix, n = len(engine.question_prefix), stored.n_context_tokens
    assert n_prefix >= 2 and ids[:n_prefix] == list(engine.question_prefix)
    for i, layer in enumerate(decoder.cache.layers):
        k, v, pos = layer.view()
        s = stored.layers[i].n_kept_tokens
        assert layer.n_context == s and layer.length == s + n_prefix, "reset keeps the question prefix alone"
        assert torch.equal(k[:, :, :s], stored.layers[i].keys.to(k.dtype))
        assert torch.equal(pos[:, :, :s], stored.layers[i].positions)
        assert torch.equal(pos[0, :, s:], torch.arange(n, n + n_prefix).expand(pos.shape[1], -1))


def _count_tokens(engine):
    """A forward pre-hook counting the input tokens of each model call (a list of counts)."""
    counts: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: counts.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return counts, hook


def test__question_prefix__prefilled_once_and_answers_as_a_fresh_decoder(engine, stored):
    """The framing's question prefix runs once per decoder: the next question runs only its own
    tokens, and its logits, working sets and answer equal a fresh decoder's (whose prefix runs
    then). A prefill that does not start with the prefix drops it and equals a fresh one too."""
    p = len(engine.question_prefix)
    dec = decode_config_for(stored)
    kept = Decoder(engine, stored, 300, dec)
    counts, hook = _count_tokens(engine)
    try:
        for question in ("Which letter comes first?", "Name a letter near the end.", "Is there a z?"):
            ids = engine.question_ids(question)
            fresh = Decoder(engine, stored, 300, dec)
            got = []
            for decoder in (kept, fresh):
                del counts[:]
                with decoder.attention():
                    logits = [decoder.prefill(ids)]
                    logits.append(decoder.decode_one_token(int(logits[0].argmax())))
                work = [decoder.cache.layers[i].positions[0, :, : decoder.cache.layers[i].n_context].clone()
                        for i in _full_layers(engine)]  # fmt: skip
                got.append((torch.cat(logits), work, list(counts)))
                decoder.reset()
            (lk, wk, ck), (lf, wf, cf) = got
            assert cf[:2] == [p, len(ids) - p], cf  # a fresh decoder: the prefix, then the rest
            if question != "Which letter comes first?":
                assert ck[:1] == [len(ids) - p] and p not in ck, f"the kept prefix ran again: {ck}"
            err = (lk - lf).abs()
            assert float(err.max()) == 0.0, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
            assert all(torch.equal(a, b) for a, b in zip(wk, wf)), "working sets differ"
        other = [5, 6, 7, 8]  # ids without the prefix: run whole, from the stored context
        del counts[:]
        with kept.attention():
            a = kept.prefill(other)
        fresh = Decoder(engine, stored, 300, dec)
        with fresh.attention():
            b = fresh.prefill(other)
        assert counts[0] == len(other) and kept.position == stored.n_context_tokens + len(other)
        assert torch.equal(a, b)
    finally:
        hook.remove()


def test__question_prefix__split_prefill_matches_one_forward(engine, stored):
    """The prefix and the rest as two forwards give the logits and the working set of one
    forward over the whole question (to float32 rounding; the same greedy token)."""
    ids = engine.question_ids("Which letter comes first?")
    out = []
    for prefix in (engine.question_prefix, ()):
        decoder = Decoder(engine, stored, 300, decode_config_for(stored))
        decoder.prefix = prefix
        with decoder.attention():
            logits = decoder.prefill(ids)
        out.append((logits, [decoder.cache.layers[i].positions[0, :, : decoder.cache.layers[i].n_context]
                             for i in _full_layers(engine)]))  # fmt: skip
    (a, wa), (b, wb) = out
    err = (a - b).abs()
    assert float(err.max()) < 1e-4, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    assert int(a.argmax()) == int(b.argmax())
    assert all(torch.equal(x, y) for x, y in zip(wa, wb)), "working sets differ"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__long_question__prefilled_in_chunks_as_one_forward(arch, monkeypatch):
    """A question longer than `QUESTION_CHUNK_TOKENS` runs in forwards of at most that many
    tokens (its attention over its own tokens stays linear, an interrupt waits one chunk), with
    the logits, working sets and citation mass of one forward (to float32 rounding: the
    question's attention runs in float32; the mass of the question's last query only, not each
    chunk's last). The later chunks' sliding-window layers attend only the keys some query of the
    chunk can see (`hf.hidden_keys`)."""
    from rocketkv_cli.engine import decoder as decoder_module
    from rocketkv_cli.model import hf
    from rocketkv_cli.model.hf import attention_mass

    engine = make_engine(arch)
    stored = engine.ingest(DOC, CFG)
    ids = engine.question_ids("Which of these letters comes first, and which last? " * 3)
    counts, hook = _count_tokens(engine)
    out = []
    try:
        for chunk, slice_min in ((10_000, 10_000), (13, 8)):  # chunks, and their sliding-window keys sliced
            monkeypatch.setattr(decoder_module, "QUESTION_CHUNK_TOKENS", chunk)
            monkeypatch.setattr(hf, "WINDOW_SLICE_MIN_KEYS", slice_min)
            decoder = Decoder(engine, stored, 300, decode_config_for(stored))
            del counts[:]
            with attention_mass(stored.n_context_tokens + 400, engine.loaded.device) as mass, decoder.attention():
                logits = decoder.prefill(ids)
            work = [decoder.cache.layers[i].positions[0, :, : decoder.cache.layers[i].n_context].clone()
                    for i in _full_layers(engine)]  # fmt: skip
            out.append((logits, work, dict(mass.layers), list(counts), decoder.position))
    finally:
        hook.remove()
    (a, wa, ma, ca, pa), (b, wb, mb, cb, pb) = out
    p = len(engine.question_prefix)
    assert ca == [p, len(ids) - p] and cb[0] == p and len(cb) > 3 and max(cb[1:]) <= 13 and sum(cb) == len(ids), cb
    assert pa == pb == stored.n_context_tokens + len(ids)
    err = (a - b).abs()
    assert float(err.max()) < 1e-5, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    assert int(a.argmax()) == int(b.argmax())
    assert all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True)), "working sets differ"
    assert ma.keys() == mb.keys() and ma
    for i in ma:
        merr = (ma[i] - mb[i]).abs()
        assert float(merr.max()) < 1e-6, f"layer {i}: mass max error {float(merr.max()):.3g}"


def test__long_question__progress_reported_per_chunk_and_a_raising_callback_abandons_it(engine, stored, monkeypatch):
    """`question_progress` hears (0, n) and then each chunk's end; a callback that raises (a
    request whose client left, an interrupt) stops the prefill before the next chunk, and the
    next question answers as from a fresh decoder. A question of one chunk reports nothing."""
    from rocketkv_cli.engine import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "QUESTION_CHUNK_TOKENS", 20)
    ids = engine.question_ids("Which of these letters comes first, and which last? " * 2)
    n = len(ids) - len(engine.question_prefix)
    heard: list[tuple[int, int]] = []
    decoder = Decoder(engine, stored, 300, decode_config_for(stored))
    with decoder_module.question_progress(lambda done, total: heard.append((done, total))), decoder.attention():
        want = decoder.prefill(ids)
    size = -(-n // -(-n // 20))  # chunks of even size, at most 20
    assert size < 20 and heard == [(0, n)] + [(min(n, d), n) for d in range(size, n + size, size)], heard
    decoder.reset()

    class Stop(Exception):
        pass

    def stop_after_two(done: int, total: int) -> None:
        if done >= 2 * size:
            raise Stop

    counts, hook = _count_tokens(engine)
    try:
        with pytest.raises(Stop), decoder_module.question_progress(stop_after_two), decoder.attention():
            decoder.prefill(ids)
    finally:
        hook.remove()
    assert counts == [size, size], counts  # the prefix was kept; two chunks, then the stop
    decoder.reset()
    with decoder.attention():
        assert torch.equal(decoder.prefill(ids), want)
    del heard[:]
    with decoder_module.question_progress(lambda done, total: heard.append((done, total))), decoder.attention():
        decoder.reset()
        decoder.prefill(engine.question_ids("Short?"))
    assert heard == []


@pytest.mark.parametrize("rest", [1, 2])
def test__long_question__no_chunk_of_one_token_is_run_as_a_decode_step(rest, monkeypatch):
    """A question of k chunks and `rest` ids more: the chunks are of even size, so none holds one
    token, which `_attention` would run as a decode step (stage-2 HSA, approximate) instead of
    the question's exact attention: logits as one forward's (a cache without a store budget,
    HSA on every layer). The first version ran a last chunk of one token: 0.07 apart."""
    from rocketkv_cli.engine import decoder as decoder_module

    engine = make_engine("llama")
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    small = engine.ingest(DOC, cfg)
    dec = decode_config_for(small, topk=8, page_size=4)
    assert dec.uses_hsa(32), dec
    ids = engine.question_ids("Which of these letters comes first, and which last? " * 2)
    n = len(ids) - len(engine.question_prefix)
    out = []
    for chunk in (10_000, n - rest):
        monkeypatch.setattr(decoder_module, "QUESTION_CHUNK_TOKENS", chunk)
        decoder = Decoder(engine, small, 300, dec)
        with decoder.attention():
            out.append(decoder.prefill(ids))
    err = (out[0] - out[1]).abs()
    assert float(err.max()) < 1e-5, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


def test__hidden_keys__the_leading_keys_no_query_sees_in_any_head(monkeypatch):
    """Sliding window 4, queries at 9…14: a key is seen by some query when its position is > 5.
    The count is the fewest leading unseen keys over the heads; below the minimum, 0."""
    from rocketkv_cli.model import hf

    monkeypatch.setattr(hf, "WINDOW_SLICE_MIN_KEYS", 3)
    head0 = [0, 1, 2, 3, 4, 9, 10, 11, 12, 13, 14]  # a stored window then a tail: 5 unseen in front
    head1 = [0, 1, 5, 2, 3, 4, 9, 10, 11, 12, 13]  # order does not matter: 6 unseen in front
    head2 = [0, 1, 6, 2, 3, 9, 10, 11, 12, 13, 14]  # 6 is seen (by the query at 9): 2 unseen in front
    q = torch.tensor([9, 10, 11, 12, 13, 14])
    for heads, want in (([head0, head0], 5), ([head1, head1], 6), ([head0, head1], 5), ([head0, head2], 0)):
        assert hf.hidden_keys(torch.tensor([heads]), q, 4) == want, heads  # [1, Hkv, 11]
    monkeypatch.setattr(hf, "WINDOW_SLICE_MIN_KEYS", 6)
    assert hf.hidden_keys(torch.tensor([[head0, head0]]), q, 4) == 0  # 5 < 6: not worth a different sum
    assert hf.hidden_keys(torch.tensor([[head1, head1]]), q, 4) == 6


def test__prefill__no_ids_is_refused(engine, stored):
    decoder = Decoder(engine, stored, 300, decode_config_for(stored))
    with decoder.attention(), pytest.raises(ValueError, match="at least one"):
        decoder.prefill([])


def test__working_set__leaves_the_stored_buffers_unwritten_and_reuses_its_own(engine, stored):
    """A question's working set is gathered beside the stored context (not over it): the stored
    buffers keep their bytes while it is selected, and the next question reuses its buffers."""
    decoder = Decoder(engine, stored, 300, decode_config_for(stored))
    layers = [decoder.cache.layers[i] for i in _full_layers(engine)]
    before = [(layer.keys, layer.keys[:, :, : layer.n_context].clone()) for layer in layers]
    seen = []
    for question in ("Which letter comes first?", "Name a letter near the end."):
        with decoder.attention():
            decoder.prefill(engine.question_ids(question))
            decoder.decode_one_token(5)
        for layer, (buf, content) in zip(layers, before):
            assert layer.keys is not buf and layer.n_context < content.shape[2]
            assert torch.equal(buf[:, :, : content.shape[2]], content), "the stored context was written"
        seen.append([layer.keys.data_ptr() for layer in layers])
        decoder.reset()
        assert all(layer.keys is buf for layer, (buf, _) in zip(layers, before))
    assert seen[0] == seen[1], "the second question allocated new working-set buffers"


def test__questions_stay_independent__q1_then_q2_equals_q2_alone(engine, stored):
    q1, q2 = "What is the first word?", "Name a letter near the end."
    both = Answerer(engine, stored, 8, decode_config_for(stored))
    both.ask(q1)
    second = both.ask(q2)
    alone = Answerer(engine, stored, 8, decode_config_for(stored)).ask(q2)
    assert second.token_ids == alone.token_ids


def test__working_set_keeps_the_key_the_question_attends_to(engine, stored):
    """A key planted in the middle of the stored set of the first full-attention layer along the
    question's queries (layer 0's queries do not depend on the context) is in every KV head's
    working set, though the tail window alone would not choose it."""
    from rocketkv_cli.api.segments import question_queries

    question = "where is the stone?"
    i = _full_layers(engine)[0]
    q = question_queries(engine, question, stored.n_context_tokens)[i]  # [1, H, T, D]
    layers = list(stored.layers)
    keys = layers[i].keys.clone()  # [1, Hkv, S, D]
    group = engine.shape.n_heads // engine.shape.n_kv_heads
    middle = keys.shape[2] // 2
    keys[0, :, middle] = (q[0].view(keys.shape[1], group, q.shape[2], -1).mean(dim=(1, 2)) * 50.0).to(keys.dtype)
    layers[i] = LayerKV(keys, layers[i].values, layers[i].positions)
    planted = CompressedKVCache(stored.info, tuple(layers), stored.token_ids)
    decoder = Decoder(engine, planted, 300, None)
    with decoder.attention():
        decoder.prefill(engine.question_ids(question))
    kept = decoder.cache.layers[i].positions[0, :, : decoder.cache.layers[i].n_context]  # [Hkv, P]
    target = layers[i].positions[0, :, middle]  # [Hkv]
    assert bool((kept == target[:, None]).any(dim=1).all()), "the planted key left some head's working set"
    assert middle >= CFG.n_first_tokens and middle < keys.shape[2] - CFG.window_size  # not kept by position


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__teacher_forced_logits_equal_step_by_step_decode_with_reselection(arch):
    engine = make_engine(arch)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5, store_budget=96)
    stored = engine.ingest(Document(text_of_bytes(500, seed=3), "0" * 64, "d.txt"), cfg)
    assert reselection_for(stored) is not None
    dec = decode_config_for(stored)
    ids = engine.question_ids("Which word comes first?")
    answer = [7, 101, 55, 200, 33, 9]
    decoder = Decoder(engine, stored, 300, dec)
    with decoder.attention():
        steps = [decoder.prefill(ids)[0]]
        assert any(dec.uses_hsa(layer.n_context) for layer in decoder.cache.layers), "HSA must really select"
        for token in answer[:-1]:
            steps.append(decoder.decode_one_token(token)[0])
    decoder.reset()
    forced = decoder.score(ids, answer)
    err = (forced - torch.stack(steps)).abs()
    assert float(err.max()) < 1e-9, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


def test__saved_and_loaded_cache_keeps_the_store_budget(engine, stored, tmp_path):
    from rocketkv_cli.store.format import load_cache, save_cache

    path = tmp_path / "d.kv"
    save_cache(stored, path)
    loaded = load_cache(path)
    assert loaded.info.config.store_budget == CFG.store_budget
    assert reselection_for(loaded) == reselection_for(stored)


# --- context reconstruction (KVzip §3) -----------------------------------------------------------


def test__reconstruction_scores__equal_transformers_own_attention_weights():
    """One chunk: the scores equal, per layer, the max over the re-read document's queries of
    transformers' eager attention weights on the document's keys, summed over each GQA group."""
    from rocketkv_cli.model.templates import read_prompt

    engine = make_engine("llama")  # full attention in every layer
    doc = engine.document_ids(Document(text_of_bytes(150, seed=8), "0" * 64, "d.txt"))
    n = len(doc)
    prefill = engine.prefill(doc, 8, chunk_tokens=4 * n, reconstruct=True)
    request = engine.question_ids(read_prompt("reconstruct.txt"))
    ids = torch.tensor([doc + request + doc])
    with torch.no_grad():
        out = engine.model(input_ids=ids, output_attentions=True, use_cache=False)
    group = engine.shape.n_heads // engine.shape.n_kv_heads
    for i, layer in enumerate(prefill.layers):
        weights = out.attentions[i][0, :, n + len(request) :, :n].float()  # [H, n, n]: re-read queries on the document
        expected = weights.amax(dim=1).view(engine.shape.n_kv_heads, group, n).sum(dim=1)  # [Hkv, n]
        got = layer.reconstruction[0]
        err = (got - expected).abs()
        assert float(err.max()) < 1e-6, f"layer {i}: max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


def test__reconstruction_scores__chunks_attend_the_document_and_themselves_only():
    """Chunked: the scores equal the max over chunks of transformers' eager attention weights,
    each chunk run alone after the document with its own request, and the document's cache is
    left as the prefill made it."""
    from rocketkv_cli.model.templates import read_prompt

    engine = make_engine("llama")
    doc = engine.document_ids(Document(text_of_bytes(200, seed=9), "0" * 64, "d.txt"))
    n, chunk = len(doc), 64
    chunked = engine.prefill(doc, 8, chunk_tokens=chunk, reconstruct=True)
    plain = engine.prefill(doc, 8, chunk_tokens=chunk)
    request = engine.question_ids(read_prompt("reconstruct.txt"))
    group = engine.shape.n_heads // engine.shape.n_kv_heads
    expected = [torch.zeros(engine.shape.n_heads, n, dtype=torch.float64) for _ in chunked.layers]
    for start in range(0, n, chunk):
        ids = torch.tensor([doc + request + doc[start : start + chunk]])
        with torch.no_grad():
            out = engine.model(input_ids=ids, output_attentions=True, use_cache=False)
        for i, att in enumerate(out.attentions):
            expected[i] = torch.maximum(expected[i], att[0, :, n + len(request) :, :n].amax(dim=1))
    for i, (a, b) in enumerate(zip(chunked.layers, plain.layers)):
        want = expected[i].view(engine.shape.n_kv_heads, group, n).sum(dim=1)
        err = (a.reconstruction[0] - want).abs()
        assert float(err.max()) < 1e-6, f"layer {i}: max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
        assert torch.equal(a.keys, b.keys) and torch.equal(a.queries, b.queries)  # the prefill is untouched


def test__reconstruction__re_read_stays_within_the_models_positions():
    """A document near the context limit is re-read in shorter chunks, never past the last
    RoPE position; one that leaves no room is refused with a one-line error."""
    from rocketkv_cli.errors import BudgetError
    from rocketkv_cli.model.templates import read_prompt

    engine = make_engine("llama")
    limit = engine.shape.max_context_tokens
    request = len(engine.question_ids(read_prompt("reconstruct.txt")))
    doc = [65 + i % 26 for i in range(limit - request - 40)]
    seen: list[int] = []
    original = engine.model.forward

    def spy(*args, **kwargs):
        seen.append(int(kwargs["position_ids"].max()))
        return original(*args, **kwargs)

    engine.model.forward = spy
    try:
        engine.prefill(doc, 8, chunk_tokens=512, reconstruct=True)
    finally:
        engine.model.forward = original
    assert max(seen) == limit - 1, (max(seen), limit)
    with pytest.raises(BudgetError, match="no room is left"):
        engine.prefill([65] * (limit - request), 8, chunk_tokens=512, reconstruct=True)


def test__reconstruct_observation__ingests_and_keeps_the_highest_scored_keys(tmp_path):
    from rocketkv_cli.methods import method_for
    from rocketkv_cli.methods.reconstruct import Reconstruction

    engine = make_engine("gemma3_text")  # sliding-window layers too
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=1,
                        observation="reconstruct", n_first_tokens=4)  # fmt: skip
    assert isinstance(method_for(cfg), Reconstruction)
    doc = Document(text_of_bytes(500, seed=5), "0" * 64, "d.txt")
    tokens = engine.document_tokens(doc)
    prefill = engine.prefill(tokens.ids, cfg.window_size, chunk_tokens=128, reconstruct=True)
    stored = engine.compress(prefill, cfg, doc.sha256, doc.source)
    p = stored.info.budgets.prompt_budget
    for i, layer in enumerate(prefill.layers):
        if isinstance(layer, LayerKV):
            continue
        scores = layer.reconstruction[0]  # [Hkv, n]
        n = scores.shape[1]
        kept = stored.layers[i].positions[0]  # [Hkv, P]
        for h in range(scores.shape[0]):
            middle = scores[h, 4 : n - 8]
            top = set((torch.topk(middle, p - 12).indices + 4).tolist()) | set(range(4)) | set(range(n - 8, n))
            assert set(kept[h].tolist()) == top, f"layer {i} head {h}"
    again = engine.ingest(doc, dataclasses.replace(cfg, chunk_tokens=128))
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(again.layers, stored.layers))


def test__segmented_store_budget__merged_segments_reselect_the_chosen_segments_working_sets(engine):
    from rocketkv_cli.api.documents import TextPieces
    from rocketkv_cli.api.segments import answer_segmented, ingest_stream, merge_segments

    stored = ingest_stream(engine, TextPieces(text_of_bytes(1500, seed=6), "book.txt"), CFG, segment_tokens=400)
    assert len(stored.segments) >= 3
    one, two = (stored.segments[j].info.budgets.prompt_budget for j in (0, 1))
    merged = merge_segments(stored, [0, 1])
    assert merged.info.budgets.prompt_budget == one + two
    assert merged.info.budgets.capacity_budget == one + two + CFG.max_new_tokens
    decoder = Decoder(engine, merged, 300, decode_config_for(merged))
    with decoder.attention():
        decoder.prefill(engine.question_ids("Where?"))
    for i in _full_layers(engine):  # two segments' working sets, of the two segments' stored tokens
        assert decoder.cache.layers[i].n_context == one + two < merged.layers[i].n_kept_tokens
    answers = list(answer_segmented(engine, stored, ["Where?"], 4, True, {}, n_segments=2))
    assert len(answers) == 1 and answers[0].segments is not None and len(answers[0].segments) == 2


@pytest.mark.parametrize(
    "g,t,n,softcap,score_from", [(3, 70, 130, None, 9), (1, 300, 41, 30.0, 0), (2, 5, 17, None, 5)]
)
def test__reconstruction_attention__equals_exact_attention_and_the_reference_weights(g, t, n, softcap, score_from):
    """The fused pass (attention output + weights in one softmax) against the two references;
    query chunks (256) split the 300-query case."""
    from rocketkv_cli.core.attention import exact_attention
    from rocketkv_cli.core.stage1 import reconstruction_attention, reconstruction_weights

    torch.manual_seed(t)
    hkv, d, extra = 2, 16, 3  # `extra` tokens between the context and the queries (none of them scored)
    length = n + extra + t
    q = torch.randn(1, hkv * g, t, d, dtype=torch.float64)
    k, v = torch.randn(1, hkv, length, d, dtype=torch.float64), torch.randn(1, hkv, length, d, dtype=torch.float64)
    out, best = reconstruction_attention(q, k, v, n, score_from, 0.3, softcap)
    pos = torch.arange(length).view(1, 1, -1)
    ref = exact_attention(q, k, v, pos, torch.arange(n + extra, length), 0.3, None, softcap)
    err = (out - ref).abs()
    assert float(err.max()) < 1e-6, f"output: max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    scored = q[:, :, score_from:]  # the last t − score_from queries count
    want = reconstruction_weights(scored, k, n, 0.3, softcap) if score_from < t else torch.zeros_like(best)
    err = (best - want).abs()
    assert float(err.max()) < 1e-6, f"weights: max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


def test__preset_defaults__fill_only_the_fields_the_user_did_not_set():
    from rocketkv_cli.core.config import PRESET_PREFILL_DEFAULTS, with_preset_defaults

    base = PrefillConfig(token_budget=256)
    smol = with_preset_defaults(base, "smollm2-135m", ["token_budget"])
    assert (
        (smol.observation, smol.pool_kernel_size)
        == ("reconstruct", 7)
        == tuple(PRESET_PREFILL_DEFAULTS["smollm2-135m"][k] for k in ("observation", "pool_kernel_size"))
    )
    kept = with_preset_defaults(PrefillConfig(token_budget=256, observation="tail"), "smollm2-135m",
                                ["token_budget", "observation"])  # fmt: skip
    assert (kept.observation, kept.pool_kernel_size) == ("tail", 7)
    assert with_preset_defaults(base, "/some/model/dir", []) is base  # other models: the general defaults
    gemma = with_preset_defaults(base, "gemma-3-270m", [])  # docs/frontier.md's default rule
    assert gemma == dataclasses.replace(base, store_budget="all", token_budget=1024)
    assert smol.store_budget == "all" and smol.token_budget == 256  # the budget the user set stays
    assert with_preset_defaults(base, "gemma-3-270m", ["store_budget", "token_budget"]) == base
    small = with_preset_defaults(PrefillConfig(store_budget=512), "gemma-3-270m", ["store_budget"])
    assert (small.store_budget, small.token_budget) == (512, 512)  # t=1024 would exceed the store: it gives way


def test__preset_defaults__a_default_the_users_choice_rules_out_gives_way():
    """The presets store every token (`store_budget` "all"); a user who asks for adaptive layer
    budgets or the sink+recent baseline (neither combines with a store budget) gets them, with
    the file pruned as they asked, instead of an error about an option they never gave."""
    from rocketkv_cli.core.config import with_preset_defaults

    adaptive = with_preset_defaults(PrefillConfig(layer_budgets="adaptive"), "gemma-3-270m", ["layer_budgets"])
    assert adaptive.layer_budgets == "adaptive" and adaptive.store_budget is None
    sink = with_preset_defaults(PrefillConfig(selection="sink_recent"), "smollm2-135m", ["selection"])
    assert sink.selection == "sink_recent" and sink.store_budget is None
    assert (sink.observation, sink.pool_kernel_size) == ("reconstruct", 7)  # the defaults that combine still apply


def test__api_ingest__takes_the_presets_defaults_unless_given(monkeypatch):
    """The Python API fills fields it is not given from `PRESET_PREFILL_DEFAULTS` of its model
    (here a tiny model registered as a preset for the test), and never a field it is given."""
    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.core import config

    engine = make_engine("llama")
    rk = RocketKV(engine)
    monkeypatch.setitem(
        config.PRESET_PREFILL_DEFAULTS, rk.model_id, {"observation": "reconstruct", "pool_kernel_size": 3}
    )
    text = text_of_bytes(400, seed=2)
    got = rk.ingest(text=text, token_budget=32, max_new_tokens=8, window_size=8).cache.info.config
    assert (got.observation, got.pool_kernel_size) == ("reconstruct", 3)
    mine = rk.ingest(text=text, token_budget=32, max_new_tokens=8, window_size=8, observation="tail").cache.info.config
    assert (mine.observation, mine.pool_kernel_size) == ("tail", 3)


@pytest.mark.parametrize("shape", [(1, 3, 50, 8), (2, 2, 17, 5), (1, 1, 9)])
def test__take_rows__equals_gather_along_the_token_axis(shape):
    from rocketkv_cli.model.cache_layer import take_rows

    g = torch.Generator().manual_seed(sum(shape))
    buffer = torch.randn(*shape, generator=g)
    kept = torch.stack([torch.stack([torch.randperm(shape[2], generator=g)[:7].sort().values
                                     for _ in range(shape[1])]) for _ in range(shape[0])])  # fmt: skip
    idx = kept.view(*kept.shape, *([1] * (len(shape) - 3))).expand(*kept.shape, *shape[3:])
    want = buffer.gather(2, idx)
    assert torch.equal(take_rows(buffer, kept), want)
    room = torch.full((*shape[:2], 11, *shape[3:]), float("nan"))  # a working set's buffers, more room than P
    assert torch.equal(take_rows(buffer, kept, out=room[:, :, :7]), want)
    assert torch.equal(room[:, :, :7], want) and bool(room[:, :, 7:].isnan().all())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__question_path__fast_kernels_choose_the_reference_working_sets(arch, monkeypatch):
    """End to end over a decoder: the CPU fast path of a question's attention and scores
    (`ROCKETKV_KERNELS=auto`) chooses the working sets the torch references choose, and gives
    the same first-token logits (to float32 rounding) and greedy answer."""
    engine = make_engine(arch)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5, store_budget=96)
    stored = engine.ingest(Document(text_of_bytes(500, seed=3), "0" * 64, "d.txt"), cfg)
    got = {}
    for backend in ("auto", "torch"):
        monkeypatch.setenv("ROCKETKV_KERNELS", backend)
        answerer = Answerer(engine, stored, 8, decode_config_for(stored))
        decoder = answerer.decoder
        with decoder.attention():
            logits = decoder.prefill(engine.question_ids("Which word comes first?"))
        work = [decoder.cache.layers[i].positions[0, :, : decoder.cache.layers[i].n_context].clone()
                for i in _full_layers(engine)]  # fmt: skip
        decoder.reset()
        got[backend] = (logits, work, answerer.ask("Which word comes first?").token_ids)
    (la, wa, aa), (lt, wt, at) = got["auto"], got["torch"]
    assert all(w.shape[-1] < stored.layers[i].n_kept_tokens for w, i in zip(wa, _full_layers(engine)))
    assert all(torch.equal(x, y) for x, y in zip(wa, wt)), "the fast path chose other working sets"
    err = (la - lt).abs()
    assert float(err.max()) < 1e-4, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    assert aa == at
