"""Stage-1 methods are one class each, registered by name (`rocketkv_cli.methods`).

A toy method defined here, and nowhere else, must be accepted by `PrefillConfig`, used by
`Engine.compress`, offered by `rocketkv eval --methods`, and removed again by `unregister`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from dataclasses import dataclass

import pytest
import torch
from conftest import make_engine, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.eval.names import eval_methods
from rocketkv_cli.methods import LayerPrefill, Stage1Method, method_for, register, registry, unregister
from rocketkv_cli.store.format import load_cache, save_cache


@dataclass(frozen=True)
class EveryOther(Stage1Method):
    """A toy: each KV head keeps evenly spaced tokens from `offset` on, scored by position alone."""

    name = "every_other"
    summary = "toy: evenly spaced tokens"
    observation = "every_other"

    window_size: int  # a PrefillConfig field
    offset: int = 0  # an option of its own (PrefillConfig.method_options)

    def scores(self, layer: LayerPrefill) -> torch.Tensor:
        n, n_kv = layer.n_context_tokens, layer.keys.shape[1]
        return torch.arange(n, dtype=torch.float32).expand(1, n_kv, n).clone()  # [1, Hkv, n]

    def select(self, layer: LayerPrefill, prompt_budget: int) -> torch.Tensor:
        n, n_kv = layer.n_context_tokens, layer.keys.shape[1]
        kept = torch.linspace(self.offset, n - 1, prompt_budget).round().long()  # [prompt_budget], distinct
        return kept.expand(1, n_kv, prompt_budget).clone()


@pytest.fixture
def toy():
    register(EveryOther)
    yield EveryOther
    unregister("every_other")


def test__builtin_methods__are_registered_by_name_in_order():
    assert list(registry())[:5] == ["tail", "combined", "probe", "reconstruct", "sink_recent"]  # tail, then by file
    names = ("tail", "combined", "probe", "reconstruct")
    assert {type(method_for(PrefillConfig(observation=o))).name for o in names} == set(names)
    assert type(method_for(PrefillConfig(selection="sink_recent"))).name == "sink_recent"


def test__unknown_method__refused_by_the_configuration_naming_the_choices():
    choices = r"\('tail', 'combined', 'probe', 'reconstruct'\)"
    with pytest.raises(ValueError, match=rf"observation must be one of {choices}, got 'toy'"):
        PrefillConfig(observation="toy")
    with pytest.raises(ValueError, match="selection must be one of"):
        PrefillConfig(selection="toy")


def test__toy_method__needs_no_edit_outside_its_file(toy):
    cfg = PrefillConfig(token_budget=48, max_new_tokens=4, window_size=8, observation="every_other")
    assert isinstance(method_for(cfg), EveryOther) and method_for(cfg).window_size == 8
    engine = make_engine("llama", torch.float32)
    document = Document(text=text_of_bytes(600, seed=1), sha256="0" * 64, source="toy.txt")
    stored = engine.ingest(document, cfg)
    n, p = stored.n_context_tokens, stored.info.budgets.prompt_budget
    expected = torch.linspace(0, n - 1, p).round().long()
    for layer in stored.layers:  # positions are the kept tokens' (the document starts at 0)
        assert layer.n_kept_tokens == p
        assert torch.equal(layer.positions[0, 0].long(), expected)
    assert {"every_other", "every_other_reselect", "every_other_adaptive"} <= set(eval_methods())
    adaptive = engine.ingest(document, PrefillConfig(**{**cfg.to_dict(), "layer_budgets": "adaptive"}))
    assert sum(layer.n_kept_tokens for layer in adaptive.layers) == len(adaptive.layers) * p


def test__own_option__set_through_method_options_and_recorded_in_the_file(toy, tmp_path):
    cfg = PrefillConfig(token_budget=48, max_new_tokens=4, window_size=8, observation="every_other",
                        method_options={"offset": 7})  # fmt: skip
    assert method_for(cfg).offset == 7 and method_for(dataclasses.replace(cfg, method_options=())).offset == 0
    engine = make_engine("llama", torch.float32)
    document = Document(text=text_of_bytes(600, seed=1), sha256="0" * 64, source="toy.txt")
    stored = engine.ingest(document, cfg)
    n, p = stored.n_context_tokens, stored.info.budgets.prompt_budget
    assert torch.equal(stored.layers[0].positions[0, 0].long(), torch.linspace(7, n - 1, p).round().long())
    loaded = load_cache(save_cache(stored, tmp_path / "toy.kv"))
    assert loaded.info.config == cfg and method_for(loaded.info.config).offset == 7
    with pytest.raises(ValueError, match="method_options names stride, which this stage-1 method does not have"):
        PrefillConfig(observation="every_other", method_options={"stride": 2})
    with pytest.raises(ValueError, match="it has none"):
        PrefillConfig(method_options={"offset": 1})  # the tail window has no options of its own
    assert "method_options" not in PrefillConfig().to_dict()  # files without them are byte-identical


def test__own_option_without_a_default__refused_at_registration():
    @dataclass(frozen=True)
    class NoDefault(Stage1Method):
        name = "no_default"
        summary = "toy"
        observation = "no_default"
        stride: int

    with pytest.raises(ValueError, match="need defaults"):
        register(NoDefault)
    assert "no_default" not in registry()


def test__unregister__removes_the_method_and_its_configuration(toy):
    unregister("every_other")
    assert "every_other" not in registry() and "every_other" not in eval_methods()
    with pytest.raises(ValueError, match="observation must be one of"):
        PrefillConfig(observation="every_other")
    register(EveryOther)  # the fixture unregisters it again


def test__a_taken_name_or_configuration__cannot_be_registered_twice(toy):
    @dataclass(frozen=True)
    class Clash(EveryOther):
        name = "tail"

    with pytest.raises(ValueError, match="already registered"):
        register(Clash)

    @dataclass(frozen=True)
    class Twin(EveryOther):
        name = "twin"

    with pytest.raises(ValueError, match="same configuration"):
        register(Twin)
    assert "twin" not in registry()


@pytest.mark.parametrize(
    "option, message",
    [("foo", "--method-option must be NAME=VALUE, got 'foo'"),
     ("offset=3", "invalid option: --method-option names offset, which this stage-1 method does not have "
                  "(it has none)")],
)  # fmt: skip
def test__cli_method_option__refused_in_one_line_before_any_model_loads(rocketkv_bin, tmp_path, option, message):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.\n")
    r = subprocess.run([rocketkv_bin, "ingest", str(doc), "--method-option", option, "--model", str(tmp_path / "none")],
                       capture_output=True, text=True, env={**os.environ, "ROCKETKV_HOME": str(tmp_path)})  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"Error: {message}"], r.stderr
    assert not (tmp_path / "doc.txt.kv").exists()


def test__combine_shares__each_signal_counts_by_its_share_of_its_row_not_its_scale():
    from rocketkv_cli.methods.combined import combine_shares

    tail = torch.tensor([[[1000.0, 0.0, 0.0, 3000.0]]])  # shares 0.25, 0, 0, 0.75
    recon = torch.tensor([[[0.0, 0.6, 0.2, 0.2]]])  # shares 0, 0.6, 0.2, 0.2
    got = combine_shares(tail, recon)
    assert torch.allclose(got, torch.tensor([[[0.25, 0.6, 0.2, 0.75]]])), got
    assert torch.equal(combine_shares(torch.zeros(1, 1, 3), recon[..., :3]), torch.tensor([[[0.0, 0.75, 0.25]]]))
    with pytest.raises(ValueError, match="one shape"):
        combine_shares(tail, recon[..., :3])


def test__combined_method__keeps_the_top_of_either_signals_share():
    """`observation="combined"`: each KV head keeps the first tokens, the last W, and the tokens of
    largest max(tail share, reconstruction share); the prefill runs both passes for it."""
    from rocketkv_cli.core.cache import LayerKV
    from rocketkv_cli.methods.combined import Combined

    engine = make_engine("gemma3_text")  # sliding-window layers too
    cfg = PrefillConfig(token_budget=40, max_new_tokens=8, window_size=8, pool_kernel_size=1,
                        observation="combined", n_first_tokens=4)  # fmt: skip
    assert isinstance(method_for(cfg), Combined) and Combined.capture == "reconstruct"
    doc = Document(text_of_bytes(500, seed=7), "0" * 64, "d.txt")
    stored = engine.ingest(doc, dataclasses.replace(cfg, chunk_tokens=128))
    prefill = engine.prefill(engine.document_tokens(doc).ids, cfg.window_size, chunk_tokens=128, reconstruct=True)
    p = stored.info.budgets.prompt_budget
    checked = 0
    for i, layer in enumerate(prefill.layers):
        if isinstance(layer, LayerKV):
            continue
        tail, recon = layer.observation_scores("tail", 8)[0], layer.reconstruction[0]  # [Hkv, n] each
        n = tail.shape[1]
        kept = stored.layers[i].positions[0]  # [Hkv, P]
        for h in range(tail.shape[0]):
            share = [max(float(tail[h, j] / tail[h].sum()), float(recon[h, j] / recon[h].sum())) for j in range(n)]
            middle = sorted(range(4, n - 8), key=lambda j: -share[j])[: p - 12]
            assert set(kept[h].tolist()) == set(middle) | set(range(4)) | set(range(n - 8, n)), f"layer {i} head {h}"
            checked += 1
    assert checked >= 1
