"""Triton kernels against their torch references (docs/algorithm.md §6), and the dispatch rule of `ops`.

On a machine without CUDA the kernels run under `TRITON_INTERPRET=1` (set in conftest before
triton is imported) on small odd shapes; `gpu`-marked cases use larger shapes and run on CUDA only.
Tolerances are per dtype; top-k results are compared as index sets, excusing ties at the cut-off.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from rocketkv_cli import ops
from rocketkv_cli.core import stage1 as prefill
from rocketkv_cli.core import stage2 as decode

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]  # larger shapes

# (atol, rtol) per dtype for outputs in the input dtype; float32 scores use SCORE_TOL
OUT_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
SCORE_TOL = (1e-5, 1e-4)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float) -> None:
    """fla-style check with a verbose report: max and mean absolute error, where the worst one is."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ref64, out64 = ref.double(), out.double()
    err = (out64 - ref64).abs()
    bad = err > atol + rtol * ref64.abs()
    if bool(bad.any()) or not bool(torch.isfinite(out64).all()):
        worst = tuple(int(i) for i in torch.unravel_index(err.nan_to_num(float("inf")).argmax(), err.shape))
        pytest.fail(
            f"{name}: {int(bad.sum())}/{err.numel()} elements off (atol {atol}, rtol {rtol}); max abs err "
            f"{err.max().item():.3e}, mean abs err {err.mean().item():.3e}, worst at {worst}: "
            f"out {out64[worst].item():.6g} vs ref {ref64[worst].item():.6g}"
        )


def assert_same_topk(name: str, scores: torch.Tensor, ref_idx: torch.Tensor, out_idx: torch.Tensor, tol: float):
    """Per row of `[..., K]` selections: equal as sets, or differing only in items tied at the cut-off.

    scores: the reference scores `[..., N]` the selections were taken from (ties judged on them).
    """
    scores, ref_idx, out_idx = scores.flatten(0, -2), ref_idx.flatten(0, -2), out_idx.flatten(0, -2)
    for row in range(scores.shape[0]):
        ref_set, out_set = set(ref_idx[row].tolist()), set(out_idx[row].tolist())
        if ref_set == out_set:
            continue
        cut = scores[row, ref_idx[row]].min().item()
        differing = sorted(ref_set ^ out_set)
        off = [i for i in differing if abs(scores[row, i].item() - cut) > tol]
        assert not off, (f"{name}: row {row} selections differ in {differing[:10]}; not tied with the cut-off "
                         f"score {cut:.6g}: {[(i, scores[row, i].item()) for i in off[:5]]}")  # fmt: skip


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "triton")


# (B, Hkv, G, S, D, N_sel): lengths 1/63/97/1000, head dims 60/64/128/256, groups 1/3/4/7
ATTN_CASES = [
    pytest.param(1, 1, 1, 1, 64, 1, id="S1-D64-G1"),
    pytest.param(1, 2, 3, 63, 60, 40, id="S63-D60-G3"),
    pytest.param(2, 1, 7, 97, 64, 50, id="S97-D64-G7-B2"),
    pytest.param(1, 2, 4, 1000, 128, 203, id="S1000-D128-G4"),
    pytest.param(1, 1, 4, 97, 256, 37, id="S97-D256-G4"),
]
ATTN_CASES_GPU = [
    pytest.param(1, 8, 4, 131072, 128, 4096, id="S128K-D128-G4", marks=gpu),
    pytest.param(2, 2, 7, 32768, 64, 30001, id="S32K-D64-G7", marks=gpu),
    pytest.param(1, 1, 4, 32768, 256, 999, id="S32K-D256-G4", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, hkv, g, s, d, n_sel", ATTN_CASES + ATTN_CASES_GPU)
@pytest.mark.parametrize("softcap, n_splits", [(None, None), (20.0, 3)], ids=["plain", "softcap-3splits"])
def test__sparse_attention_triton__matches_reference(b, hkv, g, s, d, n_sel, dtype, softcap, n_splits):
    from rocketkv_cli.kernels.sparse_attention import sparse_attention_triton

    q = _randn(b, hkv * g, 1, d, dtype=dtype, seed=1)
    k, v = _randn(b, hkv, s, d, dtype=dtype, seed=2), _randn(b, hkv, s, d, dtype=dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    idx = torch.randint(0, s + 2, (b, hkv, n_sel), generator=gen).to(DEVICE)  # some past S: ignored
    idx[..., 0] = 0  # at least one valid token per head
    ref = decode.sparse_attention(q, k, v, idx, d**-0.5, softcap)
    out = sparse_attention_triton(q, k, v, idx, d**-0.5, softcap, n_splits=n_splits)
    assert out.dtype == ref.dtype
    assert_close("sparse_attention", ref, out, *OUT_TOL[dtype])


def test__sparse_attention_triton__reads_strided_cache_views():
    """The decode path passes views of a larger cache buffer (`RocketLayer.view()`): no copy needed."""
    from rocketkv_cli.kernels.sparse_attention import sparse_attention_triton

    buf_k, buf_v = _randn(1, 2, 80, 64, seed=5), _randn(1, 2, 80, 64, seed=6)
    k, v = buf_k[:, :, :61], buf_v[:, :, :61]  # [1, 2, 61, 64], not contiguous
    q = _randn(1, 6, 1, 64, seed=7).transpose(1, 2).contiguous().transpose(1, 2)  # strided query too
    idx = torch.arange(0, 61, 2, device=DEVICE).expand(1, 2, -1)
    assert_close("strided", decode.sparse_attention(q, k, v, idx, 0.125), sparse_attention_triton(q, k, v, idx, 0.125),
                 *OUT_TOL[torch.float32])  # fmt: skip


# (G, S, D, page_size, n_score_dims): selections not a multiple of the page size come from S
PAGE_CASES = [
    pytest.param(1, 1, 64, 1, 64, id="S1-D64-G1"),
    pytest.param(3, 63, 60, 4, 17, id="S63-D60-G3"),
    pytest.param(7, 97, 64, 5, 30, id="S97-D64-G7"),
    pytest.param(4, 1000, 128, 3, 60, id="S1000-D128-G4"),
    pytest.param(4, 97, 256, 3, 100, id="S97-D256-G4"),
]
PAGE_CASES_GPU = [
    pytest.param(4, 131071, 128, 7, 40, id="S128K-D128-G4", marks=gpu),
    pytest.param(7, 65537, 64, 3, 60, id="S64K-D64-G7", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g, s, d, page, r", PAGE_CASES + PAGE_CASES_GPU)
def test__page_summaries_triton__equal_reference_and_update_equals_rebuild(g, s, d, page, r, dtype):
    from rocketkv_cli.kernels.page_summaries import page_summaries_triton, update_page_summaries_triton

    k = _randn(1, 2, s, d, dtype=dtype, seed=8)
    ref_min, ref_max = decode.page_summaries(k, page)
    out_min, out_max = page_summaries_triton(k, page)
    assert torch.equal(out_min, ref_min) and torch.equal(out_max, ref_max), "page min/max differ from reference"
    n_pages = ref_min.shape[2]
    buf = torch.full((2, 1, 2, n_pages + 3, d), float("nan"), dtype=dtype, device=DEVICE)
    cuts = sorted({0, s // 3, s // 3 + 1, s - 1, s})  # append in uneven pieces, partial pages included
    for start, end in zip(cuts, cuts[1:]):
        update_page_summaries_triton(buf[0], buf[1], k[:, :, :end], start, page)
    assert torch.equal(buf[0][:, :, :n_pages], ref_min) and torch.equal(buf[1][:, :, :n_pages], ref_max)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g, s, d, page, r", PAGE_CASES + PAGE_CASES_GPU)
def test__page_scores_triton__matches_reference_and_same_top_pages(g, s, d, page, r, dtype):
    from rocketkv_cli.kernels.page_scores import page_scores_triton

    q, k = _randn(2, 2 * g, 1, d, dtype=dtype, seed=9), _randn(2, 2, s, d, dtype=dtype, seed=10)
    pmin, pmax = decode.page_summaries(k, page)
    counts = decode.page_token_counts(s, page, DEVICE)
    ref = decode.page_scores(q, pmin, pmax, counts, r)
    out = page_scores_triton(q, pmin, pmax, counts, r)
    assert out.dtype == torch.float32
    assert_close("page_scores", ref, out, *SCORE_TOL)
    n_top = max(1, ref.shape[-1] // 5)
    assert_same_topk("page top-k", ref, ref.topk(n_top).indices, out.topk(n_top).indices, tol=1e-5)


# (G, W, S, D): window queries against keys, causal by position
OBS_CASES = [
    pytest.param(1, 1, 1, 64, id="S1-W1-D64-G1"),
    pytest.param(3, 8, 63, 60, id="S63-W8-D60-G3"),
    pytest.param(7, 4, 97, 64, id="S97-W4-D64-G7"),
    pytest.param(1, 8, 1000, 128, id="S1000-W8-D128-G1"),
    pytest.param(4, 2, 97, 256, id="S97-W2-D256-G4"),
]
OBS_CASES_GPU = [
    pytest.param(4, 32, 32768, 128, id="S32K-W32-D128-G4", marks=gpu),
    pytest.param(7, 32, 9999, 64, id="S10K-W32-D64-G7", marks=gpu),
    pytest.param(4, 32, 8191, 256, id="S8K-W32-D256-G4", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g, w, s, d", OBS_CASES + OBS_CASES_GPU)
def test__observation_scores_triton__matches_reference_and_same_kept_set(g, w, s, d, dtype):
    from rocketkv_cli.kernels.observation_scores import observation_scores_triton, pool_scores_triton

    softcap = 30.0 if g == 3 else None
    q = _randn(1, 2 * g, w, d, seed=11)  # captured window queries are float32 (pipeline)
    k = _randn(1, 2, s, d, dtype=dtype, seed=12) * 2
    q_pos = torch.arange(max(0, s - w), max(0, s - w) + w, device=DEVICE)  # W may exceed S: later queries
    k_pos = torch.arange(s, device=DEVICE)
    ref = prefill.observation_scores(q, k, q_pos, k_pos, d**-0.5, softcap)
    out = observation_scores_triton(q, k, q_pos, k_pos, d**-0.5, softcap)
    atol, rtol = SCORE_TOL
    assert_close("observation_scores", ref, out, atol * g * w, rtol)
    ref_pool, out_pool = prefill.pool_scores(ref, 7), pool_scores_triton(out, 7)
    assert_close("pooled", ref_pool, out_pool, atol * g * w, rtol)
    assert torch.equal(pool_scores_triton(ref, 7), ref_pool), "pooling kernel differs from max_pool1d"
    budget = max(1, s // 3)
    ref_kept = prefill.snapkv_select(ref, budget, min(w, budget), 7)
    out_kept = prefill.snapkv_select(out, budget, min(w, budget), 7, pool=pool_scores_triton)
    assert_same_topk("kept tokens", ref_pool, ref_kept, out_kept, tol=atol * g * w + rtol * float(ref.max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "g, s, d, topk, page, r",
    [
        pytest.param(3, 97, 60, 30, 4, 17, id="S97-D60-G3-sel28"),  # 30 tokens → 7 pages of 4
        pytest.param(7, 63, 64, 16, 5, 64, id="S63-D64-G7-sel15"),
        pytest.param(4, 1000, 128, 128, 3, 60, id="S1000-D128-G4-sel126"),
        pytest.param(1, 40, 64, 64, 2, 9, id="exact-S40"),  # cache shorter than topk: exact
        pytest.param(4, 65536, 128, 128, 3, 60, id="S64K-D128-G4", marks=gpu),
    ],
)
def test__ops_hsa_decode__triton_equals_torch(monkeypatch, g, s, d, topk, page, r, dtype):
    q = _randn(1, 2 * g, 1, d, dtype=dtype, seed=13)
    k, v = _randn(1, 2, s, d, dtype=dtype, seed=14), _randn(1, 2, s, d, dtype=dtype, seed=15)
    pmin, pmax = ops.page_summaries(k, page)
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    ref_out, ref_idx = ops.hsa_decode(q, k, v, pmin, pmax, topk, page, r, d**-0.5)
    ref_sel, ref_sel2 = decode.hsa_decode(q, k, v, pmin, pmax, topk, page, r, d**-0.5)
    assert torch.equal(ref_out, ref_sel) and torch.equal(ref_idx, ref_sel2), "ops torch path != decode.hsa_decode"
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    out, idx = ops.hsa_decode(q, k, v, pmin, pmax, topk, page, r, d**-0.5)
    if s > topk:
        scores = decode.page_scores(q, pmin, pmax, decode.page_token_counts(s, page, DEVICE), r)
        assert_same_topk("selected pages", scores, ref_idx[..., ::page] // page, idx[..., ::page] // page, 1e-5)
    if torch.equal(idx, ref_idx):
        assert_close("hsa_decode", ref_out, out, *OUT_TOL[dtype])


def test__rocket_layer_context_pages__triton_equal_reference_whatever_the_tail(triton_backend):
    """The stored context's page summaries (Triton) equal the reference, and questions' tails
    appended, grown past the reserved room and cropped never change them."""
    from rocketkv_cli.model.hf import RocketLayer

    k = _randn(1, 2, 23, 60, seed=16)
    pos = torch.arange(23, device=DEVICE).view(1, 1, 23).expand(1, 2, 23).clone()
    layer = RocketLayer(k, k.clone(), pos, extra_tokens=3)
    ref = decode.page_summaries(k, 4)
    for question in range(2):
        for step in range(5):  # grows past the reserved room
            new = _randn(1, 2, 1, 60, seed=100 * question + step)
            layer.append(new, new, torch.tensor([23 + step], device=DEVICE))
            got = layer.context_pages(4)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (question, step)
        layer.crop_to_context()


@pytest.mark.parametrize(
    "op, args",
    [
        (
            "sparse_attention",
            lambda: (
                _randn(1, 2, 1, 64),
                _randn(1, 1, 5, 32),
                _randn(1, 1, 5, 32),
                torch.zeros(1, 1, 2, dtype=torch.long),
                1.0,
            ),
        ),  # fmt: skip
        ("page_scores", lambda: (_randn(1, 2, 1, 64), _randn(1, 1, 3, 64), _randn(1, 1, 3, 64), torch.ones(3), 65)),
        ("page_summaries", lambda: (_randn(1, 1, 5, 300), 2)),
        (
            "observation_scores",
            lambda: (_randn(1, 2, 4, 64), _randn(1, 1, 5, 64).transpose(2, 3), torch.arange(4), torch.arange(5), 1.0),
        ),  # fmt: skip
    ],
)
def test__launchers__reject_bad_shapes_with_value_error(triton_backend, op, args):
    with pytest.raises(ValueError, match=r"_triton: .*(\(|\d)"):
        getattr(ops, op)(*args())


def test__launchers__cpu_tensors_without_interpreter_raise_clear_error(monkeypatch, triton_backend):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if CUDA:
        pytest.skip("CPU-tensor check; on a GPU machine the kernels are not interpreted")
    with pytest.raises(ValueError, match="need CUDA tensors .*TRITON_INTERPRET=1.*ROCKETKV_KERNELS=torch"):
        ops.page_summaries(torch.randn(1, 1, 8, 16), 4)


# --- dispatch rule -----------------------------------------------------------------------------

FAKE_CUDA = types.SimpleNamespace(is_cuda=True, device="cuda:0")


@pytest.mark.parametrize("value", ["", "auto", "AUTO", " torch", "triton"])
def test__requested_backend__accepts_the_three_values(monkeypatch, value):
    monkeypatch.setenv(ops.ENV_VAR, value)
    assert ops.requested_backend() == (value.strip().lower() or "auto")


def test__requested_backend__invalid_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="ROCKETKV_KERNELS must be one of auto, torch, triton, got 'cuda'"):
        ops.sparse_attention(*[torch.zeros(1)] * 4, 1.0)


def test__dispatch__auto_uses_torch_for_cpu_and_triton_for_cuda(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.implementation("sparse_attention", torch.zeros(1)) is decode.sparse_attention
    assert ops.implementation("pool_scores", torch.zeros(1)) is prefill.pool_scores
    assert ops.implementation("sparse_attention", FAKE_CUDA).__name__ == "sparse_attention_triton"
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.implementation("page_scores", FAKE_CUDA) is decode.page_scores
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    assert ops.implementation("page_scores", torch.zeros(1)).__name__ == "page_scores_triton"


def test__dispatch__every_op_has_a_loadable_kernel_of_the_reference_signature():
    import inspect

    for op, (reference, _) in ops.DISPATCH.items():
        kernel = ops.implementation(op, FAKE_CUDA)
        ref_params = list(inspect.signature(reference).parameters)
        assert list(inspect.signature(kernel).parameters)[: len(ref_params)] == ref_params, op


def test__dispatch__without_triton_auto_falls_back_and_forced_triton_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    for name in [m for m in sys.modules if m.startswith("rocketkv_cli.kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv(ops.ENV_VAR, "auto")
    assert ops.implementation("sparse_attention", FAKE_CUDA) is decode.sparse_attention
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16)
    pmin, pmax = ops.page_summaries(k, 4)  # the whole torch path runs without triton
    out, idx = ops.hsa_decode(q, k, k, pmin, pmax, topk=8, page_size=4, n_score_dims=5, scaling=0.25)
    assert out.shape == (1, 4, 1, 16) and idx.shape == (1, 2, 8)
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    with pytest.raises(ops.KernelUnavailableError, match="pip install triton.*ROCKETKV_KERNELS=torch"):
        ops.implementation("sparse_attention", torch.zeros(1))


def test__dispatch__backend_logged_once_per_op_at_debug(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_logged", set())
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    with caplog.at_level(logging.DEBUG, logger="rocketkv_cli.ops"):
        for _ in range(3):
            ops.pool_scores(torch.zeros(1, 1, 5), 3)
    records = [r for r in caplog.records if r.name == "rocketkv_cli.ops"]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG and "torch backend" in records[0].getMessage()


def test__dispatch__kernel_exceptions_propagate(monkeypatch, triton_backend):
    with pytest.raises(ValueError, match="n_score_dims"):
        ops.page_scores(_randn(1, 1, 1, 16), _randn(1, 1, 2, 16), _randn(1, 1, 2, 16), torch.ones(2), 0)


# --- the product path through the kernels ------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # GQA group 3; soft-capping and sliding layers
def test__ingest_and_answer__triton_backend_equals_torch(monkeypatch, arch):
    """Stage-1 scoring/pooling (pipeline) and the HSA decode step (hf attention) through `ops`; the
    engine runs on the GPU when there is one (where Triton kernels take CUDA tensors only)."""
    from conftest import make_engine, text_of_bytes

    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.engine.answer import answer, decode_config_for
    from rocketkv_cli.engine.inputs import Document

    engine = make_engine(arch, dtype=torch.float32, device=DEVICE)
    engine.stop_ids = set()
    document = Document(text=text_of_bytes(300, seed=2), sha256="0" * 64, source="doc.txt")
    cfg = PrefillConfig(token_budget=32, max_new_tokens=6, window_size=8, pool_kernel_size=5)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(ops.ENV_VAR, backend)
        stored = engine.ingest(document, cfg)
        dec = decode_config_for(stored)
        assert all(stored.layers[i].n_kept_tokens > dec.topk for i in engine.shape.full_layers)  # HSA selects
        runs[backend] = (stored, next(answer(engine, stored, ["Which word?"], 6, dec)).token_ids)
    (ref, ref_ids), (out, out_ids) = runs["torch"], runs["triton"]
    for a, b in zip(ref.layers, out.layers):
        assert torch.equal(a.positions, b.positions), "stage 1 kept other tokens with the Triton backend"
    assert list(out_ids) == list(ref_ids)
