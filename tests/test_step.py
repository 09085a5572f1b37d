"""The direct decode step (model/step.py) against the model's own forward (`forward_tokens`)."""

import pytest
import torch
from conftest import ARCHS, make_engine, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import decode_config_for
from rocketkv_cli.engine.documents import Document
from rocketkv_cli.engine.engine import Decoder
from rocketkv_cli.model.step import SUPPORTED_STEP_TYPES, decode_step_for
from rocketkv_cli.model.weights import quantize_weights

STEPS = 6


def _decode(engine, stored, dec, direct: bool) -> torch.Tensor:
    """Logits `[STEPS + 1, V]`: the question's prefill, then greedy steps (direct step or forward)."""
    saved = engine.step
    if not direct:
        engine.step = None
    try:
        decoder = Decoder(engine, stored, 64, dec)
        with decoder.attention():
            logits = [decoder.prefill(engine.question_ids("Which word comes first?"))[0]]
            for _ in range(STEPS):
                logits.append(decoder.decode_one_token(int(logits[-1].argmax()))[0])
    finally:
        engine.step = saved
    return torch.stack(logits)


# Mistral's tiny model slides a window over every layer: nothing for HSA to select.
CASES = [(a, "float", m) for a in SUPPORTED_STEP_TYPES for m in ("exact", "hsa") if (a, m) != ("mistral", "hsa")]
CASES += [("llama", "bf16", "exact"), ("gemma3_text", "int8", "hsa"), ("qwen3", "int4", "exact")]


@pytest.mark.parametrize("arch, weights, mode", CASES, ids=[f"{a}-{w}-{m}" for a, w, m in CASES])
def test__decode_step__equals_the_models_forward(arch, weights, mode):
    """Same modules in the same order: float64 logits agree to 1e-10 (measured: 0, bit for bit),
    over a stored context longer than the sliding windows (16 tokens) and with HSA selecting."""
    engine = make_engine(arch, torch.float32 if weights == "int4" else torch.float64)  # int4 packs float32 only
    assert engine.step is not None, f"{arch}: no direct decode step"
    quantize_weights(engine.model, weights)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(500, seed=3), "0" * 64, "d.txt"), cfg)
    dec = decode_config_for(stored, sparse=mode == "hsa")
    if mode == "hsa":
        assert any(dec.uses_hsa(layer.n_kept_tokens) for layer in stored.layers), "HSA must really select"
    direct, forward = _decode(engine, stored, dec, True), _decode(engine, stored, dec, False)
    err = (direct - forward).abs()
    tol = 1e-10 if engine.loaded.dtype == torch.float64 and weights == "float" else 1e-5 * float(forward.abs().max())
    assert float(err.max()) <= tol, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in SUPPORTED_STEP_TYPES])
def test__other_architectures__decode_through_the_models_forward(arch):
    """Layouts the direct step does not reproduce (fused projections, soft-capped attention) get
    no step, so the engine calls the model's forward."""
    engine = make_engine(arch)
    assert decode_step_for(engine.model, engine.shape) is None
    assert engine.step is None
