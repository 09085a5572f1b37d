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
    assert list(registry())[:4] == ["tail", "probe", "reconstruct", "sink_recent"]  # a new file adds after them
    assert {type(method_for(PrefillConfig(observation=o))).name for o in ("tail", "probe", "reconstruct")} == {
        "tail", "probe", "reconstruct"}  # fmt: skip
    assert type(method_for(PrefillConfig(selection="sink_recent"))).name == "sink_recent"


def test__unknown_method__refused_by_the_configuration_naming_the_choices():
    with pytest.raises(ValueError, match=r"observation must be one of \('tail', 'probe', 'reconstruct'\), got 'toy'"):
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
