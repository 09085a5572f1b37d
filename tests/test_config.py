"""Budget decomposition (docs/algorithm.md §1) and config validation."""

import math

import pytest

from rocketkv_cli.core.config import (
    Budgets,
    DecodeConfig,
    PrefillConfig,
    auto_pool_kernel_size,
    derive_budgets,
    resolve_budgets,
)


@pytest.mark.parametrize(
    "seq, budget, expected",
    [
        # docs/algorithm.md §1 examples (d=128, max_new=128): S=32K, t=256 and S=16K, t=1024
        (32 * 1024, 256, (1490, 128, 3, 60)),
        (16 * 1024, 1024, (4709, 512, 3, 81)),
    ],
    ids=["S32K-t256", "S16K-t1024"],
)
def test__derive_budgets__reproduces_spec_examples(seq, budget, expected):
    b = derive_budgets(seq - 128, 128, budget, 128)
    assert (b.prompt_budget, b.topk, b.page_size, b.n_score_dims) == expected
    assert b.capacity_budget == b.prompt_budget + 128


def test__derive_budgets__budget_covering_document_keeps_everything():
    b = derive_budgets(1000, 128, 4096, 64)
    assert b.prompt_budget == 1000 and b.page_size == 1 and b.n_score_dims == 64


def test__derive_budgets__page_size_one_when_sqrt_exceeds_c2():
    # c2 between 1 and 2: ceil(sqrt(c2)) = 2 > c2 only when c2 < 2 -> page 1
    b = derive_budgets(300, 10, 256, 64)
    c = max(1.0, 310 / 256)
    capacity = math.floor(310 / c ** min(0.2 + 0.06 * math.log2(c), 0.8))
    c2 = max(1.0, capacity / 256)
    assert math.ceil(math.sqrt(c2)) > c2 and b.page_size == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("token_budget", 0),
        ("token_budget", -5),
        ("window_size", 0),
        ("pool_kernel_size", 4),
        ("observation", "head"),
        ("topk", 0),
    ],
)
def test__prefill_config__rejects_bad_values_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        PrefillConfig(**{field: value})


def test__prefill_config__prompt_budget_below_window_rejected():
    with pytest.raises(ValueError, match="prompt_budget"):
        PrefillConfig(prompt_budget=8, window_size=32)


def test__resolve_budgets__overrides_win():
    b = resolve_budgets(PrefillConfig(prompt_budget=100, topk=7, page_size=5, n_score_dims=999), 5000, 64)
    assert (b.prompt_budget, b.topk, b.page_size, b.n_score_dims, b.capacity_budget) == (100, 7, 5, 64, 228)


def test__auto_pool_kernel_size__odd_and_growing():
    sizes = [auto_pool_kernel_size(n) for n in (100, 5000, 20000, 100000)]
    assert sizes == sorted(sizes) and all(k % 2 == 1 for k in sizes)


def test__budgets_and_decode_config__validate():
    with pytest.raises(ValueError, match="topk"):
        DecodeConfig(topk=0, page_size=1, n_score_dims=1)
    with pytest.raises(ValueError, match="page_size"):
        Budgets(prompt_budget=1, capacity_budget=2, topk=1, page_size=0, n_score_dims=1)


def test__resolve_budgets__a_small_topk_caps_the_derived_page():
    """--topk alone below the derived page (2 here: 20,000 tokens at budget 64) gives pages of topk
    tokens; the cache it once wrote held page_size 2 > topk 1 and every ask blamed --page-size."""
    assert derive_budgets(20_000, 128, 64, 64).page_size > 1
    b = resolve_budgets(PrefillConfig(token_budget=64, topk=1), 20_000, 64)
    assert (b.topk, b.page_size) == (1, 1)


def test__budgets__a_page_over_topk_refused():
    """Stored budgets are checked as the decode checks them: a file's page larger than its top-k is
    its own fault (malformed metadata), not an option the user never typed."""
    with pytest.raises(ValueError, match="page_size must not exceed topk"):
        Budgets(prompt_budget=8, capacity_budget=9, topk=4, page_size=5, n_score_dims=1)


def test__decode_config__page_size_over_topk_refused():
    """A page larger than what one step attends (it once allocated for the page, 13 GB for 1e8)."""
    with pytest.raises(ValueError, match="page_size"):
        DecodeConfig(topk=4, page_size=8, n_score_dims=1)


def test__summary_writing__presets_extract_unless_asked_to_write():
    from rocketkv_cli.core.config import summary_writing

    for preset in ("gemma-3-270m", "smollm2-135m"):  # measured: their own summaries fail the check
        assert summary_writing(preset) is None
        assert summary_writing(preset, write_from="document") == "document"
        assert summary_writing(preset, extractive=False, write_from="sentences") == "sentences"
    assert summary_writing("gemma-3-270m", can_extract=False) == "document"  # an old file without token ids
    assert summary_writing("/models/Qwen2.5-1.5B-Instruct") == "document"  # not measured: the model writes
    assert summary_writing("/models/Qwen2.5-1.5B-Instruct", extractive=True, write_from="document") is None
    with pytest.raises(ValueError, match="write_from must be one of sentences, document"):
        summary_writing("gemma-3-270m", write_from="paragraphs")


def test__preset_config__options_are_checked_against_the_presets_token_budget():
    """`ingest --window-size 800` on a preset was refused against the generic budget (512), though
    the preset's is 1024; `--store-budget 600` silently dropped the budget to 512. Both are checked
    against the preset's 1024 now, and its other defaults still give way where they must."""
    from rocketkv_cli.core.config import PRESET_PREFILL_DEFAULTS, STORE_ALL, preset_config

    for preset, defaults in PRESET_PREFILL_DEFAULTS.items():
        cfg = preset_config(preset, {"window_size": 800})
        assert (cfg.window_size, cfg.token_budget, cfg.store_budget) == (800, 1024, STORE_ALL), preset
        with pytest.raises(ValueError, match=r"budget \(1024\), got 600"):
            preset_config(preset, {"store_budget": 600})
        with pytest.raises(ValueError, match=r"1024 is below the observation window"):
            preset_config(preset, {"window_size": 1100})
        assert preset_config(preset, {"store_budget": 600, "token_budget": 512}).store_budget == 600
        adaptive = preset_config(preset, {"layer_budgets": "adaptive"})  # the store default gives way to it
        assert adaptive.layer_budgets == "adaptive" and adaptive.token_budget == defaults["token_budget"]
    assert preset_config("some/other-model", {"window_size": 32}) == PrefillConfig(window_size=32)
    with pytest.raises(ValueError, match="observation window"):
        preset_config("some/other-model", {"window_size": 800})  # no preset: the generic budget, 512
