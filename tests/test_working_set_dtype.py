"""A question's working set held in bfloat16 (`Engine.working_set_dtype`, docs/performance.md, "A
bfloat16 working set"): what is gathered, what is attended, and that the stored context and the
paths that attend the working set otherwise (stage-2 HSA, sliding windows) are left as they were."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import decode_config_for
from rocketkv_cli.engine.decoder import Decoder
from rocketkv_cli.engine.inputs import Document

CFG = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5, store_budget=128)
QUESTION = "Which letter comes first?"


def _stored(engine):
    return engine.ingest(Document(text_of_bytes(600, seed=4), "0" * 64, "d.txt"), CFG)


def _selected(engine, stored, dtype, decode="exact"):
    """A decoder after one question's prefill with the engine's working set in `dtype`."""
    engine.working_set_dtype = dtype
    dec = decode_config_for(stored, exact_working_set=1) if decode == "exact" else decode_config_for(stored)
    decoder = Decoder(engine, stored, 300, dec)
    with decoder.attention():
        decoder.prefill(engine.question_ids(QUESTION))
    return decoder


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__working_set__gathered_in_bfloat16_as_the_float_one_rounded(arch):
    """The same tokens as the float working set, each key and value that one rounded once; the
    stored context, sliding-window layers and positions keep the model's dtype; after `reset`
    the layers read the stored context again, unchanged."""
    engine = make_engine(arch)
    stored = _stored(engine)
    ref = _selected(engine, stored, None)
    got = _selected(engine, stored, torch.bfloat16)
    narrowed = 0
    for i, spec in enumerate(engine.shape.layers):
        a, b = ref.cache.layers[i], got.cache.layers[i]
        assert (a.n_context, a.length) == (b.n_context, b.length)
        ka, va, pa = a.view()
        kb, vb, pb = b.view()
        assert torch.equal(pa, pb), f"layer {i}: another working set"
        selected = spec.sliding_window is None and a.n_context < stored.layers[i].n_kept_tokens
        narrowed += selected
        assert kb.dtype == (torch.bfloat16 if selected else torch.float64), (i, kb.dtype)
        assert torch.equal(kb, ka.to(kb.dtype)) and torch.equal(vb, va.to(vb.dtype)), f"layer {i}"
    assert narrowed, "no layer was narrowed to a working set"
    got.reset()
    for i, layer in enumerate(got.cache.layers):
        s = stored.layers[i].n_kept_tokens
        assert layer.keys.dtype == torch.float64 and torch.equal(layer.keys[:, :, :s], stored.layers[i].keys)


def test__working_set__attended_by_stage_2_hsa_stays_in_the_models_dtype():
    """`ask --hsa` (no exact working set): HSA's page scores and sparse products read float keys."""
    engine = make_engine("llama")
    stored = _stored(engine)
    decoder = _selected(engine, stored, torch.bfloat16, decode="hsa")
    hsa = [layer for layer in decoder.cache.layers if decoder.decode.uses_hsa(layer.n_context)]
    assert hsa, "HSA must really attend some working set here"
    assert all(layer.keys.dtype == torch.float64 for layer in decoder.cache.layers)
    with decoder.attention():
        assert bool(decoder.decode_one_token(5).isfinite().all())


def test__working_set__of_soft_capped_layers_stays_in_the_models_dtype():
    """Gemma 2 caps its attention logits (tanh), which `exact_attention` computes from a matmul of
    q and K: over bfloat16 keys the logits themselves would round, so its layers keep float."""
    engine = make_engine("gemma2")
    assert any(spec.softcap for spec in engine.shape.layers)
    decoder = _selected(engine, _stored(engine), torch.bfloat16)
    assert any(layer._stored is not None for layer in decoder.cache.layers), "no layer was narrowed"
    assert all(layer.keys.dtype == torch.float64 for layer in decoder.cache.layers)


def test__working_set__attended_by_hsa_in_bfloat16_is_refused_not_miscomputed():
    """The choice is made when the working set is selected, the attention each step: a bfloat16
    working set that stage 2 would attend is an error, not a dtype mismatch deep in HSA."""
    engine = make_engine("llama")
    stored = _stored(engine)
    decoder = _selected(engine, stored, torch.bfloat16)  # exact: bfloat16
    decoder.decode = decode_config_for(stored)  # as if HSA had been chosen after the selection
    with decoder.attention(), pytest.raises(RuntimeError, match="working set attended by stage-2 HSA"):
        decoder.decode_one_token(5)


def test__working_set__reused_while_its_dtype_holds_and_made_anew_when_it_changes():
    engine = make_engine("llama")
    stored = _stored(engine)
    engine.working_set_dtype = torch.bfloat16
    decoder = Decoder(engine, stored, 300, decode_config_for(stored, exact_working_set=1))
    seen = []
    for dtype in (torch.bfloat16, torch.bfloat16, None):
        engine.working_set_dtype = dtype
        with decoder.attention():
            decoder.prefill(engine.question_ids(QUESTION))
        layer = decoder.cache.layers[0]
        seen.append((layer.keys.dtype, layer.keys.data_ptr()))
        decoder.reset()
    assert seen[0] == seen[1], "the second question allocated new working-set buffers"
    assert seen[2][0] == torch.float64 and seen[2][1] != seen[0][1]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__teacher_forced_logits__equal_step_by_step_decode_over_a_bfloat16_working_set(arch):
    """`Decoder.score` (one forward over the answer) attends the bfloat16 working set as the
    decode steps do: the same logits to 1e-5 of the largest, as with weight-only formats
    (tests/test_decode.py; SDPA's blocks may round one bfloat16 output apart: measured 2e-6)."""
    engine = make_engine(arch)
    stored = _stored(engine)
    engine.working_set_dtype = torch.bfloat16
    ids, answer = engine.question_ids(QUESTION), [7, 101, 55, 200, 33, 9]
    decoder = Decoder(engine, stored, 300, decode_config_for(stored, exact_working_set=1))
    with decoder.attention():
        steps = [decoder.prefill(ids)[0]]
        assert any(layer.keys.dtype == torch.bfloat16 for layer in decoder.cache.layers)
        for token in answer[:-1]:
            steps.append(decoder.decode_one_token(token)[0])
    decoder.reset()
    stepwise = torch.stack(steps)
    err = (decoder.score(ids, answer) - stepwise).abs()
    tol = 1e-5 * float(stepwise.abs().max())
    assert float(err.max()) < tol, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


@pytest.mark.parametrize("b, h, hkv, s, d", [(1, 9, 3, 3467, 64), (1, 4, 4, 37, 16), (2, 6, 2, 129, 24)])
def test__exact_decode_attention__over_bfloat16_keys_equals_float64_attention_of_the_rounded_inputs(b, h, hkv, s, d):
    """The float query is rounded to bfloat16 and attends bfloat16 keys and values; the output
    comes back in the query's dtype, within the rounding of the probabilities and of the output
    (bfloat16: 2⁻⁸ relative) of float64 attention over the rounded query, keys and values."""
    from rocketkv_cli.model.hf import exact_decode_attention

    g = torch.Generator().manual_seed(s)
    q = torch.randn(b, h, 1, d, generator=g)
    k = (torch.randn(b, hkv, s, d, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(b, hkv, s, d, generator=g).to(torch.bfloat16)
    scaling = d**-0.5
    out = exact_decode_attention(q, k, v, scaling)
    assert out.dtype == torch.float32 and out.shape == (b, h, 1, d)
    kk = k.double().repeat_interleave(h // hkv, dim=1)
    vv = v.double().repeat_interleave(h // hkv, dim=1)
    probs = torch.softmax(q.to(torch.bfloat16).double() @ kk.transpose(-1, -2) * scaling, dim=-1)
    want = probs @ vv  # [B, H, 1, D]
    err = (out.double() - want).abs()
    tol = 2**-7 * float(want.abs().max())
    assert float(err.max()) < tol, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}, tol {tol:.3g}"


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("weights", ["float", "bf16", "head-bf16"])
def test__working_set_dtype__bfloat16_only_for_bf16_decode_linears_on_a_native_bfloat16_cpu(weights, native,
                                                                                          monkeypatch):  # fmt: skip
    import rocketkv_cli.engine.engine as engine_module
    from rocketkv_cli.engine.engine import Engine
    from rocketkv_cli.model.loading import LoadedModel

    monkeypatch.setattr(engine_module, "cpu_has_native_bf16", lambda: native)
    base = make_engine("llama", dtype=torch.float32).loaded
    for dtype, device in ((torch.float32, "cpu"), (torch.float64, "cpu"), (torch.float32, "cuda")):
        loaded = LoadedModel(model_id=base.model_id, model=base.model.to(dtype), tokenizer=base.tokenizer,
                             device=torch.device(device), dtype=dtype, weights=weights)  # fmt: skip
        want = torch.bfloat16 if weights == "bf16" and native and dtype == torch.float32 and device == "cpu" else None
        assert Engine(loaded).working_set_dtype == want, (weights, native, dtype, device)
        assert Engine(loaded, compile_step=True).working_set_dtype == want, "the captured step compiles it too"


def test__cpu_has_native_bf16__agrees_with_lscpu():
    """Against another reader of the CPU's flags: util-linux's `lscpu` (its "Flags:" line)."""
    import shutil
    import subprocess

    from rocketkv_cli.model.linears import cpu_has_native_bf16

    if shutil.which("lscpu") is None:
        pytest.skip("no lscpu here")
    out = subprocess.run(["lscpu"], capture_output=True, text=True, env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"})
    flags = {f for line in out.stdout.splitlines() if line.startswith("Flags:") for f in line.split()[1:]}
    if not flags:
        pytest.skip("lscpu shows no flags here")
    assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test__load_line__names_a_bfloat16_working_set():
    from rocketkv_cli.api.rocketkv import RocketKV

    rk = RocketKV(make_engine("llama", dtype=torch.float32))
    rk.engine.working_set_dtype = None
    assert rk.description == "tiny-llama on cpu (float32)"
    rk.engine.working_set_dtype = torch.bfloat16
    assert rk.description == "tiny-llama on cpu (float32, bf16 working sets)"


def test__bench_captured_step__times_the_captured_step_over_a_bfloat16_working_set(tmp_path):
    """`rocketkv bench`'s captured column: the captured step applies to a bfloat16 working set
    (it did not at first, and the column went empty where the working set is bfloat16)."""
    from rocketkv_cli.eval.bench import captured_step_s
    from rocketkv_cli.store.format import save_cache

    engine = make_engine("llama", dtype=torch.float32)
    path = tmp_path / "d.kv"
    save_cache(_stored(engine), path)
    engine.working_set_dtype = torch.bfloat16
    step_s = captured_step_s(engine, path, QUESTION, steps=3, warmup=2)
    assert step_s is not None and step_s > 0
    assert engine.working_set_dtype == torch.bfloat16
