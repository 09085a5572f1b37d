"""The direct decode step (model/step.py) against the model's own forward (`forward_tokens`)."""

import pytest
import torch
from conftest import ARCHS, make_engine, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import decode_config_for
from rocketkv_cli.engine.decoder import Decoder
from rocketkv_cli.engine.inputs import Document
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


@pytest.mark.parametrize("arch", SUPPORTED_STEP_TYPES)
@pytest.mark.parametrize("weights", ["float", "bf16", "int8", "int4", "head-bf16", "mlp-bf16"])
def test__decode_step__float32_equals_the_models_forward_bit_for_bit(arch, weights):
    """In float32 (the presets' dtype on a CPU) the step's own paths run: norms through
    `F.rms_norm`, linears through `F.linear` or the bfloat16 matrix-vector product, RoPE once over
    q and k; each must compute what the model's modules compute, so the logits are equal, not close."""
    engine = make_engine(arch, torch.float32)
    quantize_weights(engine.model, weights)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(500, seed=5), "0" * 64, "d.txt"), cfg)
    dec = decode_config_for(stored, sparse=False)
    direct, forward = _decode(engine, stored, dec, True), _decode(engine, stored, dec, False)
    err = (direct - forward).abs()
    assert torch.equal(direct, forward), f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in SUPPORTED_STEP_TYPES])
def test__other_architectures__decode_through_the_models_forward(arch):
    """Layouts the direct step does not reproduce (fused projections, soft-capped attention) get
    no step, so the engine calls the model's forward."""
    engine = make_engine(arch)
    assert decode_step_for(engine.model, engine.shape) is None
    assert engine.step is None


def test__window_start__a_common_suffix_of_the_buffer_or_none():
    """The keys inside a sliding window (q − window < k ≤ q) as a slice start, only when they are
    the same suffix in every KV head."""
    from rocketkv_cli.model.hf import LayerSpec, window_start

    spec = LayerSpec(scaling=1.0, sliding_window=4, softcap=None)
    q = torch.tensor([10])
    ascending = torch.arange(3, 11).view(1, 1, -1).expand(1, 2, -1)  # positions 3..10, two heads
    assert window_start(ascending, q, spec) == 4  # 7, 8, 9, 10 are inside
    assert window_start(torch.arange(8, 11).view(1, 1, -1), q, spec) == 0  # all inside
    shuffled = torch.tensor([[[9, 3, 10, 8, 7]]])
    assert window_start(shuffled, q, spec) is None  # inside keys not a suffix
    per_head = torch.stack([torch.arange(3, 11), torch.arange(4, 12) - 1 + (torch.arange(8) > 5)]).unsqueeze(0)
    assert window_start(per_head, q, spec) is None  # heads disagree on the start
    assert window_start(torch.tensor([[[5, 6, 11]]]), q, spec) is None  # a future key is not visible


def test__sliding_layer_decode_steps__take_the_slice_and_equal_the_masked_reference(monkeypatch):
    """In real decode steps of a model with sliding-window layers the window's start moves past
    the stored tokens (slices starting after 0 occur), and the logits equal the masked path's
    (the same steps with `window_start` disabled), float64 to 1e-10."""
    from rocketkv_cli.model import hf

    engine = make_engine("gemma3_text")
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(500, seed=3), "0" * 64, "d.txt"), cfg)
    dec = decode_config_for(stored, sparse=False)
    starts: list[int | None] = []
    real = hf.window_start
    monkeypatch.setattr(hf, "window_start", lambda *a: starts.append(real(*a)) or starts[-1])
    sliced = _decode(engine, stored, dec, True)
    assert any(s for s in starts) and None not in starts, starts
    monkeypatch.setattr(hf, "window_start", lambda *a: None)
    masked = _decode(engine, stored, dec, True)
    err = (sliced - masked).abs()
    assert float(err.max()) <= 1e-10, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


ATTN_SHAPES = [(9, 3, 64, 1), (9, 3, 64, 37), (4, 1, 256, 513), (6, 6, 24, 130), (8, 2, 40, 7)]  # H, Hkv, D, S


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("h, hkv, d, s", ATTN_SHAPES)
def test__exact_decode_attention__equals_the_masked_reference(h, hkv, d, s, dtype, tol):
    """The decode fast path (grouped matmuls on a CPU: each KV head read once for its GQA group)
    against `core.attention.exact_attention` with every key in the query's past."""
    from rocketkv_cli.core.attention import exact_attention
    from rocketkv_cli.model.hf import exact_decode_attention

    g = torch.Generator().manual_seed(h * 1000 + s)
    q = torch.randn(1, h, 1, d, generator=g, dtype=dtype)
    buf_k = torch.randn(1, hkv, s + 5, d, generator=g, dtype=dtype)  # a prefix of a larger buffer, as in decode
    buf_v = torch.randn(1, hkv, s + 5, d, generator=g, dtype=dtype)
    k, v = buf_k[:, :, :s], buf_v[:, :, :s]
    scaling = d**-0.5
    ref = exact_attention(q, k, v, torch.arange(s)[None, None], torch.tensor([s]), scaling)
    out = exact_decode_attention(q, k, v, scaling)
    err = (out - ref).abs()
    assert out.shape == ref.shape == (1, h, 1, d) and out.dtype == dtype
    assert float(err.max()) <= tol, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test__joined_linears__equal_their_parts_and_share_their_memory(fmt, bias):
    """`_PackedLinear.join` (the decode step's q/k/v and gate/up): the joined output equals the
    parts' outputs side by side; the parts' tensors become views of the joined ones."""
    from torch import nn

    from rocketkv_cli.model.weights import Bf16Linear, Int8Linear, decode_step

    torch.manual_seed(0)
    cls = Bf16Linear if fmt == "bf16" else Int8Linear
    parts = [cls(nn.Linear(80, n, bias=bias and n != 40)) for n in (88, 40, 40)]  # odd sizes, one part unbiased
    x = torch.randn(1, 1, 80)
    with decode_step():
        expected = torch.cat([p(x) for p in parts], dim=-1)
        joined = cls.join(parts)
        assert joined is not None
        out = joined(x)
        again = torch.cat([p(x) for p in parts], dim=-1)  # the parts still work, now as views
    err = (out - expected).abs()
    assert out.shape == (1, 1, 168) and torch.equal(again, expected)
    assert float(err.max()) <= 1e-6 * float(expected.abs().max()), (
        f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    )
    name = cls._ROWS[0]
    assert all(getattr(p, name).untyped_storage().data_ptr() == getattr(joined, name).untyped_storage().data_ptr()
               for p in parts)  # fmt: skip
    assert cls.join([parts[0], Int8Linear(nn.Linear(80, 8)) if fmt == "bf16" else Bf16Linear(nn.Linear(80, 8))]) is None
    assert cls.join([parts[0], cls(nn.Linear(64, 8))]) is None  # another input size


@pytest.mark.parametrize("arch, weights", [("llama", "int8"), ("qwen3", "bf16"), ("gemma3_text", "int8")])
def test__decode_step__joins_the_projections_of_weight_only_formats(arch, weights):
    """With int8 or bf16 linears every layer's q/k/v and gate/up run joined (the equality with the
    model's forward is `test__decode_step__equals_the_models_forward`)."""
    engine = make_engine(arch, torch.float32)
    quantize_weights(engine.model, weights)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(300, seed=4), "0" * 64, "d.txt"), cfg)
    direct, forward = _decode(engine, stored, decode_config_for(stored, sparse=False), True), None
    plans = engine.step._plans
    assert len(plans) == len(engine.model.model.layers)
    assert all(p.qkv is not None and p.gate_up is not None for p in plans)
    forward = _decode(engine, stored, decode_config_for(stored, sparse=False), False)
    err = (direct - forward).abs()
    assert float(err.max()) <= 1e-5 * float(forward.abs().max()), f"max error {float(err.max()):.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test__exact_decode_attention__half_precision_keeps_float32_scores(dtype):
    """Half-precision keys take SDPA on a CPU too (its scores stay float32; a half-precision matmul
    would round the logits themselves): error against float64 no larger than SDPA's."""
    from rocketkv_cli.model.hf import exact_decode_attention

    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 32, 1, 128, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, 8, 4000, 128, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, 8, 4000, 128, generator=g, dtype=torch.float64)
    truth = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=128**-0.5, enable_gqa=True)
    half = [t.to(dtype) for t in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention(*half, scale=128**-0.5, enable_gqa=True)
    out = exact_decode_attention(*half, 128**-0.5)
    err, sdpa_err = (out.double() - truth).abs().max(), (sdpa.double() - truth).abs().max()
    assert out.dtype == dtype and float(err) <= float(sdpa_err) * 1.01, (
        f"max error {float(err):.3g} vs SDPA's {float(sdpa_err):.3g}"
    )


def test__joined_linears__leave_the_models_tensors_usable_and_follow_a_conversion():
    """The join runs inside the step's inference mode but must not turn the model's own weights
    into inference tensors (a state-dict load or in-place update would then fail); after
    `model.to()` replaces the tensors, the next step joins them again."""
    engine = make_engine("llama", torch.float32)
    quantize_weights(engine.model, "int8")
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(300, seed=4), "0" * 64, "d.txt"), cfg)
    before = _decode(engine, stored, decode_config_for(stored, sparse=False), True)
    q_proj = engine.model.model.layers[0].self_attn.q_proj
    assert not q_proj.weight_int8.is_inference() and not q_proj.scales.is_inference()
    engine.model.load_state_dict(engine.model.state_dict())  # would fail on inference tensors
    with torch.no_grad():
        q_proj.scales.mul_(1)
    first = engine.step._plans[0].qkv
    engine.model.to("cpu")  # a no-op move keeps the tensors: the join is kept
    _decode(engine, stored, decode_config_for(stored, sparse=False), True)
    assert engine.step._plans[0].qkv is first
    for module in engine.model.modules():  # new tensors, as a conversion or a load makes them
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.clone()
    after = _decode(engine, stored, decode_config_for(stored, sparse=False), True)
    assert engine.step._plans[0].qkv is not first
    assert torch.equal(before, after)


def _float32_engine_and_cache(arch: str, seed: int):
    engine = make_engine(arch, torch.float32)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(300, seed=seed), "0" * 64, "d.txt"), cfg)
    return engine, stored, decode_config_for(stored, sparse=False)


@pytest.mark.parametrize("change", ["load_state_dict", "data", "to"])
def test__decode_step__follows_norm_weights_changed_under_it(change):
    """The step's plans keep references to the model's tensors: norm weights changed in place
    (a state-dict load copies into the parameters), through `.data`, or converted away and back
    (`model.to()` swaps each parameter's data) must be what the next step uses, as the model's
    forward uses them (Gemma's norms multiply by 1 + w)."""
    engine, stored, dec = _float32_engine_and_cache("gemma3_text", 6)
    before = _decode(engine, stored, dec, True)
    norms = [p for name, p in engine.model.named_parameters() if name.endswith("norm.weight")]
    if change == "load_state_dict":
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        for name in [k for k in state if k.endswith("norm.weight")]:
            state[name] += 0.25
        engine.model.load_state_dict(state)
    elif change == "data":
        for p in norms:
            p.data.add_(0.25)
    else:
        for p in norms:  # a value a bfloat16 round trip changes
            p.data.add_(1e-3 * torch.rand(p.shape, generator=torch.Generator().manual_seed(1)))
        before = _decode(engine, stored, dec, True)
        engine.model.to(torch.bfloat16).to(torch.float32)
    direct, forward = _decode(engine, stored, dec, True), _decode(engine, stored, dec, False)
    assert not torch.equal(before, forward), "the change must matter for this test to mean anything"
    assert torch.equal(direct, forward), f"max error {float((direct - forward).abs().max()):.3g}"


def _hook_on(engine, where: str):
    """A hook that changes what the model computes, on the module `where` names in layer 0 (or the
    whole model), of the kind each place is hooked with in practice."""
    layer = engine.model.model.layers[0]
    scale = lambda m, args, out: out * 1.5  # noqa: E731
    if where == "mlp":
        return [layer.mlp.register_forward_hook(scale)]
    if where == "norm pre-hook":
        return [layer.input_layernorm.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))]
    if where == "o_proj (with kwargs)":
        return [layer.self_attn.o_proj.register_forward_hook(lambda m, args, kw, out: out * 1.5, with_kwargs=True)]
    if where == "v_proj":
        return [layer.self_attn.v_proj.register_forward_hook(scale)]
    if where == "down_proj":
        return [layer.mlp.down_proj.register_forward_hook(scale)]
    if where == "global":
        return [torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out * 1.5 if m is layer.mlp else None)]  # fmt: skip
    if where == "decoder layer":
        return [layer.register_forward_hook(lambda m, args, out: (out[0] * 1.5, *out[1:])
                                            if isinstance(out, tuple) else out * 1.5)]  # fmt: skip
    if where == "attention":
        return [layer.self_attn.register_forward_hook(lambda m, args, out: (out[0] * 1.5, *out[1:]))]
    raise AssertionError(where)


HOOKS = ["mlp", "norm pre-hook", "o_proj (with kwargs)", "v_proj", "down_proj", "global", "decoder layer", "attention"]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("where", HOOKS)
def test__decode_step__runs_the_hooks_the_models_forward_runs(arch, where):
    """A hook anywhere in a layer (or a global one) changes what the model computes: the step must
    run it as the model's forward does (through module calls, or the forward itself for the
    modules the step never calls), and go back to its own path when the hook is removed."""
    engine, stored, dec = _float32_engine_and_cache(arch, 7)
    plain = _decode(engine, stored, dec, True)
    handles = _hook_on(engine, where)
    try:
        direct, forward = _decode(engine, stored, dec, True), _decode(engine, stored, dec, False)
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.equal(plain, forward), "the hook must matter for this test to mean anything"
    assert torch.equal(direct, forward), f"max error {float((direct - forward).abs().max()):.3g}"
    assert torch.equal(_decode(engine, stored, dec, True), plain)
    layer = engine.model.model.layers[0]
    assert engine.step._plans[0].q is not layer.self_attn.q_proj, "without hooks the layer's own plan is back"
