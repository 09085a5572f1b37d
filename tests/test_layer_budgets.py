"""Adaptive layer budgets (docs/algorithm.md §2 step 5): the same total prompt budget over the
full-attention layers, split by where the heads' attention mass is (`allocate_layer_budgets`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_engine, same_layer, text_of_bytes

from rocketkv_cli.core.cache import CompressedKVCache
from rocketkv_cli.core.config import PrefillConfig, resolve_budgets
from rocketkv_cli.core.stage1 import allocate_layer_budgets
from rocketkv_cli.engine.answer import decode_config_for
from rocketkv_cli.engine.decoder import Decoder
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.store.format import load_cache, save_cache

CFG = PrefillConfig(token_budget=48, max_new_tokens=8, window_size=8, pool_kernel_size=5, n_first_tokens=4)
DOC = Document(text_of_bytes(700, seed=9), "0" * 64, "d.txt")


def _scores(*rows: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32).view(1, 1, -1) for r in rows]


def test__allocation__mass_concentrated_in_one_layer_takes_the_free_slots_down_to_the_floor():
    # 2 layers, S = 100, W = 2, no first tokens, budget 12 → 10 free slots per layer, 20 in all.
    # Layer A holds its mass on 18 tokens (share 1/18 each), layer B spreads it over its 98
    # selectable tokens (1/98 each): the 20 largest shares are A's 18 and 2 of B's; B's floor is
    # ceil(0.25 · 10) = 3, so B keeps 3 and A the other 17 — plus the 2 window tokens each.
    a = [0.0] * 100
    for i in range(10, 28):
        a[i] = 5.0
    b = [1.0] * 100
    assert allocate_layer_budgets(_scores(a, b), 12, 2, 0) == [19, 5]
    assert allocate_layer_budgets(_scores(b, a), 12, 2, 0) == [5, 19]  # the order of layers does not matter
    assert allocate_layer_budgets(_scores(a, b), 12, 2, 0, min_share=0.0) == [20, 4]  # 18 + 2, then 2 + 2


def test__allocation__keeps_the_total_and_the_bounds_on_random_scores():
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        n_layers, hkv, s = 1 + trial % 5, 1 + trial % 3, 200 + 37 * trial
        scores = [torch.rand(1, hkv, s, generator=gen) ** (1 + 6 * (i % 2)) for i in range(n_layers)]
        budget, window, first = 60 + trial, 8, 4
        out = allocate_layer_budgets(scores, budget, window, first)
        free = budget - window - first
        assert sum(out) == n_layers * budget, out
        assert all(window + first + (free + 3) // 4 <= c <= s for c in out), (out, free)


def test__allocation__uniform_when_everything_fits_or_no_layer_stands_out():
    assert allocate_layer_budgets(_scores([1.0] * 50, [2.0] * 50), 60, 8, 4) == [60, 60]  # S ≤ budget
    flat = [torch.zeros(1, 2, 300), torch.zeros(1, 2, 300)]
    assert allocate_layer_budgets(flat, 40, 8, 4) == [40, 40]
    assert allocate_layer_budgets(_scores([1.0] * 300), 40, 8, 4) == [40]


def test__allocation__refuses_layers_of_different_lengths_and_bad_shares():
    with pytest.raises(ValueError, match="one S"):
        allocate_layer_budgets(_scores([1.0] * 100, [1.0] * 90), 40, 8)
    with pytest.raises(ValueError, match="min_share"):
        allocate_layer_budgets(_scores([1.0] * 100), 40, 8, min_share=1.5)
    with pytest.raises(ValueError, match="no layers"):
        allocate_layer_budgets([], 40, 8)


def test__config__layer_budgets_validated_and_omitted_from_the_record_while_uniform():
    with pytest.raises(ValueError, match="layer_budgets must be uniform or adaptive"):
        PrefillConfig(layer_budgets="per-head")
    with pytest.raises(ValueError, match="needs selection 'snapkv'"):
        PrefillConfig(layer_budgets="adaptive", selection="sink_recent")
    with pytest.raises(ValueError, match="store_budget"):
        PrefillConfig(layer_budgets="adaptive", token_budget=64, store_budget=256)
    assert "layer_budgets" not in PrefillConfig().to_dict()  # uniform files and batch cache keys as before
    assert PrefillConfig(layer_budgets="adaptive").to_dict()["layer_budgets"] == "adaptive"


@pytest.fixture(scope="module")
def engine():
    return make_engine("llama")


@pytest.mark.parametrize("observation", ["tail", "reconstruct"])
def test__adaptive_ingest__same_total_as_uniform_split_by_the_selectors_scores(engine, observation):
    cfg = dataclasses.replace(CFG, observation=observation, layer_budgets="adaptive")
    doc_ids = engine.document_ids(DOC)
    prefill = engine.prefill(doc_ids, cfg.window_size, reconstruct=observation == "reconstruct")
    cache = engine.compress(prefill, cfg, DOC.sha256, DOC.source)
    uniform = engine.compress(prefill, dataclasses.replace(cfg, layer_budgets="uniform"), DOC.sha256, DOC.source)
    full = [i for i, s in enumerate(engine.shape.layers) if s.sliding_window is None]
    p = resolve_budgets(cfg, len(doc_ids), engine.shape.head_dim).prompt_budget
    counts = [cache.layers[i].n_kept_tokens for i in full]
    assert {uniform.layers[i].n_kept_tokens for i in full} == {p}
    assert sum(counts) == len(full) * p and len(set(counts)) > 1, counts
    # each layer keeps what SnapKV++ selection keeps at that layer's count, from the same scores
    from rocketkv_cli.methods import method_for

    selector = method_for(cfg)
    for i, c in zip(full, counts):
        expect = selector.select(prefill.layers[i], c)  # [1, Hkv, c]
        assert torch.equal(cache.layers[i].positions, expect), i
        pos = cache.layers[i].positions[0]
        n = len(doc_ids)
        assert bool((pos[:, :4] == torch.arange(4)).all()) and bool((pos[:, -8:] == torch.arange(n - 8, n)).all())
    # the layers are allocated by the scores the selector ranks: they equal a direct allocation
    direct = allocate_layer_budgets([selector.scores(prefill.layers[i]) for i in full], p, 8, 4)
    assert counts == direct


def test__adaptive_cache__round_trips_its_file_and_answers_with_hsa_and_exact_attention(engine, tmp_path):
    cache = engine.ingest(DOC, dataclasses.replace(CFG, layer_budgets="adaptive"))
    path = save_cache(cache, tmp_path / "a.kv")
    back = load_cache(path)
    assert isinstance(back, CompressedKVCache) and back.info.config.layer_budgets == "adaptive"
    assert all(same_layer(x, y) for x, y in zip(cache.layers, back.layers))
    ids = engine.question_ids("Which letter comes first?")
    for sparse in (True, False):
        decoder = Decoder(engine, back, 64, decode_config_for(back, sparse=sparse))
        with decoder.attention():
            logits = decoder.prefill(ids)
            for _ in range(3):
                logits = decoder.decode_one_token(int(logits.argmax()))
        assert torch.isfinite(logits).all()
