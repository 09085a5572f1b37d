"""Stage 1 (SnapKV++) against brute-force loop references (docs/algorithm.md §2)."""

import pytest
import torch

from rocketkv_cli.core.stage1 import gather_tokens, observation_scores, pool_scores, select_kept_tokens, snapkv_select


def naive_scores(q, k, q_pos, k_pos, scaling, softcap=None):
    """Loops over KV heads, query heads and window queries; float64."""
    b, h, w, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    out = torch.zeros(b, hkv, s, dtype=torch.float64)
    for kv in range(hkv):
        for gi in range(g):
            for wi in range(w):
                logits = (k[0, kv].double() @ q[0, kv * g + gi, wi].double()) * scaling
                if softcap:
                    logits = torch.tanh(logits / softcap) * softcap
                logits[k_pos > q_pos[wi]] = float("-inf")
                out[0, kv] += torch.softmax(logits, 0)
    return out


@pytest.mark.parametrize("g", [1, 3, 7], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("d", [60, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["nocap", "softcap"])
def test__observation_scores__equal_loop_reference(g, d, softcap):
    torch.manual_seed(g * d)
    hkv, s, w = 2, 97, 11
    q = torch.randn(1, hkv * g, w, d)
    k = torch.randn(1, hkv, s, d)
    q_pos, k_pos = torch.arange(s - w, s), torch.arange(s)
    ref = naive_scores(q, k, q_pos, k_pos, 0.13, softcap)
    for chunk in (8192, 7):  # one chunk and many (two-pass log-sum-exp across chunks)
        out = observation_scores(q, k, q_pos, k_pos, 0.13, softcap, key_chunk_tokens=chunk)
        assert out.dtype == torch.float32 and out.shape == (1, hkv, s)
        err = (out.double() - ref).abs()
        assert err.max() < 1e-4, f"max err {err.max():.3g} mean {err.mean():.3g}"
    # each window query's softmax sums to 1: total mass per KV head = G * W
    assert torch.allclose(out.sum(-1), torch.full((1, hkv), float(g * w)), atol=1e-3)


def test__observation_scores__bfloat16_input_scored_in_float32():
    torch.manual_seed(1)
    q, k = torch.randn(1, 4, 8, 64).bfloat16(), torch.randn(1, 2, 50, 64).bfloat16()
    out = observation_scores(q, k, torch.arange(42, 50), torch.arange(50), 0.125)
    ref = naive_scores(q.float(), k.float(), torch.arange(42, 50), torch.arange(50), 0.125)
    assert out.dtype == torch.float32 and (out.double() - ref).abs().max() < 1e-4


@pytest.mark.parametrize("kernel", [1, 3, 7, 63])
def test__pool_scores__equals_windowed_max(kernel):
    torch.manual_seed(kernel)
    x = torch.rand(1, 3, 97)
    out = pool_scores(x, kernel)
    half = kernel // 2
    ref = torch.stack([x[..., max(0, i - half) : i + half + 1].amax(-1) for i in range(97)], -1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("s, budget, window", [(97, 40, 8), (1000, 129, 32), (50, 50, 8), (30, 64, 8)])
def test__select_kept_tokens__topk_of_pooled_plus_window(s, budget, window):
    torch.manual_seed(s)
    pooled = torch.rand(1, 3, s)
    kept = select_kept_tokens(pooled, budget, window)
    assert kept.shape == (1, 3, min(s, budget))
    for h in range(3):
        got = set(kept[0, h].tolist())
        if s <= budget:
            assert got == set(range(s))
            continue
        n_top = budget - window
        order = sorted(range(s - window), key=lambda i: -float(pooled[0, h, i]))
        assert got == set(order[:n_top]) | set(range(s - window, s))
        assert kept[0, h].tolist() == sorted(got)  # original order


def test__select_kept_tokens__window_kept_even_when_scored_lowest():
    pooled = torch.rand(1, 2, 200)
    pooled[..., -16:] = -1.0
    kept = select_kept_tokens(pooled, 50, 16)
    assert all(set(range(184, 200)) <= set(kept[0, h].tolist()) for h in range(2))


def test__select_kept_tokens__heads_choose_independently():
    pooled = torch.zeros(1, 2, 100)
    pooled[0, 0, :10] = 1.0
    pooled[0, 1, 50:60] = 1.0
    kept = select_kept_tokens(pooled, 14, 4)
    assert set(kept[0, 0, :10].tolist()) == set(range(10))
    assert set(kept[0, 1, :10].tolist()) == set(range(50, 60))


def test__gather_tokens__per_kv_head_no_repeat():
    keys = torch.randn(1, 2, 30, 5)
    idx = torch.tensor([[[0, 3, 29], [1, 2, 4]]])
    out = gather_tokens(keys, idx)
    assert out.shape == (1, 2, 3, 5) and out.is_contiguous()
    assert torch.equal(out[0, 1, 2], keys[0, 1, 4]) and torch.equal(out[0, 0, 1], keys[0, 0, 3])


def test__snapkv_select__window_scores_do_not_spill_into_prefix():
    """Pooling covers the prefix only: the window's large self-attention mass must not promote the
    kernel//2 tokens just before it (SnapKV pools scores[..., :-W])."""
    torch.manual_seed(0)
    s, window, budget, kernel = 120, 8, 30, 7
    scores = torch.rand(1, 2, s) * 0.1
    scores[..., -window:] = 100.0
    kept = snapkv_select(scores, budget, window, kernel)
    prefix_pooled = pool_scores(scores[..., : s - window], kernel)
    for h in range(2):
        got = set(kept[0, h].tolist())
        assert set(range(s - window, s)) <= got and len(got) == budget
        inside = [float(prefix_pooled[0, h, i]) for i in got if i < s - window]
        outside = [float(prefix_pooled[0, h, i]) for i in range(s - window) if i not in got]
        assert min(inside) >= max(outside)  # a top-k of the prefix-pooled scores (ties at the cut excused)


@pytest.mark.parametrize("first", [0, 5, 40])
def test__select_kept_tokens__first_tokens_always_kept(first):
    torch.manual_seed(3)
    pooled = torch.rand(1, 3, 200)
    pooled[..., :first] = -1.0  # scored lowest: kept anyway
    kept = select_kept_tokens(pooled, 60, 8, first)
    assert kept.shape == (1, 3, 60)
    for h in range(3):
        ids = kept[0, h].tolist()
        assert ids == sorted(set(ids)) and ids[:first] == list(range(first)) and ids[-8:] == list(range(192, 200))
        rest = [i for i in ids if first <= i < 192]
        best = torch.topk(pooled[0, h, first:192], 60 - 8 - first).indices + first
        assert set(rest) == set(best.tolist())


def test__select_kept_tokens__first_tokens_shrink_to_the_budget():
    kept = select_kept_tokens(torch.rand(1, 1, 100), 20, 8, n_first=64)  # room for 12 first tokens only
    assert kept[0, 0].tolist() == list(range(12)) + list(range(92, 100))


def test__snapkv_select__first_tokens_do_not_spill_into_the_pooling():
    scores = torch.zeros(1, 1, 300)
    scores[..., :10] = 100.0  # the always-kept first tokens score highest
    scores[..., 150] = 1.0  # the one token the rest should choose
    kept = snapkv_select(scores, prompt_budget=10 + 1 + 8, window_size=8, kernel_size=31, n_first=10)
    chosen = [i for i in kept[0, 0].tolist() if 10 <= i < 292]  # the one top-k slot left
    assert len(chosen) == 1 and 135 <= chosen[0] <= 165, chosen  # near the real peak, not beside the first tokens
