"""Stage 2 (HSA) against a slow loop reference on random data with odd shapes (docs/algorithm.md §3)."""

import math

import pytest
import torch

from rocketkv_cli.core.attention import exact_attention
from rocketkv_cli.core.stage2 import hsa_decode, page_summaries


def loop_hsa(q, k, v, topk, page, r, scaling):
    """Direct transcription of docs/algorithm.md §3 with Python loops over heads, pages and tokens (float64)."""
    b, h, _, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    out = torch.zeros(b, h, 1, d, dtype=torch.float64)
    selected = []
    for kv in range(hkv):
        qs = [q[0, kv * g + gi, 0].double() for gi in range(g)]
        keys = k[0, kv].double()
        absum = sum(x.abs() for x in qs)
        dims = sorted(range(d), key=lambda i: -float(absum[i]))[:r]
        n_pages = math.ceil(s / page)
        probs = torch.zeros(n_pages, dtype=torch.float64)
        for qg in qs:
            tau = math.sqrt(d * sum(abs(float(qg[i])) for i in dims) / float(qg.abs().sum()))
            logits = []
            for p in range(n_pages):
                tokens = keys[p * page : (p + 1) * page]
                score = 0.0
                for i in dims:
                    sign = float(sum(x[i] for x in qs))
                    bound = tokens[:, i].max() if sign > 0 else tokens[:, i].min()
                    score += float(qg[i]) * float(bound)
                logits.append(score / tau + math.log(len(tokens)))
            probs += torch.softmax(torch.tensor(logits, dtype=torch.float64), 0) / g
        if s <= topk:
            chosen = list(range(s))
        else:
            n_sel = min(n_pages, max(1, topk // page))
            pages = sorted(range(n_pages), key=lambda p: -float(probs[p]))[:n_sel]
            chosen = sorted(t for p in pages for t in range(p * page, min(s, (p + 1) * page)))
        selected.append(set(chosen))
        for gi, qg in enumerate(qs):
            w = torch.softmax(keys[chosen] @ qg * scaling, 0)
            out[0, kv * g + gi, 0] = w @ v[0, kv, chosen].double()
    return out, selected


CASES = [  # (group, head_dim, S, topk, page_size, n_score_dims)
    (1, 64, 97, 24, 3, 20),
    (3, 60, 101, 30, 4, 17),
    (7, 64, 63, 16, 5, 64),
    (3, 64, 1000, 128, 3, 60),
    (7, 60, 40, 64, 2, 9),  # cache shorter than topk: exact
]


@pytest.mark.parametrize(
    "g, d, s, topk, page, r", CASES, ids=[f"G{c[0]}-D{c[1]}-S{c[2]}-k{c[3]}-p{c[4]}" for c in CASES]
)
def test__hsa_decode__selection_and_output_equal_loop_reference(g, d, s, topk, page, r):
    torch.manual_seed(g * 1000 + s)
    hkv = 2
    q = torch.randn(1, hkv * g, 1, d)
    k, v = torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)
    pmin, pmax = page_summaries(k, page)
    out, idx = hsa_decode(q, k, v, pmin, pmax, topk, page, r, scaling=d**-0.5)
    ref_out, ref_sel = loop_hsa(q, k, v, topk, page, r, d**-0.5)
    for kv in range(hkv):
        got = {int(i) for i in idx[0, kv] if i < s}
        assert got == ref_sel[kv], f"KV head {kv}: selection differs"
        assert len(got) <= max(topk, page)
    err = (out.double() - ref_out).abs()
    assert err.max() < 1e-4, f"max err {err.max():.3g} mean {err.mean():.3g}"


def test__hsa_decode__all_pages_selected_equals_exact_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 1, 32), torch.randn(1, 2, 50, 32), torch.randn(1, 2, 50, 32)
    pmin, pmax = page_summaries(k, 5)
    out, idx = hsa_decode(q, k, v, pmin, pmax, topk=49 + 5, page_size=5, n_score_dims=8, scaling=0.2)
    pos = torch.arange(50).view(1, 1, 50).expand(1, 2, 50)
    ref = exact_attention(q, k, v, pos, torch.tensor([50]), 0.2)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("s, page", [(10, 3), (9, 3), (1, 4), (97, 7)])
def test__page_summaries__min_max_of_each_page(s, page):
    k = torch.randn(1, 2, s, 6)
    pmin, pmax = page_summaries(k, page)
    assert pmin.shape == (1, 2, math.ceil(s / page), 6)
    for p in range(pmin.shape[2]):
        chunk = k[:, :, p * page : (p + 1) * page]
        assert torch.equal(pmin[:, :, p], chunk.amin(2)) and torch.equal(pmax[:, :, p], chunk.amax(2))


def test__context_pages__summarise_the_stored_context_only_and_are_built_once():
    from rocketkv_cli.model.hf import RocketLayer

    k = torch.randn(1, 2, 23, 8)
    layer = RocketLayer(k, k.clone(), torch.arange(23).view(1, 1, 23).expand(1, 2, 23).clone(), extra_tokens=4)
    pmin, pmax = layer.context_pages(4)
    ref_min, ref_max = page_summaries(k, 4)
    assert torch.equal(pmin, ref_min) and torch.equal(pmax, ref_max)
    layer.append(torch.full((1, 2, 3, 8), 99.0), torch.zeros(1, 2, 3, 8), torch.arange(23, 26))
    again = layer.context_pages(4)
    assert again[0] is pmin and float(again[1].max()) < 99.0  # the tail never enters the summaries


@pytest.mark.parametrize("n_context, tail, sinks", [(97, 5, 4), (200, 0, 4), (60, 3, 0), (40, 2, 4)])
def test__context_selection__sinks_and_tail_always_no_duplicates(n_context, tail, sinks):
    from rocketkv_cli.core.stage2 import context_selection

    torch.manual_seed(n_context)
    q = torch.randn(1, 6, 1, 16)
    keys = torch.randn(1, 2, n_context + tail, 16)
    pmin, pmax = page_summaries(keys[:, :, :n_context], 3)
    idx = context_selection(q, pmin, pmax, n_context, n_context + tail, 24, 3, 8, sinks)  # [1, 2, N]
    for h in range(2):
        real = [int(i) for i in idx[0, h] if i < n_context + tail]
        assert len(real) == len(set(real)), "a token attended twice"
        assert set(range(n_context, n_context + tail)) <= set(real), "the tail is always attended"
        assert set(range(min(sinks, n_context))) <= set(real), "the sinks are always attended"
        ctx = [i for i in real if i < n_context]
        assert len(ctx) <= 24 + 3 * -(-sinks // 3) or n_context <= 24 + 3 * -(-sinks // 3)


def test__context_selection__is_hsa_over_the_context_plus_the_tail():
    """With no sinks and no tail, the context selection is `select_pages` of the page scores."""
    from rocketkv_cli.core.stage2 import context_selection, page_scores, page_token_counts, select_pages

    torch.manual_seed(1)
    q, keys = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 90, 16)
    pmin, pmax = page_summaries(keys, 3)
    ours = context_selection(q, pmin, pmax, 90, 90, 30, 3, 9, 0)
    ref = select_pages(page_scores(q, pmin, pmax, page_token_counts(90, 3), 9), 30, 3)
    assert [set(ours[0, h].tolist()) for h in range(2)] == [set(ref[0, h].tolist()) for h in range(2)]


@pytest.mark.parametrize("arch, weights", [("llama", "float"), ("gemma3_text", "float"), ("llama", "bf16"),
                                           ("gemma3_text", "int8")])  # fmt: skip
def test__teacher_forced_logits__equal_step_by_step_decode(arch, weights):
    """Teacher forcing (`Decoder.score`) gives the logits decode gives at every answer position,
    HSA selecting: float64 to 1e-9 (the two paths differ only in batched vs single matmuls);
    with weight-only formats (decode's weights in both, `decode_step`) to float32 rounding of
    the logits (1e-5 of the largest; measured 2e-7 of 0.8)."""
    from conftest import make_engine, text_of_bytes

    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.engine.answer import decode_config_for
    from rocketkv_cli.engine.decoder import Decoder
    from rocketkv_cli.engine.inputs import Document
    from rocketkv_cli.model.weights import quantize_weights

    engine = make_engine(arch)  # float64: the two paths' only difference is batched vs single matmuls
    quantize_weights(engine.model, weights)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(500, seed=3), "0" * 64, "d.txt"), cfg)
    dec = decode_config_for(stored)
    assert any(dec.uses_hsa(layer.n_kept_tokens) for layer in stored.layers), "HSA must really select"
    ids = engine.question_ids("Which word comes first?")
    answer = [7, 101, 55, 200, 33, 9]
    decoder = Decoder(engine, stored, 300, dec)
    with decoder.attention():
        steps = [decoder.prefill(ids)[0]]
        for token in answer[:-1]:
            steps.append(decoder.decode_one_token(token)[0])
    decoder.reset()
    forced = decoder.score(ids, answer)
    stepwise = torch.stack(steps)
    err = (forced - stepwise).abs()
    tol = 1e-9 if weights == "float" else 1e-5 * float(stepwise.abs().max())
    assert float(err.max()) < tol, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


def test__decode_config_for__a_topk_below_the_stored_page_caps_the_page():
    """`ask --topk 1` on a cache whose pages hold 2 tokens: pages of 1 token (as ingest derives
    them under --topk), not an error naming a --page-size the user never typed; a page size given
    with it is checked as given."""
    from conftest import make_engine, text_of_bytes

    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.engine.answer import decode_config_for
    from rocketkv_cli.engine.inputs import Document

    engine = make_engine("llama")
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(3000, seed=3), "0" * 64, "d.txt"), cfg)
    assert stored.info.budgets.page_size > 1, stored.info.budgets
    dec = decode_config_for(stored, topk=1)
    assert (dec.topk, dec.page_size) == (1, 1)
    with pytest.raises(ValueError, match="page_size must not exceed topk"):
        decode_config_for(stored, topk=1, page_size=2)
