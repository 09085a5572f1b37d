"""Allocated key bits (`int4+alloc`, issue 13): each key channel its own width, chosen by the
document's query energy, in int4's bytes. The bit stream round-trips exactly, the allocation keeps
its budget and puts bits where queries look, rounding stays within half of each channel's step,
the logit error falls below uniform int4's, and the file (format v5) reads back bit-identically and
refuses damaged widths."""

import hashlib
import json
import struct

import pytest
import torch
from conftest import make_engine, text_of_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.core.quant import (
    ALLOC_WIDTHS,
    KVStorage,
    _pack_bits,
    _pack_fixed,
    _unpack_bits,
    _unpack_fixed,
    allocate_key_bits,
    decode_layer,
    encode_layer,
)
from rocketkv_cli.engine.answer import answer, decode_config_for
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.errors import CacheFormatError
from rocketkv_cli.methods import LayerPrefill
from rocketkv_cli.store import v3
from rocketkv_cli.store.format import load_cache, metadata_digest, save_cache

CFG = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, pool_kernel_size=7)
ALLOC = KVStorage.parse("int4+alloc")


def report(name, ref, out, bound):
    err = (ref - out).abs()
    return f"{name}: max error {float(err.max()):.3g} (bound {float(bound):.3g}), mean {float(err.mean()):.3g}"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test__bit_stream__codes_of_any_widths_round_trip_exactly(data):
    d = data.draw(st.integers(1, 24), label="channels")
    s = data.draw(st.integers(0, 40), label="tokens")
    widths = torch.tensor(data.draw(st.lists(st.integers(1, 8), min_size=d, max_size=d), label="widths"))
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    top = (2 ** widths.view(d, 1) - 1).expand(d, s)
    codes = (torch.rand(d, s, generator=torch.Generator().manual_seed(seed)) * (top + 1)).floor().clamp(max=top)
    codes = codes.to(torch.uint8)
    # a block per width, each ending on a byte: at most 7 bytes over the bits themselves
    n_bytes = sum(-(-int((widths == w).sum()) * s * w // 8) for w in set(widths.tolist()))
    assert n_bytes <= -(-int(widths.sum()) * s // 8) + 7
    stream = _pack_bits(codes, widths, n_bytes)
    assert stream.shape == (n_bytes,) and stream.dtype == torch.uint8
    assert torch.equal(_unpack_bits(stream, widths, s), codes)
    assert torch.equal(_unpack_bits(torch.cat([stream, stream.new_zeros(5)]), widths, s), codes)  # slack ignored
    if s and n_bytes:
        with pytest.raises(ValueError, match="bits"):
            _pack_bits(codes, widths, n_bytes - 1)
        with pytest.raises(ValueError, match="bits"):
            _unpack_bits(stream[:-1], widths, s)


@pytest.mark.parametrize("shape", [(1, 5, 32), (3, 130, 60), (2, 97, 64), (1, 300, 256)],
                         ids=["5x32", "130x60", "97x64", "300x256"])  # fmt: skip
def test__allocation__spends_exactly_four_bits_a_channel_in_the_allowed_widths(shape):
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(*shape, generator=g) * torch.rand(shape[-1], generator=g) * 5
    weight = torch.rand(shape[0], shape[-1], generator=g) ** 4
    widths = allocate_key_bits(keys, weight, 32)
    assert widths.shape == (shape[0], shape[-1]) and widths.dtype == torch.uint8
    assert set(widths.flatten().tolist()) <= set(ALLOC_WIDTHS)
    assert widths.long().sum(1).tolist() == [4 * shape[-1]] * shape[0]
    assert torch.equal(widths, allocate_key_bits(keys, weight, 32)), "not deterministic"


def test__allocation__bits_go_where_queries_look():
    keys = torch.randn(1, 256, 64, generator=torch.Generator().manual_seed(2))  # every channel the same spread
    weight = torch.ones(1, 64)
    weight[0, :16] = 100.0  # queries look hard at the first 16 channels
    weight[0, 16:32] = 0.01  # and barely at the next 16
    widths = allocate_key_bits(keys, weight, 64)[0].long()
    assert int(widths[:16].min()) > 4 > int(widths[16:32].max()), widths.tolist()
    with pytest.raises(ValueError, match="key weights"):
        allocate_key_bits(keys, -weight, 64)
    with pytest.raises(ValueError, match="key weights"):
        allocate_key_bits(keys, weight[:, :8], 64)


@pytest.mark.parametrize("shape", [(2, 97, 64), (1, 5, 32), (3, 130, 60), (2, 3, 8)],
                         ids=["97x64", "5x32", "130x60", "3x8"])  # fmt: skip
def test__allocated_round_trip__within_half_of_each_channels_step(shape):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(*shape, generator=g) * 3 + torch.linspace(-4, 4, shape[-1])
    keys[:, 0] *= 20  # a sink with outlier magnitudes
    values = torch.randn(*shape, generator=g)
    weight = torch.rand(shape[0], shape[-1], generator=g) ** 3
    storage = KVStorage("int4", key_group_tokens=32, value_group_dims=8 if shape[-1] == 8 else 16,
                        key_bits="allocated")  # fmt: skip
    parts = encode_layer(keys, values, storage, key_weights=weight)
    k, v = decode_layer(parts, storage, shape[-1])
    assert k.shape == keys.shape and v.shape == values.shape
    n_sinks = min(4, shape[1])
    bound = keys[:, :n_sinks].abs() * 2**-11 + 1e-7  # sinks: float16
    assert bool(((keys[:, :n_sinks] - k[:, :n_sinks]).abs() <= bound).all()), report("sinks", keys, k, bound.max())
    rest, out = keys[:, n_sinks:], k[:, n_sinks:]
    if rest.shape[1] == 0:
        return
    group = torch.arange(rest.shape[1]) // 32
    half_step = parts["keys.scale"].float()[:, group] / 2  # [Hkv, S, D]: each channel's own width
    assert bool(((rest - out).abs() <= half_step + 1e-5).all()), report("keys", rest, out, half_step.max())
    widths = parts["keys.bits"].long()
    if rest.shape[1] <= 32:  # one group: the scale is the span above the stored minimum over the channel's levels
        expect = (rest.amax(1) - parts["keys.min"].float()[:, 0]) / (2**widths - 1)
        assert torch.allclose(parts["keys.scale"].float()[:, 0], expect, rtol=2e-3, atol=1e-6), report(
            "scales", expect, parts["keys.scale"].float()[:, 0], 0
        )
    assert parts["keys.q"].shape == (shape[0], rest.shape[1] * shape[-1] // 2 + 8), "int4's bytes and 8 of slack"


def test__allocated_bits__lower_logit_error_than_uniform_int4():
    g = torch.Generator().manual_seed(3)
    hkv, s, d = 2, 512, 64
    spread = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]  # channel ranges over two decades
    keys = torch.randn(hkv, s, d, generator=g) * spread
    q_scale = torch.logspace(1, -1, d)[torch.randperm(d, generator=g)]  # queries favour other channels
    queries = torch.randn(hkv, 200, d, generator=g) * q_scale
    weight = (queries[:, :32] ** 2).mean(1)  # energy from 32 "window" queries; scored on all 200
    values = torch.randn(hkv, s, d, generator=g)

    def logit_mse(storage, **kw):
        k, _ = decode_layer(encode_layer(keys, values, storage, **kw), storage, d)
        return float((torch.einsum("htd,hsd->hts", queries, k - keys) ** 2).mean())

    uniform, allocated = logit_mse(KVStorage("int4")), logit_mse(ALLOC, key_weights=weight)
    assert allocated < 0.6 * uniform, f"allocated {allocated:.4g} vs uniform {uniform:.4g}"
    equal = logit_mse(ALLOC)  # no weights: ranges alone still beat one width for all
    assert equal < uniform, f"range-only {equal:.4g} vs uniform {uniform:.4g}"


@pytest.mark.parametrize("probe", [False, True], ids=["tail", "probe"])
def test__prefill__query_energy_from_the_window_in_every_layer(probe):
    engine = make_engine("gemma3_text", torch.float32)  # sliding-window and full-attention layers
    ids = engine.document_ids(Document(text_of_bytes(300), "0" * 64, "d.txt"))
    prefill = engine.prefill(ids, 8, probe=probe)  # the probe's queries are captured too, never weighed
    shape = engine.shape
    assert prefill.query_energy is not None and len(prefill.query_energy) == len(shape.layers)
    kinds = set()
    for layer, energy in zip(prefill.layers, prefill.query_energy):
        assert energy.shape == (shape.n_kv_heads, shape.head_dim) and bool(torch.isfinite(energy).all())
        assert float(energy.min()) >= 0 and float(energy.max()) > 0
        kinds.add(isinstance(layer, LayerPrefill))
        if isinstance(layer, LayerPrefill):  # the captured window, grouped by KV head
            assert (layer.n_probe_tokens > 0) == probe
            q = layer.queries[0, :, : layer.n_context_tokens - layer.capture_from]  # [H, W, D]: document rows only
            expect = (q**2).view(shape.n_kv_heads, -1, shape.head_dim).mean(1)
            assert torch.allclose(energy, expect, rtol=1e-6), report("energy", expect, energy, 0)
    assert kinds == {True, False}, "the tiny Gemma should have both kinds of layer"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__allocated_cache__file_v5_reads_back_bit_identically_and_answers_alike(arch, tmp_path):
    engine = make_engine(arch, torch.float32)
    engine.stop_ids = set()
    doc = Document(text_of_bytes(600), "0" * 64, "d.txt")
    stored = engine.ingest(doc, CFG, storage=ALLOC)
    path = save_cache(stored, tmp_path / "a.kv")
    loaded = load_cache(path)
    assert loaded.info.format_version == 5 and loaded.info.storage == ALLOC
    for a, b in zip(stored.layers, loaded.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    qs = ["Which word?", "Where is the stone?"]
    assert [x.token_ids for x in answer(engine, stored, qs, 8, decode_config_for(stored))] == [
        x.token_ids for x in answer(engine, loaded, qs, 8, decode_config_for(loaded))
    ]
    uniform = save_cache(engine.ingest(doc, CFG, storage=KVStorage("int4")), tmp_path / "u.kv")
    widths_bytes = sum(layer.keys.shape[1] * layer.keys.shape[-1] for layer in stored.layers)
    assert path.stat().st_size - uniform.stat().st_size <= widths_bytes + 4096  # the widths and their header entries


def _rewrite(path, out, edit_tensor=None, edit_meta=None):
    """`path` with one tensor's bytes or the metadata edited, every digest recomputed."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    raw = bytearray(data[8 + n :])
    meta = header["__metadata__"]
    if edit_tensor:
        name, fn = edit_tensor
        start, stop = header[name]["data_offsets"]
        t = torch.frombuffer(raw[start:stop], dtype=torch.uint8).clone()
        raw[start:stop] = fn(t).numpy().tobytes()
        segs = json.loads(meta["segments"])
        segs[0]["kv_sha256"] = hashlib.sha256(bytes(raw[segs[0]["kv"][0] : segs[0]["kv"][1]])).hexdigest()
        meta["segments"] = json.dumps(segs)
        meta["payload_sha256"] = v3._root(segs)
    if edit_meta:
        meta.update(edit_meta)
    meta["metadata_sha256"] = metadata_digest(meta)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    out.write_bytes(struct.pack("<Q", len(head)) + head + bytes(raw))
    return out


def _set(t, i, value):
    t[i] = value
    return t


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: _set(t, 0, 9),
        lambda t: _set(t, 0, 0),
        lambda t: torch.full_like(t, 5),
        lambda t: _set(t, int(t.argmin()), int(t.min()) + 1),
    ],
    ids=["width-9", "width-0", "over-the-int4-bytes", "one-bit-over-within-the-slack"],
)
def test__damaged_key_widths__refused_even_with_digests_recomputed(tmp_path, edit):
    engine = make_engine("llama", torch.float32)
    stored = engine.ingest(Document(text_of_bytes(40), "0" * 64, "d.txt"), CFG, storage=ALLOC)  # < 64 tokens
    path = save_cache(stored, tmp_path / "a.kv")
    flipped = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", flipped[:8])
    at = 8 + n + json.loads(flipped[8 : 8 + n])["segments.0.layers.1.keys.bits"]["data_offsets"][0]
    flipped[at] ^= 0x01
    (tmp_path / "flip.kv").write_bytes(bytes(flipped))
    with pytest.raises(CacheFormatError, match="KV digest mismatch"):
        load_cache(tmp_path / "flip.kv")
    rest = stored.layers[1].keys.shape[2] - 4  # tokens in integer groups
    assert rest * 1 <= 8 * 8, "the one-bit-over case must fit the stream's slack, so only the sum check refuses it"
    crafted = _rewrite(path, tmp_path / "crafted.kv", ("segments.0.layers.1.keys.bits", edit))
    with pytest.raises(CacheFormatError, match="disagree with the metadata"):
        load_cache(crafted).layers


def test__allocated_storage_in_a_v4_file__refused_as_malformed(tmp_path):
    engine = make_engine("llama", torch.float32)
    stored = engine.ingest(Document(text_of_bytes(300), "0" * 64, "d.txt"), CFG, storage=ALLOC)
    path = save_cache(stored, tmp_path / "a.kv")
    with pytest.raises(CacheFormatError, match="malformed metadata"):
        load_cache(_rewrite(path, tmp_path / "v4.kv", edit_meta={"format_version": "4"}))


def test__uniform_storage_claiming_v5__refused_as_malformed(tmp_path):
    """v5 is written for allocated key bits only: a v4 file relabelled v5 is another file, not the same."""
    engine = make_engine("llama", torch.float32)
    stored = engine.ingest(Document(text_of_bytes(300), "0" * 64, "d.txt"), CFG, storage=KVStorage("int4"))
    path = save_cache(stored, tmp_path / "u.kv")
    assert load_cache(path).info.format_version == 4
    with pytest.raises(CacheFormatError, match="malformed metadata"):
        load_cache(_rewrite(path, tmp_path / "v5.kv", edit_meta={"format_version": "5"}))


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 17, 64])
def test__fixed_width_blocks__all_ones_codes_round_trip(width, n):
    """Every code at its largest value: at width 8 the eighth code's top bit is the packed word's sign bit."""
    codes = torch.full((n,), (1 << width) - 1, dtype=torch.uint8)
    data = _pack_fixed(codes, width)
    assert data.numel() == -(-n * width // 8) and torch.equal(_unpack_fixed(data, width, n), codes)


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("n", [1, 8, 13, 67])
def test__fixed_width_unpack__equals_a_bit_by_bit_reader(width, n):
    """`_unpack_fixed` against the format's definition read one bit at a time in Python: code i
    is bits i·width … of the little-endian stream, least significant first. Random bytes, so
    every bit pattern of a byte occurs."""
    data = torch.randint(0, 256, (-(-n * width // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    bits = [(int(byte) >> k) & 1 for byte in data for k in range(8)]
    expected = [sum(bits[i * width + k] << k for k in range(width)) for i in range(n)]
    assert _unpack_fixed(data, width, n).tolist() == expected


def _fill(value, dtype):
    return lambda t: torch.full((t.numel() * 8 // torch.finfo(dtype).bits,), value, dtype=dtype).view(torch.uint8)


@pytest.mark.parametrize(
    "storage, name, dtype", [("float32", "values", torch.float32), ("bfloat16", "keys", torch.bfloat16)]
)
def test__finite_but_huge_stored_values__refused_with_digests_recomputed(tmp_path, storage, name, dtype):
    """A crafted cache whose keys or values are finite but huge (3e38, digests recomputed) passed
    every check and was answered: attention's products overflowed into NaN (blank answers, "nan%"
    citations, a sampler's RuntimeError). Values past `MAX_STORED_ABS` are refused on load and by
    `inspect`'s verification."""
    from rocketkv_cli.store.format import verify_file

    engine = make_engine("llama", torch.float32)
    stored = engine.ingest(Document(text_of_bytes(40), "0" * 64, "d.txt"), CFG, storage=KVStorage.parse(storage))
    path = save_cache(stored, tmp_path / "a.kv")
    tensor = f"segments.0.layers.1.{name}"
    load_cache(_rewrite(path, tmp_path / "fine.kv", (tensor, _fill(1.0, dtype)))).layers  # noqa: B018
    verify_file(tmp_path / "fine.kv")  # a plain value passes: the rewrite itself is sound
    crafted = _rewrite(path, tmp_path / "crafted.kv", (tensor, _fill(3e38, dtype)))
    with pytest.raises(CacheFormatError, match="disagree with the metadata"):
        verify_file(crafted)
    with pytest.raises(CacheFormatError, match="disagree with the metadata"):
        load_cache(crafted).layers  # noqa: B018


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "int4"])
def test__values_past_float16s_range__are_written_and_read_back(tmp_path, storage):
    """The writer keeps scales, minimums and sinks in float32 where float16's range is short (a
    model whose values pass 32,752): such a file reads back and verifies (a bound at float16's
    range refused it, and every rebuild wrote the same file)."""
    from rocketkv_cli.store.format import verify_file

    engine = make_engine("llama", torch.float32)
    for layer in engine.model.model.layers:
        layer.self_attn.v_proj.weight.data *= 1e5
    stored = engine.ingest(Document(text_of_bytes(40), "0" * 64, "d.txt"), CFG, storage=KVStorage.parse(storage))
    biggest = max(float(layer.values.abs().max()) for layer in stored.layers)
    assert biggest > 65504, biggest  # the case this checks
    path = save_cache(stored, tmp_path / "big.kv")
    verify_file(path)
    assert all(torch.isfinite(layer.values).all() for layer in load_cache(path).layers)


@pytest.mark.parametrize("part", ["keys.scale", "keys.min", "values.scale", "values.min", "sinks.keys"])
def test__integer_storage__float32_scales_no_model_makes_are_refused(part):
    """The check a file's layer passes (`store.v3_read._checked`), on a real layer's stored parts:
    a scale, minimum or sink stored as float32 (a dtype the format allows) of 3e38 (finite, past
    `MAX_STORED_ABS`) is refused; the same parts as written pass."""
    from rocketkv_cli.store.v3_read import _checked

    engine = make_engine("llama", torch.float32)
    storage = KVStorage.parse("int8")
    stored = engine.ingest(Document(text_of_bytes(40), "0" * 64, "d.txt"), CFG, storage=storage)
    layer = stored.layers[1]
    tensors = {f"layers.1.{p}": t for p, t in layer.stored.items()}
    tensors["layers.1.positions"] = layer.positions[0].to(torch.int32)
    assert _checked(tensors, 1, stored.info)
    tensors[f"layers.1.{part}"] = torch.full_like(tensors[f"layers.1.{part}"], 3e38, dtype=torch.float32)
    assert not _checked(tensors, 1, stored.info)
