"""Weight-only int8 decode weights (`model/weights.py`): each product within the rounding bound
of per-channel int8, every linear converted, and `--weights int8` running with bfloat16
activations unless the user asks otherwise (float32 activations are the slow path of torch's
int8 kernel: benchmarks/linear_formats.py)."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from rocketkv_cli.model.loading import load_model, resolve_dtype
from rocketkv_cli.model.weights import Int8Linear, quantize_weights


@pytest.mark.parametrize("k, n, rows, bias", [(64, 48, 1, False), (96, 130, 3, True), (576, 192, 7, False)])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test__int8_linear__within_the_per_channel_rounding_bound(k, n, rows, bias, act):
    """|x·(W − Ŵ)ᵀ| ≤ ‖x‖₁ · e_o per output o, where e_o bounds |W − Ŵ| in row o: half a step of
    round-to-nearest of W / s_o with s_o = max|W_o| / 127 (LLM.int8(), arXiv 2208.07339 §3), plus
    127 codes times the rounding of s_o to the stored scale's dtype; on top of the activation
    dtype's own rounding, which the reference shares (x cast to `act` first)."""
    torch.manual_seed(k + n)
    linear = nn.Linear(k, n, bias=bias).to(act).requires_grad_(False)
    x = torch.randn(rows, k, dtype=act)
    q = Int8Linear(linear)
    got = q(x).float()
    xf, w = x.float(), linear.weight.float()
    exact = xf @ w.T + (linear.bias.float() if bias else 0)
    s = w.abs().amax(dim=1) / 127  # [n]
    per_weight = s / 2 + 127 * (s - s.to(act).float()).abs()  # [n]
    dequantized = q.weight_int8.float() * q.scales.float()[:, None]
    assert bool(((dequantized - w).abs() <= per_weight[:, None] * (1 + 1e-5)).all())  # the stored weights
    bound = xf.abs().sum(-1, keepdim=True) * per_weight  # [rows, n]
    slack = 3e-2 * exact.abs() + 3e-2 if act == torch.bfloat16 else 1e-4 * exact.abs() + 1e-4  # output rounding
    err = (got - exact).abs()
    assert bool((err <= bound + slack).all()), (
        f"max error {float(err.max()):.3e} (mean {float(err.mean()):.3e}) exceeds the bound "
        f"(max {float(bound.max()):.3e}) by {float((err - bound - slack).max()):.3e}"
    )


def test__quantize_weights__every_linear_and_the_lm_head():
    model = tiny_model("llama", torch.float32)
    linears = sum(isinstance(m, nn.Linear) for m in model.model.modules()) + 1  # + lm_head
    assert quantize_weights(model, "int8") == linears
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    assert quantize_weights(tiny_model("llama", torch.float32), "float") == 0
    with pytest.raises(ValueError, match="weights must be one of"):
        quantize_weights(model, "int3")


def test__int8_weights__bfloat16_activations_by_default_float32_on_request(tiny_model_dir):
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cpu, "int8") == torch.bfloat16
    assert resolve_dtype("float32", cpu, "int8") == torch.float32  # what the user named wins
    said: list[str] = []
    loaded = load_model(str(tiny_model_dir), device="cpu", weights="int8", progress=said.append)
    assert loaded.weights == "int8" and next(loaded.model.parameters()).dtype == torch.bfloat16
    assert not any("slower" in m for m in said), said
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32", weights="int8", progress=said.append)
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert any("int8 weights with float32 activations run slower" in m for m in said), said
