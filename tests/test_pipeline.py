"""docs/algorithm.md §5 invariants on tiny random-init models of every supported architecture."""

import dataclasses

import pytest
import torch
from conftest import ARCHS, make_engine, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import answer, decode_config_for
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.store.format import load_cache, save_cache

N_NEW = 12


def quiet_engine(arch, **kw):
    """Engine with no stop tokens or stop strings, so both sides generate exactly N_NEW tokens."""
    engine = make_engine(arch, **kw)
    engine.stop_ids = set()
    engine.prompt = dataclasses.replace(engine.prompt, stop_strings=())
    engine.model.generation_config.eos_token_id = None
    return engine


def doc(n_bytes=150, seed=0):
    text = text_of_bytes(n_bytes, seed)
    return Document(text=text, sha256=f"{seed:064x}", source="doc.txt")


FULL_CASES = [(arch, 1024) for arch in ARCHS] + [("llama", 37), ("gemma3_text", 37), ("gemma2", 37), ("mistral", 37)]


@pytest.mark.parametrize("arch, chunk", FULL_CASES, ids=[f"{a}-chunk{c}" for a, c in FULL_CASES])
def test__full_budget__greedy_equals_plain_transformers(arch, chunk):
    """Chunk 37 < document length: sliding-window trimming and positions across chunks are covered."""
    engine = quiet_engine(arch)
    document, question = doc(), "Which word comes first?"
    cfg = PrefillConfig(token_budget=100_000, max_new_tokens=N_NEW, chunk_tokens=chunk)
    stored = engine.ingest(document, cfg)
    assert all(layer.n_kept_tokens == min(stored.n_context_tokens, w or 10**9)
               for layer, w in zip(stored.layers, [s.sliding_window for s in engine.shape.layers]))  # fmt: skip
    ours = next(answer(engine, stored, [question], N_NEW, decode_config_for(stored)))
    ids = engine.document_ids(document) + engine.tokenizer(engine.prompt.question_text(question),
                                                                  add_special_tokens=False)["input_ids"]  # fmt: skip
    ref = engine.model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=1)
    assert list(ours.token_ids) == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__pruned__kept_count_and_positions(arch):
    engine = quiet_engine(arch)
    cfg = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, prompt_budget=40, pool_kernel_size=7)
    stored = engine.ingest(doc(300), cfg)
    n = stored.n_context_tokens
    for layer, spec in zip(stored.layers, engine.shape.layers):
        k, p = layer.keys, layer.positions
        if spec.sliding_window:
            assert p[0, 0].tolist() == list(range(n - spec.sliding_window, n))
        else:
            assert k.shape == (1, engine.shape.n_kv_heads, 40, engine.shape.head_dim)
            assert all(p[0, h, -8:].tolist() == list(range(n - 8, n)) for h in range(p.shape[1]))
            assert bool((p[..., 1:] > p[..., :-1]).all())  # original order, no duplicates


def sparse_setup(arch="llama"):
    engine = quiet_engine(arch)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=N_NEW, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(doc(400, seed=1), cfg)
    dec = decode_config_for(stored)
    full = engine.shape.full_layers[0]
    assert stored.layers[full].n_kept_tokens > dec.topk  # HSA really selects
    return engine, stored, dec


def test__save_load_answer__equals_in_memory(tmp_path):
    engine, stored, dec = sparse_setup()
    path = save_cache(stored, tmp_path / "doc.kv")
    loaded = load_cache(path)
    engine.check(loaded, str(path))
    for a, b in zip(stored.layers, loaded.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.positions, b.positions)
    qs = ["alpha?", "Where is the stone?"]
    a = [x.token_ids for x in answer(engine, stored, qs, N_NEW, dec)]
    b = [x.token_ids for x in answer(engine, loaded, qs, N_NEW, dec)]
    assert a == b and all(len(t) == N_NEW for t in a)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__questions_are_independent(arch):
    engine, stored, dec = sparse_setup(arch)
    before = [(x.keys.clone(), x.values.clone(), x.positions.clone()) for x in stored.layers]
    q1, q2 = "What is green?", "Name the river."
    both = [x.token_ids for x in answer(engine, stored, [q1, q2], N_NEW, dec)]
    alone = next(answer(engine, stored, [q2], N_NEW, dec)).token_ids
    assert both[1] == alone
    for old, new in zip(before, stored.layers):  # the stored cache itself is read-only
        assert all(torch.equal(a, b) for a, b in zip(old, (new.keys, new.values, new.positions)))


def test__probe_observation__keeps_document_tokens_only():
    engine = quiet_engine("gemma3_text")
    cfg = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, prompt_budget=40, observation="probe")
    stored = engine.ingest(doc(300), cfg)
    n = stored.n_context_tokens
    assert all(int(layer.positions.max()) == n - 1 for layer in stored.layers)


@pytest.mark.parametrize("arch, chunk", [("llama", 1024), ("qwen2", 1024), ("llama", 29)])
def test__pruned_dense_answer__equals_transformers_with_pruned_tokens_masked(arch, chunk):
    """Pruning = hiding the dropped tokens, per KV head, from every query after the document.

    Reference: plain transformers (eager), full recompute per step, explicit position ids
    0..L-1 and a 4D mask in which question/answer queries cannot see a head's pruned tokens.
    Catches wrong RoPE positions (e.g. questions placed at the compressed length).
    """
    engine = quiet_engine(arch)
    cfg = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, prompt_budget=60, pool_kernel_size=3,
                        chunk_tokens=chunk)  # fmt: skip
    document, question = doc(200, seed=2), "Which word?"
    stored = engine.ingest(document, cfg)
    dec = dataclasses.replace(decode_config_for(stored), sparse=False)
    ours = next(answer(engine, stored, [question], 8, dec)).token_ids
    n = stored.n_context_tokens
    ids = engine.document_ids(document) + engine.tokenizer(engine.prompt.question_text(question),
                                                                  add_special_tokens=False)["input_ids"]  # fmt: skip
    model, g = engine.model, engine.shape.n_heads // engine.shape.n_kv_heads
    masks_per_layer = [layer.positions[0] for layer in stored.layers]  # kept positions [Hkv, 60] per layer
    out = []
    for _ in range(8):
        length = len(ids)
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        mask = torch.zeros(len(masks_per_layer), engine.shape.n_heads, length, length, dtype=torch.float64)
        for li, kept_pos in enumerate(masks_per_layer):
            for h in range(engine.shape.n_heads):
                visible = allowed.clone()
                hidden = torch.ones(n, dtype=torch.bool)
                hidden[kept_pos[h // g]] = False
                visible[n:, :n] &= ~hidden
                mask[li, h] = torch.zeros(length, length, dtype=torch.float64).masked_fill(~visible, float("-inf"))
        hooks = [layer.self_attn.register_forward_pre_hook(_mask_hook(mask[li]), with_kwargs=True)
                 for li, layer in enumerate(model.model.layers)]  # fmt: skip
        try:
            logits = model(torch.tensor([ids]), position_ids=torch.arange(length).unsqueeze(0), use_cache=False).logits
        finally:
            for hk in hooks:
                hk.remove()
        token = int(logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
    assert list(ours) == out


def _mask_hook(mask):
    def hook(module, args, kwargs):
        kwargs["attention_mask"] = mask.unsqueeze(0)
        return args, kwargs

    return hook


@pytest.mark.parametrize("reconstruct", [False, True])
def test__prefill_progress__the_total_is_reported_before_the_first_chunk(reconstruct):
    """A progress bar showed "0/? tokens" for the whole first chunk (seconds on a CPU): the total is
    now reported first, as (0, n); then the tokens done grow to n, never past it."""
    engine = make_engine("llama", torch.float32)
    ids = list(range(3, 3 + 70))
    calls: list[tuple[int, int]] = []
    engine.prefill(ids, 8, chunk_tokens=16, progress=lambda done, total: calls.append((done, total)),
                   reconstruct=reconstruct)  # fmt: skip
    assert calls[0] == (0, len(ids)) and calls[-1] == (len(ids), len(ids)), calls
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:])) and {t for _, t in calls} == {len(ids)}, calls
