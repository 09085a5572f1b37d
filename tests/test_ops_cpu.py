"""CPU fast paths (`rocketkv_cli/ops/cpu.py`) against their torch references, and their dispatch."""

import dataclasses

import pytest
import torch
from conftest import make_engine, text_of_bytes

from rocketkv_cli import ops
from rocketkv_cli.core.stage1 import reconstruction_attention as reference
from rocketkv_cli.ops import cpu

pytestmark = pytest.mark.skipif(not cpu.flash_available(), reason="torch has no fused CPU attention op")

# H, Hkv, D, n_context, keys between the context and the appended tokens, appended T, score_from
SHAPES = [
    (9, 3, 64, 700, 0, 300, 20),  # SmolLM2's heads; several query chunks and key blocks
    (4, 1, 256, 130, 0, 37, 5),  # Gemma 3's heads
    (6, 2, 24, 513, 7, 1, 0),  # one appended token, keys after the context that every query sees
    (8, 8, 40, 1, 0, 9, 3),  # no GQA, a context of one token
    (4, 2, 16, 33, 0, 12, 12),  # no query scores (score_from = T)
    (6, 3, 8, 0, 0, 5, 0),  # nothing before the appended tokens
]


def _inputs(h, hkv, d, n, extra, t, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + h * 100 + n)
    length = n + extra + t
    q = torch.randn(1, h, t, d, generator=g) * 2
    k = torch.randn(1, hkv, length, d, generator=g) * 2
    v = torch.randn(1, hkv, length, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("h, hkv, d, n, extra, t, score_from", SHAPES)
def test__reconstruction_attention__equals_the_reference(h, hkv, d, n, extra, t, score_from):
    q, k, v = _inputs(h, hkv, d, n, extra, t)
    scaling = d**-0.5
    out, weights = cpu.reconstruction_attention(q, k, v, n, score_from, scaling, query_chunk_tokens=128,
                                                key_block_tokens=200)  # fmt: skip
    want_out, want_weights = reference(q, k, v, n, score_from, scaling)
    assert out.shape == want_out.shape == (1, h, t, d) and weights.shape == want_weights.shape == (1, h, n)
    err = (out - want_out).abs()
    assert float(err.max()) <= 1e-5, f"output: max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    rel = (weights - want_weights).abs() / want_weights.abs().clamp_min(1e-30)
    if score_from == t or n == 0:
        assert not weights.any()
    else:  # weights span many orders of magnitude: relative error
        assert float(rel.max()) <= 1e-4, (
            f"weights: max relative error {float(rel.max()):.3g}, mean {float(rel.mean()):.3g}"
        )
        # what selection uses: the top keys per head, as index sets
        top = max(1, n // 4)
        got_top, want_top = weights.topk(top, dim=-1).indices, want_weights.topk(top, dim=-1).indices
        for head in range(h):
            assert set(got_top[0, head].tolist()) == set(want_top[0, head].tolist()), f"head {head}"


def test__reconstruction_attention__bfloat16_inputs_give_the_references_dtype_and_values():
    q, k, v = _inputs(9, 3, 64, 200, 0, 40, torch.bfloat16)
    out, weights = cpu.reconstruction_attention(q, k, v, 200, 4, 0.125)
    want_out, want_weights = reference(q, k, v, 200, 4, 0.125)
    assert out.dtype == want_out.dtype == torch.bfloat16 and weights.dtype == want_weights.dtype == torch.float32
    err = (out.float() - want_out.float()).abs()
    assert float(err.max()) <= 2**-7 * float(want_out.float().abs().max()), f"max error {float(err.max()):.3g}"
    assert torch.allclose(weights, want_weights, rtol=1e-4, atol=1e-12)


def test__reconstruction_attention__refuses_shapes_that_do_not_match():
    q, k, v = _inputs(4, 2, 16, 10, 0, 5)
    with pytest.raises(ValueError, match="do not match"):
        cpu.reconstruction_attention(q, k, v, 11, 0, 0.25)  # the context overlaps the appended tokens
    with pytest.raises(ValueError, match="do not match"):
        cpu.reconstruction_attention(q, k, v, 10, 6, 0.25)  # score_from beyond T
    with pytest.raises(ValueError, match="do not match"):
        cpu.reconstruction_attention(q[:, :, :0], k[:, :, :10], v[:, :, :10], 10, 0, 0.25)  # no appended token
    with pytest.raises(ValueError, match="do not match"):
        cpu.reconstruction_attention(q, k, v[..., :8], 10, 0, 0.25)  # values of another head size


def test__dispatch__fast_path_on_cpu_under_auto_reference_otherwise(monkeypatch):
    calls = []
    real = cpu.reconstruction_attention
    monkeypatch.setattr(cpu, "reconstruction_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _inputs(4, 2, 16, 20, 0, 6)
    monkeypatch.delenv("ROCKETKV_KERNELS", raising=False)
    ops.reconstruction_attention(q, k, v, 20, 1, 0.25)
    assert calls == [1]
    ops.reconstruction_attention(q, k, v, 20, 1, 0.25, softcap=30.0)  # softcapping: the reference
    monkeypatch.setenv("ROCKETKV_KERNELS", "torch")
    ops.reconstruction_attention(q, k, v, 20, 1, 0.25)
    assert calls == [1]


def test__dispatch__a_failing_fast_path_falls_back_to_the_reference_for_that_call(monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("the private op changed")

    monkeypatch.setattr(cpu, "reconstruction_attention", broken)
    monkeypatch.delenv("ROCKETKV_KERNELS", raising=False)
    q, k, v = _inputs(4, 2, 16, 20, 0, 6)
    for _ in range(2):  # each call tries the fast path again (an error is not remembered)
        out, weights = ops.reconstruction_attention(q, k, v, 20, 1, 0.25)
        want_out, want_weights = reference(q, k, v, 20, 1, 0.25)
        assert torch.equal(out, want_out) and torch.equal(weights, want_weights)
    assert calls == [1, 1]


def test__dispatch__values_of_another_head_size_take_the_reference(monkeypatch):
    """The fused op needs one head size for keys and values; the reference takes any."""
    monkeypatch.setattr(cpu, "reconstruction_attention", lambda *a, **kw: pytest.fail("fast path called"))
    monkeypatch.delenv("ROCKETKV_KERNELS", raising=False)
    q, k, _ = _inputs(4, 2, 16, 20, 0, 6)
    v = torch.randn(1, 2, 26, 24)
    out, weights = ops.reconstruction_attention(q, k, v, 20, 1, 0.25)
    assert out.shape == (1, 4, 6, 24) and weights.shape == (1, 4, 20)


def test__ingest_with_context_reconstruction__keeps_what_the_reference_keeps(monkeypatch):
    """End to end on a tiny model: the cache built through the fast path keeps the same tokens
    as the one built with `ROCKETKV_KERNELS=torch` (the reference), with the same keys."""
    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.engine.inputs import Document

    engine = make_engine("llama", torch.float32)
    doc = Document(text_of_bytes(900, seed=5), "0" * 64, "d.txt")
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5, observation="reconstruct")
    caches = {}
    for backend in ("auto", "torch"):
        monkeypatch.setenv("ROCKETKV_KERNELS", backend)
        caches[backend] = engine.ingest(doc, dataclasses.replace(cfg))
    fast, ref = caches["auto"], caches["torch"]
    assert fast.n_context_tokens > 4 * 32  # stage 1 really selects
    for a, b in zip(fast.layers, ref.layers, strict=True):
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.keys, b.keys)


@pytest.mark.parametrize("h, hkv, d, t, tail, n, softcap", [(9, 3, 64, 37, 37, 700, None), (4, 1, 256, 5, 9, 130, None),
                                                             (6, 2, 24, 1, 1, 513, 5.0), (8, 8, 40, 12, 12, 1, None),
                                                             (2, 1, 16, 3, 3, 20, 2.0)])  # fmt: skip
def test__question_attention__equals_exact_attention_and_the_question_scores(h, hkv, d, t, tail, n, softcap):
    """One pass over the stored context against the two references: exact attention with the
    position mask over context + tail (the tail's last t tokens the queries', causal), and the
    question scores of the same queries over the context; small blocks of query rows included."""
    from rocketkv_cli.core.attention import exact_attention
    from rocketkv_cli.core.stage1 import question_scores

    g = torch.Generator().manual_seed(h * 1000 + n)
    q = torch.randn(1, h, t, d, generator=g) * 2
    k, v = torch.randn(1, hkv, n + tail, d, generator=g) * 2, torch.randn(1, hkv, n + tail, d, generator=g)
    stored = torch.stack([torch.randperm(3 * n, generator=g)[:n].sort().values for _ in range(hkv)])  # own tokens
    k_pos = torch.cat([stored, torch.arange(3 * n, 3 * n + tail).expand(hkv, tail)], dim=1).unsqueeze(0)  # [1, Hkv, L]
    q_pos = torch.arange(3 * n + tail - t, 3 * n + tail)
    want_out = exact_attention(q, k, v, k_pos, q_pos, d**-0.5, None, softcap)
    want_scores = question_scores(q, k[:, :, :n], d**-0.5, softcap)
    for max_elements in (1 << 24, 3 * (n + tail)):
        out, scores = cpu.question_attention(q, k, v, n, d**-0.5, softcap, max_elements=max_elements)
        assert out.shape == want_out.shape and scores.shape == want_scores.shape == (1, hkv, n)
        for got, want in ((out, want_out), (scores, want_scores)):
            err = (got - want).abs()
            assert float(err.max()) <= 1e-5 * float(want.abs().max()) + 1e-6, (
                f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}")  # fmt: skip


def test__question_attention__refuses_a_tail_shorter_than_the_queries():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 10, 8)
    with pytest.raises(ValueError, match="tail of 3 tokens cannot hold 4 queries"):
        cpu.question_attention(q, k, k, 7, 0.3)
    with pytest.raises(ValueError, match="do not match"):
        cpu.question_attention(q, k, k, 0, 0.3)


def test__question_attention__dispatch_fast_path_on_cpu_under_auto(monkeypatch):
    monkeypatch.delenv("ROCKETKV_KERNELS", raising=False)
    calls = []
    monkeypatch.setattr(cpu, "question_attention", lambda *a, **k: calls.append(1) or (None, None))
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 5, 8)
    ops.question_attention(q, k, k, torch.arange(5).view(1, 1, 5), torch.arange(3, 5), 3, 0.3)
    monkeypatch.setenv("ROCKETKV_KERNELS", "torch")
    out, scores = ops.question_attention(q, k, k, torch.arange(5).view(1, 1, 5), torch.arange(3, 5), 3, 0.3)
    assert calls == [1] and out.shape == (1, 2, 2, 8) and scores.shape == (1, 1, 3)


# B, Hkv, R (query rows per KV head), D, S, dtype, tolerance (logits reach ~±100: float32 rounds at ~1e-5)
KEY_LOGITS_SHAPES = [
    (1, 3, 3, 64, 3537, torch.float32, 2e-4),  # SmolLM2's decode step over its working set
    (1, 3, 114, 64, 701, torch.float32, 2e-4),  # a question's rows
    (2, 2, 5, 24, 129, torch.float32, 2e-4),  # a batch of two, odd sizes
    (1, 1, 4, 256, 1, torch.float32, 2e-4),  # Gemma's heads, one key
    (3, 4, 1, 8, 17, torch.float64, 1e-12),
    (1, 2, 3, 64, 300, torch.bfloat16, 0.25),  # logits of ~±30 at bfloat16's 8 bits
]


@pytest.mark.parametrize("b, hkv, r, d, s, dtype, tol", KEY_LOGITS_SHAPES)
def test__key_logits__equals_the_batched_product_over_sliced_buffers(b, hkv, r, d, s, dtype, tol):
    g = torch.Generator().manual_seed(b * 1000 + s)
    keys = (torch.randn(b, hkv, s + 11, d, generator=g) * 2).to(dtype)[:, :, :s]  # a buffer's first S rows
    query = (torch.randn(b, hkv, r + 2, d, generator=g) * 2).to(dtype)[:, :, 1 : r + 1]
    got = cpu.key_logits(query, keys)
    want = torch.matmul(query.double(), keys.double().transpose(-1, -2))
    assert got.shape == (b, hkv, r, s) and got.dtype == dtype
    err = (got.double() - want).abs()
    assert float(err.max()) <= tol, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


def test__key_logits__refuses_shapes_that_do_not_match():
    with pytest.raises(ValueError, match="do not match"):
        cpu.key_logits(torch.zeros(1, 3, 2, 64), torch.zeros(1, 2, 10, 64))  # KV heads
    with pytest.raises(ValueError, match="do not match"):
        cpu.key_logits(torch.zeros(1, 3, 2, 64), torch.zeros(1, 3, 10, 32))  # head size
