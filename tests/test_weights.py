"""Weight-only decode weights (`model/weights.py`): each product within the rounding bound of
its format (bfloat16, per-channel int8, group-wise int4), every linear converted, and the model
left in float32 under `--dtype auto` (only the products' inputs are rounded to bfloat16)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch import nn

from rocketkv_cli.model.linears import bf16_matvec
from rocketkv_cli.model.loading import load_model, resolve_dtype
from rocketkv_cli.model.weights import (
    Bf16Linear,
    CertifiedHead,
    Int4Linear,
    Int8Linear,
    RefinedHead,
    decode_step,
    quantize_weights,
    weights_bytes,
)


@pytest.mark.parametrize("k, n, rows, bias", [(64, 48, 1, False), (96, 130, 3, True), (576, 192, 7, False),
                                                (48, 200, 2, True)])  # fmt: skip
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test__int8_linear__within_the_per_channel_rounding_bound(k, n, rows, bias, act):
    """|x·(W − Ŵ)ᵀ| ≤ ‖x‖₁ · e_o per output o, where e_o bounds |W − Ŵ| in row o: half a step of
    round-to-nearest of W / s_o with s_o = max|W_o| / 127 (LLM.int8(), arXiv 2208.07339 §3), plus
    127 codes times the rounding of s_o to the stored bfloat16 scale; plus the input's rounding to
    bfloat16 (the kernel's input) and the kernel's bfloat16 output."""
    torch.manual_seed(k + n)
    linear = nn.Linear(k, n, bias=bias).to(act).requires_grad_(False)
    x = torch.randn(rows, k, dtype=act)
    q = Int8Linear(linear)
    out = q(x)
    assert out.dtype == act and out.shape == (rows, n)
    got = out.float()
    xf, w = x.float(), linear.weight.float()
    exact = xf @ w.T + (linear.bias.float() if bias else 0)
    s = w.abs().amax(dim=1) / 127  # [n]
    per_weight = s / 2 + 127 * (s - s.bfloat16().float()).abs()  # [n]
    dequantized = q.weight_int8.float() * q.scales.float()[:, None]
    assert bool(((dequantized - w).abs() <= per_weight[:, None] * (1 + 1e-5)).all())  # the stored weights
    rounded_x = (xf - xf.bfloat16().float()).abs()
    bound = xf.abs().sum(-1, keepdim=True) * per_weight + rounded_x @ (w.abs() + per_weight[:, None]).T  # [rows, n]
    slack = 2**-7 * exact.abs() + 1e-3  # the kernel's bfloat16 output (and act's own)
    err = (got - exact).abs()
    assert bool((err <= bound + slack).all()), (
        f"max error {float(err.max()):.3e} (mean {float(err.mean()):.3e}) exceeds the bound "
        f"(max {float(bound.max()):.3e}) by {float((err - bound - slack).max()):.3e}"
    )


@pytest.mark.parametrize("k, n, rows, bias", [(64, 48, 1, False), (96, 130, 3, True), (576, 192, 40, False)])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_decode", [True, False])
def test__bf16_linear__rounded_operands_in_decode_float_weights_in_prefill(k, n, rows, bias, act, in_decode):
    """In a decode step: both operands rounded to bfloat16, products exact, float32
    accumulation, output rounded to bfloat16 — the reference x_bf16 · W_bf16ᵀ is computed here in
    float64, and the result differs from the unrounded product (the rounding really happened).
    In prefill: the float weights as they are, x · Wᵀ in the input's dtype (summation only). The
    output comes back in the input's dtype."""
    torch.manual_seed(k * 3 + n)
    linear = nn.Linear(k, n, bias=bias).to(act).requires_grad_(False)
    x = torch.randn(rows, k, dtype=act)
    with decode_step() if in_decode else contextlib.nullcontext():
        got = Bf16Linear(linear)(x)
    assert got.dtype == act and got.shape == (rows, n)
    rounded = in_decode or act == torch.bfloat16
    xr, wr = (
        (x.bfloat16().double(), linear.weight.bfloat16().double()) if rounded else (x.double(), linear.weight.double())
    )
    product = xr @ wr.T  # [rows, n]
    magnitude = xr.abs() @ wr.abs().T
    tol = 2**-8 * product.abs() + 1e-6 * magnitude if rounded else 1e-6 * magnitude  # bfloat16 output; summation
    if bias:
        product = product + linear.bias.double()
        tol = tol + (2**-8 * product.abs() if act == torch.bfloat16 else 1e-6 * product.abs())  # the bias added
    err = (got.double() - product).abs()
    assert bool((err <= tol).all()), (
        f"max error {float(err.max()):.3e} (mean {float(err.mean()):.3e}), worst excess {float((err - tol).max()):.3e}"
    )
    if act == torch.float32 and in_decode:
        unrounded = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
        assert float((got.double() - unrounded).abs().max()) > 1e-4 * float(magnitude.max())


@pytest.mark.parametrize("k, n", [(64, 48), (576, 960), (37, 131), (1536, 576), (8, 4099)])
def test__bf16_matvec__one_row_equals_the_matrix_products_rows(k, n):
    """The one-row fast path (`torch.mv`, what a decode step runs) against the reference: the
    same row multiplied by `F.linear` inside a batch of rows. Both round the operands to
    bfloat16 and accumulate in float32; their outputs may differ by the summation order only,
    so by at most one bfloat16 step of the output (plus float32 sums' relative error)."""
    torch.manual_seed(k + 7 * n)
    w = torch.randn(n, k).bfloat16()
    rows = torch.randn(5, k).bfloat16()
    want = F.linear(rows, w)[2]  # [n], the reference of the middle row
    got = bf16_matvec(w, rows[2])
    assert got.dtype == torch.bfloat16 and got.shape == (n,)
    magnitude = rows[2].double().abs() @ w.double().abs().T
    err = (got.double() - want.double()).abs()
    tol = 2**-7 * want.double().abs() + 1e-6 * magnitude  # one bfloat16 step (8 bits kept) + summation
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3e} (mean {float(err.mean()):.3e})"
    linear = nn.Linear(k, n, bias=False).requires_grad_(False)
    linear.weight.copy_(w.float())
    module = Bf16Linear(linear)
    with decode_step():  # it is what Bf16Linear runs for one row, and row by row in teacher forcing
        assert torch.equal(module(rows[2:3].float())[0], got.float())
        many = module(rows.float())  # [5, n]: each row as decode computes it alone
        assert all(torch.equal(many[i], module(rows[i : i + 1].float())[0]) for i in range(5))
        assert module(rows[:0].float()).shape == (0, n)


@pytest.mark.parametrize("fmt, cls", [("bf16", Bf16Linear), ("int8", Int8Linear)])
def test__quantize_weights__every_linear_and_the_lm_head(fmt, cls):
    model = tiny_model("llama", torch.float32)
    linears = sum(isinstance(m, nn.Linear) for m in model.model.modules()) + 1  # + lm_head
    assert quantize_weights(model, fmt) == linears
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, RefinedHead) and isinstance(model.lm_head.approx, cls)
    assert quantize_weights(tiny_model("llama", torch.float32), "float") == 0
    with pytest.raises(ValueError, match="weights must be one of"):
        quantize_weights(model, "int3")


def test__head_bf16__only_the_lm_head_changes_and_only_in_decode_steps():
    """`head-bf16` converts the LM head alone: every decoder linear keeps its float weights, the
    tied embedding stays the refinement's float head (no copy), prefill's logits equal the float
    model's exactly, and a decode step's greedy token is the float model's with its top logits
    recomputed in float (to float32 summation order)."""
    model = tiny_model("llama", torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie, as Gemma 3 and SmolLM2 do
    ids = torch.arange(2, 30).view(1, -1)
    with torch.inference_mode():
        ref = model(ids).logits  # [1, T, V]
    linears = [m for m in model.model.modules() if isinstance(m, nn.Linear)]
    assert quantize_weights(model, "head-bf16") == 1
    assert [m for m in model.model.modules() if isinstance(m, nn.Linear)] == linears
    assert isinstance(model.lm_head, RefinedHead) and isinstance(model.lm_head.approx, Bf16Linear)
    assert model.lm_head.float_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        prefill = model(ids).logits
        with decode_step():
            step = model(ids).logits
    assert torch.equal(prefill, ref)
    assert torch.equal(step.argmax(-1), ref.argmax(-1))
    top = ref.topk(8, dim=-1).indices
    err = (step.gather(-1, top) - ref.gather(-1, top)).abs()
    assert float(err.max()) < 1e-5, f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    assert float((step - ref).abs().max()) > 0  # the other logits come from the bfloat16 copy


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__mlp_bf16__the_mlps_and_the_head_change_in_decode_steps_only(arch):
    """`mlp-bf16`: every decoder layer's MLP linears become `Bf16Linear`, the attention projections
    stay float `nn.Linear`s, the head is head-int4's `CertifiedHead`; prefill's logits equal the
    float model's exactly, a decode step's differ (the MLPs' bfloat16 products) but keep the
    greedy tokens here."""
    model = tiny_model(arch, torch.float32)
    torch.manual_seed(1)
    model.lm_head = nn.Linear(model.config.hidden_size, 256, bias=False)  # a head the int4 kernel packs
    ids = torch.arange(2, 30).view(1, -1)
    with torch.inference_mode():
        ref = model(ids).logits  # [1, T, V]
    attention = [m for layer in model.model.layers for m in layer.self_attn.modules() if isinstance(m, nn.Linear)]
    n_mlp = sum(isinstance(m, nn.Linear) for layer in model.model.layers for m in layer.mlp.modules())
    assert n_mlp == 3 * len(model.model.layers)
    assert quantize_weights(model, "mlp-bf16") == n_mlp + 1
    for layer in model.model.layers:
        assert sum(isinstance(m, Bf16Linear) for m in layer.mlp.children()) == 3
        assert not any(isinstance(m, nn.Linear) for m in layer.mlp.modules())
    assert [m for layer in model.model.layers for m in layer.self_attn.modules()
            if isinstance(m, nn.Linear)] == attention  # fmt: skip
    assert isinstance(model.lm_head, CertifiedHead)
    with torch.inference_mode():
        prefill = model(ids).logits
        with decode_step():
            step = model(ids).logits
    assert torch.equal(prefill, ref)
    assert float((step - ref).abs().max()) > 0  # the MLPs' products are bfloat16's in a decode step
    assert torch.equal(step.argmax(-1), ref.argmax(-1))


def test__int8_weights__float32_model_by_default_bfloat16_on_request(tiny_model_dir):
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    loaded = load_model(str(tiny_model_dir), device="cpu", weights="int8")
    assert loaded.weights == "int8" and next(loaded.model.parameters()).dtype == torch.float32
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", weights="int8")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def _int4_error_bound(w: torch.Tensor) -> torch.Tensor:
    """Per-weight bound `[n, k]` on |W − Ŵ| for int4 with groups of 32 along k: half a step
    s = (max − min) / 15 of the group, plus the rounding of s and of the zero z = min + 8 s to
    bfloat16 (relative 2⁻⁸ each, through at most 16 steps); computed here from W alone."""
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    s = (hi - lo) / 15
    z = lo + 8 * s
    e = s / 2 + 2**-8 * (z.abs() + 16 * s)  # [n, k/32]
    return e.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("k, n, rows, bias", [(64, 48, 1, False), (96, 160, 3, True), (576, 192, 7, False)])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test__int4_linear__within_the_group_rounding_bound(k, n, rows, bias, act):
    """|x·Wᵀ − y| ≤ |x|·Eᵀ + |x − x_bf16|·|W|ᵀ + output rounding, where E bounds |W − Ŵ| per
    weight (`_int4_error_bound`) and x_bf16 is the input as the int4 kernel takes it; the output
    comes back in the input's dtype."""
    torch.manual_seed(k * n)
    linear = nn.Linear(k, n, bias=bias).to(act).requires_grad_(False)
    x = torch.randn(rows, k, dtype=act)
    got = Int4Linear(linear)(x)
    assert got.dtype == act and got.shape == (rows, n)
    xf, w = x.float(), linear.weight.float()
    exact = xf @ w.T + (linear.bias.float() if bias else 0)
    e = _int4_error_bound(w)  # [n, k]
    rounded_x = (xf - xf.bfloat16().float()).abs()
    bound = xf.abs() @ e.T + rounded_x @ (w.abs() + e).T  # [rows, n]
    slack = 2**-7 * exact.abs() + 1e-3  # the kernel's bfloat16 output (and act's own)
    err = (got.float() - exact).abs()
    assert bool((err <= bound + slack).all()), (
        f"max error {float(err.max()):.3e} (mean {float(err.mean()):.3e}) exceeds the bound "
        f"(max {float(bound.max()):.3e}) by {float((err - bound - slack).max()):.3e}"
    )


@pytest.mark.parametrize("k, n", [(64, 48), (96, 160), (576, 192)])
def test__int4_linear__stored_weights_within_half_a_step(k, n):
    """The weights as the kernel applies them (the product with the identity: Ŵᵀ, exact inputs,
    bfloat16 outputs) are each within `_int4_error_bound` of W, and on average about a quarter
    step away (uniform rounding error), so the bound is not vacuous."""
    torch.manual_seed(k + 7 * n)
    linear = nn.Linear(k, n).requires_grad_(False)
    w = linear.weight.float()
    got = (Int4Linear(linear)(torch.eye(k)).float() - linear.bias).T  # Ŵ [n, k]
    e = _int4_error_bound(w)
    err = (got - w).abs()
    slack = 2**-8 * got.abs()  # the kernel's bfloat16 output
    assert bool((err <= e + slack).all()), f"max error {float(err.max()):.3e} (mean {float(err.mean()):.3e})"
    step = (w.view(n, k // 32, 32).amax(-1) - w.view(n, k // 32, 32).amin(-1)) / 15
    assert 0.15 < float(err.mean() / step.mean()) < 0.35, float(err.mean() / step.mean())


def test__int8_linear__refuses_input_sizes_its_kernel_gets_wrong():
    """torch's int8 kernel returns wrong values, silently, when in_features is not a multiple of 16
    (measured: 1e14 off at [88, 72]); such linears stay float under `--weights int8`."""
    assert Int8Linear.fits(nn.Linear(48, 88)) and not Int8Linear.fits(nn.Linear(72, 88))
    with pytest.raises(ValueError, match=r"int8 needs in_features % 16 == 0, got \[88, 40\]"):
        Int8Linear(nn.Linear(40, 88))
    model = nn.Module()
    model.model = nn.Sequential(nn.Linear(64, 88), nn.Linear(88, 64))  # 88 inputs: kept float
    model.lm_head = nn.Linear(64, 10)
    assert quantize_weights(model, "int8") == 2
    assert isinstance(model.model[0], Int8Linear) and type(model.model[1]) is nn.Linear
    assert isinstance(model.lm_head, RefinedHead)


def test__int4_linear__refuses_shapes_its_kernel_cannot_pack():
    assert not Int4Linear.fits(nn.Linear(48, 32)) and not Int4Linear.fits(nn.Linear(64, 40))
    message = r"int4 needs in_features % 32 == 0 and out_features % 16 == 0, got \[40, 64\]"
    with pytest.raises(ValueError, match=message):
        Int4Linear(nn.Linear(64, 40))


def test__quantize_weights__int4_converts_every_linear_that_fits():
    model = tiny_model("llama", torch.float32)
    fitting = [m for m in model.model.modules() if isinstance(m, nn.Linear) and Int4Linear.fits(m)]
    head_fits = Int4Linear.fits(model.lm_head)
    assert len(fitting) == sum(isinstance(m, nn.Linear) for m in model.model.modules())  # every decoder linear fits
    assert quantize_weights(model, "int4") == len(fitting) + head_fits
    assert not any(isinstance(m, nn.Linear) for m in model.model.modules())
    if head_fits:
        assert isinstance(model.lm_head, RefinedHead) and isinstance(model.lm_head.approx, Int4Linear)
    else:
        assert isinstance(model.lm_head, nn.Linear)


@pytest.mark.parametrize("fmt, cls", [("bf16", Bf16Linear), ("int8", Int8Linear), ("int4", Int4Linear)])
def test__weight_formats__keep_a_float32_model_and_answer(tiny_model_dir, fmt, cls):
    """`--weights bf16|int8|int4` leaves `auto` at float32 (only the products' inputs are
    rounded) and the model's logits stay close to the float one's."""
    ref = load_model(str(tiny_model_dir), device="cpu")
    loaded = load_model(str(tiny_model_dir), device="cpu", weights=fmt)
    assert loaded.weights == fmt and next(loaded.model.parameters()).dtype == torch.float32
    assert any(isinstance(m, cls) for m in loaded.model.modules())
    ids = torch.arange(2, 40).view(1, -1)
    with torch.inference_mode(), decode_step():  # the weights decode runs (bf16: its bfloat16 copy)
        a, b = ref.model(ids).logits, loaded.model(ids).logits
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert float(cos) > 0.97, float(cos)  # random weights of a 2-layer model: a coarse closeness check
    assert float((a - b).abs().max()) > 0  # the weight-only path really ran


@pytest.mark.parametrize("fmt, cls", [("bf16", Bf16Linear), ("int8", Int8Linear), ("int4", Int4Linear)])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test__refined_head__top_logits_exact_so_greedy_matches_the_float_head(fmt, cls, rows):
    """Logits around 20 (steps of 0.125 in bfloat16) where 8 tokens are near-tied and the rest
    lie several units below: the format's own head picks another token than the float head on
    some rows; `RefinedHead` recomputes each row's approximate top `TOPK` in float in decode
    steps, so those logits equal the float head's (max error shown) and every argmax matches;
    in prefill it takes the float head whole."""
    torch.manual_seed(rows)
    v, h = 512, 64
    head = nn.Linear(h, v, bias=True).requires_grad_(False)
    base = torch.randn(h)
    x = 20 * base / base.norm() ** 2 + 0.2 * torch.randn(200, rows, h)  # base·x ≈ 20
    head.weight[:, :] = base + 0.01 * torch.randn(v, h)
    head.bias[:] = 0.001 * torch.randn(v)  # small: the near-ties stay ties
    head.weight[8:] *= 0.8  # the other tokens: several units below the near-tied 8
    exact = head(x)  # [200, rows, V]
    approx = cls(head)
    module = RefinedHead(approx, head.weight, head.bias)
    with decode_step():
        refined = module(x)
        approximate = approx(x).float()  # as the module sees it
    picked = approximate.topk(RefinedHead.TOPK, dim=-1).indices  # what the module refines
    err = (refined.gather(-1, picked) - exact.gather(-1, picked)).abs()
    assert float(err.max()) < 1e-4, f"max error {float(err.max()):.3e} (mean {float(err.mean()):.3e})"
    best = exact.max(-1, keepdim=True).values
    chosen = exact.gather(-1, refined.argmax(-1, keepdim=True))  # the float head's logit of the refined choice
    assert bool((chosen >= best - 1e-4).all()), float((best - chosen).max())  # the greedy token, up to float32 ties
    flipped = exact.gather(-1, approximate.argmax(-1, keepdim=True))
    assert bool((flipped < best - 1e-3).any())  # the format alone picks a worse token on some rows
    prefill = module(x)  # outside a decode step: the float head whole
    assert float((prefill - exact).abs().max()) < 1e-4


def test__refined_head__tied_head_shares_the_embedding_and_weights_bytes_counts_what_decode_reads():
    """A tied LM head converted to bf16: the refinement reads the embedding matrix itself (no
    float copy), the logits stay float32 and close to the float model's, and `weights_bytes`
    counts the bf16 head, not the embedding a lookup reads one row of."""
    model = tiny_model("llama", torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    ids = torch.arange(2, 30).view(1, -1)
    with torch.inference_mode():
        ref = model(ids, logits_to_keep=1).logits
    float_bytes = weights_bytes(model)
    embedding = model.model.embed_tokens.weight
    quantize_weights(model, "bf16")
    assert model.lm_head.float_weight.data_ptr() == embedding.data_ptr()
    with torch.inference_mode(), decode_step():
        got = model(ids, logits_to_keep=1).logits
    assert got.dtype == torch.float32 and float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
    v, h = embedding.shape
    assert float_bytes - weights_bytes(model) > 0.9 * (v * h * 2)  # the float head (4 B) became bf16 (2 B)


def test__default_weights__a_preset_default_applies_when_none_are_named(tiny_model_dir, monkeypatch):
    """`RocketKV.load` without `weights` loads the model's measured default
    (`PRESET_WEIGHTS_DEFAULTS`), float for any other model; a named format always wins."""
    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.core import config

    assert config.default_weights("some/other-model") == "float"
    monkeypatch.setitem(config.PRESET_WEIGHTS_DEFAULTS, str(tiny_model_dir), "bf16")
    assert RocketKV.load(str(tiny_model_dir), device="cpu").engine.loaded.weights == "bf16"
    assert RocketKV.load(str(tiny_model_dir), device="cpu", weights="float").engine.loaded.weights == "float"
    bf16_model = RocketKV.load(str(tiny_model_dir), device="cpu", dtype="bfloat16").engine.loaded
    assert bf16_model.weights == "float"  # weight-only formats are for a float32 model


@pytest.mark.parametrize("fmt, answer_with", [("float", None), ("head-bf16", None), ("head-int4", None), ("bf16", None),
                                               ("mlp-bf16", None), ("int8", "int8"), ("int4", "int4")])  # fmt: skip
def test__decode_weights_for__integer_prefill_is_kept_float_and_bf16_take_the_default(tiny_model_dir, fmt,
                                                                                       answer_with):  # fmt: skip
    """A cache prefilled with integer weights is answered with them (they changed what stage 1
    kept); float and bf16 prefill alike (bf16 multiplies prefill's long inputs by the float
    weights), so their caches take the model's default decode weights (None)."""
    from rocketkv_cli.api.rocketkv import RocketKV, decode_weights_for
    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.engine.inputs import Document

    rk = RocketKV.load(str(tiny_model_dir), device="cpu", weights=fmt)
    cache = rk.engine.ingest(Document("word " * 200, "0" * 64, "doc"), PrefillConfig(token_budget=64))
    assert cache.info.weights == ("float" if fmt in ("head-bf16", "head-int4", "mlp-bf16") else fmt)  # float prefill
    assert decode_weights_for(cache) == answer_with


def test__tokenizer_digest__remembered_per_file_version_after_a_load(tiny_model_dir, tmp_path, monkeypatch):
    """`load_model` records the files the tokenizer came from, so `Engine.identity` serialises the
    tokenizer once per version of them (Gemma's takes 0.8 s) and reads the digest back after."""
    import json

    from rocketkv_cli.engine.engine import Engine
    from rocketkv_cli.model import loading

    monkeypatch.setenv("ROCKETKV_HOME", str(tmp_path))
    loaded = load_model(str(tiny_model_dir), device="cpu")
    assert {f.name for f in loaded.tokenizer_files} >= {"tokenizer.json"}
    first = Engine(loaded).identity.tokenizer_digest
    known = json.loads((tmp_path / "digests.json").read_text())
    assert [k for k in known if k.startswith("tokenizer@transformers-")], known  # keyed by the libraries too
    assert first == loading.tokenizer_digest(loaded.tokenizer)  # the same value as serialising it now
    calls = []
    monkeypatch.setattr(type(loaded.tokenizer.backend_tokenizer), "to_str", lambda *a: calls.append(1) or "x",
                        raising=False)  # fmt: skip
    assert Engine(load_model(str(tiny_model_dir), device="cpu")).identity.tokenizer_digest == first
    assert not calls  # read back, not serialised again


def _spy_tokenizer_loads(monkeypatch):
    """Count the builds of `AutoTokenizer` and of the direct read (each still runs for real)."""
    from transformers import AutoTokenizer

    from rocketkv_cli.model import loading

    calls = {"auto": 0, "direct": 0}
    auto_load, direct_load = AutoTokenizer.from_pretrained, loading._direct_tokenizer

    def auto(*args, **kwargs):
        calls["auto"] += 1
        return auto_load(*args, **kwargs)

    def direct(*args, **kwargs):
        calls["direct"] += 1
        return direct_load(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", auto)
    monkeypatch.setattr(loading, "_direct_tokenizer", direct)
    return calls


def _verdicts() -> list[str]:
    from rocketkv_cli.model import loading

    return [v for k, v in loading.DigestCache().known.items() if k.startswith("direct-tokenizer-")]


def test__load_tokenizer__direct_read_only_after_it_was_shown_equal(tiny_model_dir, tmp_path, monkeypatch):
    """The first load builds `AutoTokenizer`'s tokenizer and the direct read of tokenizer.json,
    compares their fingerprints, remembers the verdict and returns `AutoTokenizer`'s; later loads
    build only the direct read, which tokenizes, decodes and digests exactly as the other does."""
    from transformers import AutoTokenizer

    from rocketkv_cli.engine.engine import Engine
    from rocketkv_cli.model import loading

    monkeypatch.setenv("ROCKETKV_HOME", str(tmp_path))
    auto = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    calls = _spy_tokenizer_loads(monkeypatch)
    loading.load_tokenizer(str(tiny_model_dir))
    assert calls == {"auto": 1, "direct": 1} and _verdicts() == ["same"]
    second = loading.load_tokenizer(str(tiny_model_dir))
    assert calls == {"auto": 1, "direct": 2}  # AutoTokenizer no longer built
    text = "alpha river ünï 7\n\n  stone"
    assert second(text)["input_ids"] == auto(text)["input_ids"]
    assert second.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert loading.tokenizer_fingerprint(second) == loading.tokenizer_fingerprint(auto)
    identities = [Engine(load_model(str(tiny_model_dir), device="cpu")).identity for _ in range(2)]
    assert calls["auto"] == 1 and identities[0] == identities[1]  # caches stay valid across the switch


def test__load_tokenizer__a_direct_read_that_differs_is_never_used(tiny_model_dir, tmp_path, monkeypatch):
    """A direct read whose behaviour differs (here: another chat template) is refused once and for
    all for these files: every load keeps `AutoTokenizer`'s tokenizer."""
    from rocketkv_cli.model import loading

    monkeypatch.setenv("ROCKETKV_HOME", str(tmp_path))
    real = loading._direct_tokenizer

    def altered(where):
        tok = real(where)
        tok.chat_template = "{{ messages[0]['content'] }}"
        return tok

    monkeypatch.setattr(loading, "_direct_tokenizer", altered)
    auto_chat = loading.load_tokenizer(str(tiny_model_dir)).chat_template
    assert _verdicts() == ["differs"]
    calls = _spy_tokenizer_loads(monkeypatch)
    assert loading.load_tokenizer(str(tiny_model_dir)).chat_template == auto_chat != "{{ messages[0]['content'] }}"
    assert calls == {"auto": 1, "direct": 0}


def test__load_tokenizer__failures_of_the_direct_read_fall_back(tiny_model_dir, tmp_path, monkeypatch):
    """A direct read that cannot be built is judged 'differs' (a read error decides nothing); one
    that fails after a 'same' verdict falls back to `AutoTokenizer`; a damaged verdict store is
    rebuilt."""
    from rocketkv_cli.model import loading

    monkeypatch.setenv("ROCKETKV_HOME", str(tmp_path))
    (tmp_path / "digests.json").write_text("[]")  # valid JSON, not a store
    real = loading._direct_tokenizer
    monkeypatch.setattr(loading, "_direct_tokenizer", lambda where: (_ for _ in ()).throw(OSError("busy")))
    assert loading.load_tokenizer(str(tiny_model_dir)) is not None and _verdicts() == []
    monkeypatch.setattr(loading, "_direct_tokenizer", real)
    loading.load_tokenizer(str(tiny_model_dir))
    assert _verdicts() == ["same"]
    monkeypatch.setattr(loading, "_direct_tokenizer", lambda where: (_ for _ in ()).throw(KeyError("x")))
    tok = loading.load_tokenizer(str(tiny_model_dir))
    assert tok("alpha")["input_ids"] == real(tiny_model_dir)("alpha")["input_ids"]
    (tmp_path / "digests.json").unlink()
    loading.load_tokenizer(str(tiny_model_dir))
    assert _verdicts() == ["differs"]


@pytest.mark.parametrize(
    "change",
    ["template", "eos", "vocab", "cleanup"],
)
def test__tokenizer_fingerprint__sees_what_rocketkv_uses(tiny_model_dir, change):
    """The fingerprint changes with the chat template, a special token, one vocabulary entry, or
    the decode clean-up of spaces before punctuation."""
    from transformers import AutoTokenizer

    from rocketkv_cli.model.loading import tokenizer_fingerprint

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    before = tokenizer_fingerprint(tok)
    if change == "template":
        tok.chat_template = (tok.chat_template or "") + " "
    elif change == "eos":
        tok.eos_token = tok.convert_ids_to_tokens(5)
    elif change == "cleanup":
        tok.clean_up_tokenization_spaces = not tok.clean_up_tokenization_spaces
    else:
        tok.add_tokens(["zzqx"])
    assert tokenizer_fingerprint(tok) != before
