"""`--weights head-int4` (`model/heads.py`, `CertifiedHead`): the LM head ranks in int4, and
every decode step's greedy token is proven to be the float head's — the bound on the int4
copy's error is never below the real error, the certificate's outcomes are all reached, and a
position it cannot certify takes the float head whole."""

import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import SHARED_DATA, byte_tokenizer, tiny_config, tiny_model
from torch import nn

from rocketkv_cli.model.weights import CertifiedHead, Int4Linear, decode_step, quantize_weights

VOCAB_INT4 = 272  # the byte tokenizer's 258 tokens, padded to a multiple of 16 (the int4 kernel's packing)


def _tiny_gemma(seed: int = 0):
    """A tiny random Gemma 3 (tied head `[272, 64]`, which the int4 kernel packs), float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config("gemma3_text")
    cfg.vocab_size = VOCAB_INT4
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    return model.requires_grad_(False)


def _head(v: int, h: int, seed: int, bias: bool = False, outliers: bool = False) -> nn.Linear:
    """A random head `[v, h]`; `outliers`: rows of very different scales, as real embeddings have."""
    torch.manual_seed(seed)
    head = nn.Linear(h, v, bias=bias).requires_grad_(False)
    if outliers:
        head.weight.mul_(torch.rand(v, 1) * 8)
        head.weight[:, :3] *= 10  # a few channels with large weights
    return head


def _inputs(n: int, h: int, seed: int) -> torch.Tensor:
    """`[n, h]` inputs shaped like a final norm's output: a few channels much larger than the rest."""
    torch.manual_seed(seed)
    x = torch.randn(n, h) * 3
    x[:, torch.randperm(h)[:4]] *= 15
    return x


def _certified(head: nn.Linear) -> CertifiedHead:
    return CertifiedHead(head)


@pytest.mark.parametrize("v, h, bias, outliers", [(256, 64, False, False), (512, 96, True, True),
                                                   (1024, 640, False, True)])  # fmt: skip
def test__error_bound__never_below_the_int4_copys_real_error(v, h, bias, outliers):
    """|z_r − ẑ_r| ≤ `error_bound` for every row r and every input (z in float64 from the float
    weights, ẑ the int4 head's own output), including inputs whose bfloat16 rounding matters
    (large channels); and the bound is not vacuous: the real error reaches a fair share of it."""
    head = _head(v, h, seed=v + h, bias=bias, outliers=outliers)
    module = _certified(head)
    x = _inputs(300, h, seed=h)
    approx = module.approx(x).float()  # [300, V], ẑ as the module ranks with it
    exact = x.double() @ head.weight.double().T + (head.bias.double() if bias else 0)
    bound = module.error_bound(x, approx)  # [300, V]
    err = (exact - approx.double()).abs()
    assert bool((err <= bound.double()).all()), f"violated by {float((err - bound.double()).max()):.3e}"
    assert float((err / bound.double()).max()) > 0.05, float((err / bound.double()).max())


def test__error_bound__tight_for_an_input_aligned_with_a_rows_error():
    """Cauchy–Schwarz is tight when x points along row r's quantization error (x ∝ Ŵ_r − W_r,
    exact in bfloat16): the real error reaches 90% of the bound there, so a bound that
    underestimated the int4 rounding by a tenth would fail `test__error_bound__never_below_*`."""
    head = _head(256, 64, seed=7)
    module = _certified(head)
    codes, scale, zero = Int4Linear.quantize(head.weight.float())
    dequantized = ((codes - 8) * scale[..., None] + zero[..., None]).view(256, 64)  # Ŵ
    direction = dequantized[0] - head.weight[0]
    x = (30 * direction / direction.abs().max()).bfloat16().float()[None]  # [1, 64]
    approx = module.approx(x).float()
    bound = module.error_bound(x, approx)[0, 0].double()
    err = (x.double() @ head.weight.double().T - approx.double())[0, 0].abs()
    assert 0.9 * bound < err <= bound, (float(err), float(bound))


@pytest.mark.real_model
def test__error_bound__never_below_the_real_error_on_gemma_weights():
    """The same on Gemma 3 270M's own head `[262144, 640]` and hidden states of real text (the
    GPL): every row, 50 positions; and the certified argmax is the float head's there."""
    from rocketkv_cli.model.loading import load_model

    loaded = load_model("gemma-3-270m", device="cpu", weights="head-int4")
    head = loaded.model.lm_head
    assert isinstance(head, CertifiedHead)
    text = (SHARED_DATA / "gpl-3.txt").read_text()[:3000]
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, :200]
    with torch.inference_mode():
        x = loaded.model.model(ids).last_hidden_state[0, ::4]  # [50, 640], after the final norm
        approx = head.approx(x).float()
        bound = head.error_bound(x, approx)
        exact = x.double() @ head.float_weight.double().T
        err = (exact - approx.double()).abs()
        assert bool((err <= bound.double()).all()), f"violated by {float((err - bound.double()).max()):.3e}"
        with decode_step():
            got = head(x)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


def test__head_int4__greedy_equals_the_float_heads_over_many_decode_steps():
    """A tiny Gemma with `head-int4`: only the LM head changes (a `CertifiedHead` over the tied
    embedding), prefill's logits equal the float model's exactly, and in decode steps every
    position's argmax is the float model's; the certificate's outcomes add up to the positions."""
    model = _tiny_gemma()
    torch.manual_seed(1)
    ids = torch.randint(2, 258, (8, 40))
    with torch.inference_mode():
        ref = model(ids).logits  # [8, 40, V]
    linears = [m for m in model.model.modules() if isinstance(m, nn.Linear)]
    assert quantize_weights(model, "head-int4") == 1
    assert [m for m in model.model.modules() if isinstance(m, nn.Linear)] == linears
    head = model.lm_head
    assert isinstance(head, CertifiedHead) and isinstance(head.approx, Int4Linear)
    assert head.float_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ref)
        with decode_step():
            step = model(ids).logits
    assert torch.equal(step.argmax(-1), ref.argmax(-1))
    assert sum(head.positions.values()) == ids.numel()
    assert head.positions["topk"] + head.positions["widened"] > 0, head.positions


def test__certified_head__widens_and_certifies_when_the_top_k_is_too_small(monkeypatch):
    """With TOPK = 1 the first row alone rarely proves itself: the rows the bound leaves in doubt
    are recomputed ("widened"), and the argmax is still the float head's on every position."""
    head = _head(512, 96, seed=3)
    module = _certified(head)
    monkeypatch.setattr(CertifiedHead, "TOPK", 1)
    x = _inputs(200, 96, seed=4)
    with decode_step():
        got = module(x)
    assert torch.equal(got.argmax(-1), (x.double() @ head.weight.double().T).argmax(-1))
    assert module.positions["widened"] > 0 and module.positions["topk"] >= 0, module.positions
    assert sum(module.positions.values()) == 200


def test__certified_head__one_row_outside_decode_steps_is_certified_several_take_the_float_head():
    """A question's prefill asks for its last position's logits only: that one row is ranked and
    certified as a decode step's (its greedy token the float head's); a forward of several rows
    (ingest) gets the float head's logits exactly."""
    head = _head(512, 96, seed=5, bias=True)
    module = _certified(head)
    x = _inputs(30, 96, seed=6)
    for row in x:
        got = module(row.view(1, 1, -1))  # [1, 1, V], as a prefill's last position
        assert got.shape == (1, 1, 512) and int(got.argmax()) == int((row.double() @ head.weight.double().T
                                                                      + head.bias.double()).argmax())  # fmt: skip
    assert sum(module.positions.values()) == 30
    several = module(x.view(1, 30, -1))
    assert torch.equal(several, torch.nn.functional.linear(x.view(1, 30, -1), head.weight, head.bias))
    assert sum(module.positions.values()) == 30  # not certified: taken whole


@pytest.mark.parametrize("force", ["too_many_in_doubt", "near_tie"])
def test__certified_head__falls_back_to_the_float_head_exactly(force, monkeypatch):
    """A position the certificate cannot settle takes the float head whole: its logits equal
    `F.linear`'s bit for bit. Forced two ways: too many rows in doubt (TOPK = 1 and no widening
    allowed), or two identical rows holding the largest logit (an exact tie)."""
    head = _head(256, 64, seed=5)
    x = _inputs(20, 64, seed=6)
    if force == "near_tie":
        best = int((x[0] @ head.weight.T).argmax())
        head.weight[(best + 1) % 256] = head.weight[best]
        x = x[:1]
    module = _certified(head)
    if force == "too_many_in_doubt":
        monkeypatch.setattr(CertifiedHead, "TOPK", 1)
        monkeypatch.setattr(CertifiedHead, "WIDEN_FRACTION", 10**9)  # widen at most TOPK rows
    fell_back = 0
    for row in x:  # one position at a time, as decode runs: which ones fell back is then known
        before = module.positions["float"]
        with decode_step():
            got = module(row[None])[0]
        if module.positions["float"] > before:
            fell_back += 1
            assert torch.equal(got, F.linear(row[None], head.weight)[0])
        assert int(got.argmax()) == int((row.double() @ head.weight.double().T).argmax())
    assert fell_back >= (1 if force == "near_tie" else len(x) // 2), module.positions


def test__int4_linear__quantized_in_chunks_of_rows_equals_all_at_once(monkeypatch):
    """`Int4Linear` quantizes and packs `ROWS_PER_CHUNK` rows at a time (4x faster on Gemma's
    head): the packed codes, scales and products equal those of one chunk holding every row."""
    head = _head(336, 96, seed=8, bias=True)  # 336 rows: 5 chunks of 64 and a tail of 16
    whole = Int4Linear(head)
    monkeypatch.setattr(Int4Linear, "ROWS_PER_CHUNK", 64)
    chunked = Int4Linear(head)
    assert torch.equal(chunked.weight_int4, whole.weight_int4)
    assert torch.equal(chunked.scales_zeros, whole.scales_zeros)
    x = _inputs(5, 96, seed=9)
    assert torch.equal(chunked(x), whole(x))


def test__head_int4__a_head_the_int4_kernel_cannot_pack_stays_float():
    """The tiny Llama's head has 258 rows (not a multiple of 16): `head-int4` leaves it an
    `nn.Linear`, converts nothing, and the model's logits are the float model's in decode too."""
    model = tiny_model("llama", torch.float32)
    assert not Int4Linear.fits(model.lm_head)
    ids = torch.arange(2, 30).view(1, -1)
    with torch.inference_mode():
        ref = model(ids).logits
    assert quantize_weights(model, "head-int4") == 0
    assert type(model.lm_head) is nn.Linear
    with torch.inference_mode(), decode_step():
        assert torch.equal(model(ids).logits, ref)


def test__ask_weights_head_int4__answers_as_the_float_model(rocketkv_bin, tmp_path):
    """`rocketkv ask DOC Q --weights head-int4` on a model whose head the int4 kernel packs gives
    the float model's greedy answer, token for token."""
    import os

    model_dir = tmp_path / "tiny-gemma"
    _tiny_gemma(seed=2).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbor master keeps the tide tables. The secret code is 4242. " * 30)
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    answers = {}
    for fmt in ("float", "head-int4"):
        r = subprocess.run([rocketkv_bin, "ask", str(doc), "What is the code?", "--model", str(model_dir),
                            "--weights", fmt, "--max-new-tokens", "12", "--budget", "64"],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        answers[fmt] = r.stdout
    assert answers["head-int4"] == answers["float"] and answers["float"].strip()


def _saved_tiny_gemma(tmp_path, monkeypatch):
    model_dir = tmp_path / "tiny-gemma"
    _tiny_gemma(seed=3).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    monkeypatch.setenv("ROCKETKV_HOME", str(tmp_path / "home"))
    return model_dir


def _load_head(model_dir, dtype: str = "float32") -> CertifiedHead:
    """The LM head of the model loaded as the Python API loads it (`RocketKV.load`: prepared heads
    kept under `$ROCKETKV_HOME/prepared`)."""
    from rocketkv_cli.api.rocketkv import RocketKV

    head = RocketKV.load(str(model_dir), device="cpu", dtype=dtype, weights="head-int4").engine.model.lm_head
    assert isinstance(head, CertifiedHead)
    return head


def _quantized_again(head: CertifiedHead) -> CertifiedHead:
    """A CertifiedHead built from `head`'s own float weights, nothing read from a file."""
    v, h = head.float_weight.shape
    linear = nn.Linear(h, v, bias=head.float_bias is not None, dtype=head.float_weight.dtype)
    linear.weight = nn.Parameter(head.float_weight, requires_grad=False)
    if head.float_bias is not None:
        linear.bias = nn.Parameter(head.float_bias, requires_grad=False)
    return CertifiedHead(linear)


def _assert_same_head(got: CertifiedHead, want: CertifiedHead) -> None:
    theirs = want.prepared()
    for name, t in got.prepared().items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name


def test__prepared_head__saved_by_one_load_and_read_by_the_next(tmp_path, monkeypatch):
    """`head-int4`'s int4 copy and bounds are written under the rocketkv home by the first load and
    read back by the next (not quantized again); what is read equals what quantizing gives."""
    from rocketkv_cli.model import prepared

    model_dir = _saved_tiny_gemma(tmp_path, monkeypatch)
    _load_head(model_dir)
    assert len(list((tmp_path / "home" / "prepared").glob("*.safetensors"))) == 1
    given = []

    def spy(head, prepared=None):
        given.append(prepared)
        return CertifiedHead(head, prepared=prepared)

    monkeypatch.setattr(prepared, "CertifiedHead", spy)
    second = _load_head(model_dir)
    assert len(given) == 1 and given[0] is not None, "the second load quantized the head again"
    _assert_same_head(second, _quantized_again(second))


@pytest.mark.parametrize("damage", ["flip a weight byte", "truncate", "not safetensors"])
def test__prepared_head__a_damaged_file_is_never_trusted(tmp_path, monkeypatch, damage):
    """The certificate's proof rests on the saved bounds: a damaged file (a flipped byte in its
    tensors, cut short, or garbage) is ignored, the head quantized again and the file rewritten."""
    model_dir = _saved_tiny_gemma(tmp_path, monkeypatch)
    _load_head(model_dir)
    (saved,) = (tmp_path / "home" / "prepared").glob("*.safetensors")
    good = saved.read_bytes()
    data = bytearray(good)
    if damage == "flip a weight byte":
        data[-3] ^= 0x10  # in the last tensor's bytes
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a safetensors file")
    saved.write_bytes(bytes(data))
    head = _load_head(model_dir)
    _assert_same_head(head, _quantized_again(head))
    from safetensors import safe_open

    from rocketkv_cli.store.prepared import PreparedTensors

    with safe_open(str(saved), framework="pt") as f:
        key = f.metadata()["key"]
    again = PreparedTensors(saved.parent).read(key)
    assert again is not None and len(saved.read_bytes()) == len(good), "the damaged file was not rewritten"
    assert all(torch.equal(t, head.prepared()[name]) for name, t in again.items())


def test__prepared_head__another_dtype_gets_its_own_bounds(tmp_path, monkeypatch):
    """The bounds hold for the float head they were derived from: the model loaded in bfloat16
    gets a file of its own, and its head equals one quantized from its own (bfloat16) weights."""
    model_dir = _saved_tiny_gemma(tmp_path, monkeypatch)
    _load_head(model_dir)
    head = _load_head(model_dir, dtype="bfloat16")
    assert len(list((tmp_path / "home" / "prepared").glob("*.safetensors"))) == 2
    assert head.float_weight.dtype == torch.bfloat16
    _assert_same_head(head, _quantized_again(head))


def test__prepared_head__a_read_only_home_only_costs_the_quantization(tmp_path, monkeypatch):
    model_dir = _saved_tiny_gemma(tmp_path, monkeypatch)
    home = tmp_path / "home"
    home.mkdir()
    (home / "prepared").write_text("a file where the folder would be")  # no folder can be made there
    head = _load_head(model_dir)
    _assert_same_head(head, _quantized_again(head))


@pytest.mark.parametrize("v", [262144, 151936, 65536, 49152, 300, 40])
def test__top_indices__hold_the_values_of_topk_even_among_ties(v):
    """The two-level selection returns k distinct indices whose values are `torch.topk`'s, on rows
    rounded to bfloat16 (as the int4 head's logits are: many ties at the k-th place) and on rows
    with a few huge values in one block; vocabularies with many blocks and the fallback."""
    from rocketkv_cli.model.heads import top_indices

    g = torch.Generator().manual_seed(v)
    rows = (torch.randn(6, v, generator=g) * 4).bfloat16().float()
    rows[1, :40] = 1e4  # the largest values crowded into one block
    rows[2] = 1.0  # every value tied
    for k in (64, 7, 1):
        idx = top_indices(rows, k)
        assert idx.shape == (6, min(k, v))
        assert all(len(set(r.tolist())) == min(k, v) for r in idx), "indices must be distinct"
        got = rows.gather(-1, idx).sort(dim=-1, descending=True).values
        want = rows.topk(min(k, v), dim=-1).values
        assert torch.equal(got, want), f"k={k}: max difference {float((got - want).abs().max()):.3g}"
