"""Stored keys/values (issue 13): each storage type round-trips within its stated error bound,
the Hadamard rotation is undone exactly, quantized caches answer the same in memory and from the
file, damage to scales is caught, and a segmented file is verified segment by segment."""

import dataclasses
import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from conftest import make_engine, text_of_bytes

from rocketkv_cli.api.documents import TextPieces
from rocketkv_cli.api.segments import ingest_stream
from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.core.quant import KVStorage, decode_layer, encode_layer, hadamard
from rocketkv_cli.engine.answer import answer, decode_config_for
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.errors import CacheFormatError
from rocketkv_cli.store.format import load_cache, metadata_digest, save_cache

CFG = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, pool_kernel_size=7)


def report(name, ref, out, bound):
    err = (ref - out).abs()
    return f"{name}: max error {float(err.max()):.3g} (bound {float(bound):.3g}), mean {float(err.mean()):.3g}"


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(2, 97, 64), (1, 5, 32), (3, 130, 60), (2, 3, 8)],
                         ids=["97x64", "5x32", "130x60", "3x8"])  # fmt: skip
@pytest.mark.parametrize("rotation", ["none", "hadamard", "rope"])
@pytest.mark.parametrize("sinks", [4, 0])
def test__integer_round_trip__within_half_a_step(kv_dtype, shape, rotation, sinks):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(*shape, generator=g) * 3 + torch.linspace(-4, 4, shape[-1])  # per-channel offsets
    keys[:, 0] *= 20  # a sink with outlier magnitudes
    values = torch.randn(*shape, generator=g)
    storage = KVStorage(kv_dtype, key_group_tokens=32, value_group_dims=16, rotation=rotation, sink_tokens=sinks)
    positions = torch.sort(torch.randperm(4 * shape[1], generator=g)[: shape[1]]).values.expand(shape[0], -1)
    freqs = 1.0 / 10000 ** (torch.arange(0, shape[-1], 2) / shape[-1])
    parts = encode_layer(keys, values, storage, positions, freqs)
    k, v = decode_layer(parts, storage, shape[-1], positions)
    assert k.shape == keys.shape and v.shape == values.shape
    n_sinks = min(sinks, shape[1])
    # the sinks: float16, relative rounding 2^-11 (the values here are all in its normal range)
    for name, ref, out in (("sink keys", keys, k), ("sink values", values, v)):
        ref, out = ref[:, :n_sinks], out[:, :n_sinks]
        bound = ref.abs() * 2**-11 + 1e-7
        assert bool(((ref - out).abs() <= bound).all()), report(name, ref, out, bound.max())
    if n_sinks == shape[1]:
        assert parts["keys.q"].shape[1] == 0 and parts["keys.min"].shape[1] == 0
        return
    keys, values, k, v = keys[:, n_sinks:], values[:, n_sinks:], k[:, n_sinks:], v[:, n_sinks:]
    levels = (1 << storage.bits) - 1
    # half a quantization step of the widest group (keys: in the rotated basis, so ×√D after rotation)
    if rotation == "none":
        step_k = float(parts["keys.scale"].float().max())
        assert float((keys - k).abs().max()) <= step_k / 2 + 1e-5, report("keys", keys, k, step_k / 2)
    elif rotation == "rope":  # per pair of channels, a rotation: the pair's error is that of the un-rotated pair
        from rocketkv_cli.core.quant import rope_rotate

        step_k = float(parts["keys.scale"].float().max())
        rest = positions[:, n_sinks:]
        err = rope_rotate(keys, rest, freqs, inverse=True) - rope_rotate(k, rest, freqs, inverse=True)
        assert float(err.abs().max()) <= step_k / 2 + 1e-4, report("un-rotated keys", keys, k, step_k / 2)
        assert torch.equal(parts["keys.rope_freqs"], freqs.float())
    else:
        step_k = float(parts["keys.scale"].float().max())
        rot_err = (keys @ hadamard(shape[-1]) - k @ hadamard(shape[-1])).abs().max()
        assert float(rot_err) <= step_k / 2 + 1e-4, report("rotated keys", keys, k, step_k / 2)
    step_v = float(parts["values.scale"].float().max())
    assert float((values - v).abs().max()) <= step_v / 2 + 1e-5, report("values", values, v, step_v / 2)
    assert step_v <= float(values.max() - values.min()) / levels + 1e-3
    assert parts["keys.q"].dtype == torch.uint8 and parts["keys.q"].shape[-1] == shape[-1] // (8 // storage.bits)
    if sinks and shape[1] > 40:  # the sink's outliers stay out of the first key group's range
        assert float(parts["keys.scale"][:, 0].float().max()) < 40 / levels


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test__constant_groups__scales_never_negative(kv_dtype):
    """A group whose values are all equal, at a value float16 rounds up (0.3 -> 0.30005): the stored
    minimum must not exceed the group's values, or the scale goes negative and the loader rightly
    refuses the file (seen on SmolLM2 at t=1024: "layer tensors disagree with the metadata")."""
    keys = torch.full((2, 70, 64), 0.3)
    keys[:, :, 1] = torch.linspace(-1, 1, 70)  # one varying channel beside the constant ones
    values = torch.full((2, 70, 64), -1.7)  # float16(-1.7) = -1.7002 (rounds down: the other side)
    values[:, 3] = torch.linspace(0, 5, 64)
    storage = KVStorage(kv_dtype, key_group_tokens=32, value_group_dims=16)
    parts = encode_layer(keys, values, storage)
    for name in ("keys.scale", "values.scale"):
        assert float(parts[name].float().min()) >= 0, f"{name}: min {float(parts[name].float().min())}"
    k, v = decode_layer(parts, storage, 64)
    const_k, const_v = keys[:, :, 2:], values[:, 4:]
    assert float((k[:, :, 2:] - const_k).abs().max()) < 1e-3, report("constant keys", const_k, k[:, :, 2:], 1e-3)
    assert float((v[:, 4:] - const_v).abs().max()) < 1e-3, report("constant values", const_v, v[:, 4:], 1e-3)


@pytest.mark.parametrize("dim", [64, 256, 96, 16])
def test__hadamard__orthonormal_so_the_rotation_is_undone_exactly(dim):
    h = hadamard(dim, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(dim, dtype=torch.float64), atol=1e-14)
    x = torch.randn(7, dim, dtype=torch.float64)
    assert float(((x @ h) @ h.T - x).abs().max()) < 1e-12
    h32 = hadamard(dim)  # what storage applies, in float32: undone to float32 rounding
    x32 = x.float()
    err = float(((x32 @ h32) @ h32.T - x32).abs().max() / x32.abs().max())
    assert err < 1e-6, f"relative round-trip error {err:.2g}"


@pytest.mark.parametrize("kv_dtype, bound", [("bfloat16", 2**-8), ("float16", 2**-11)])
def test__float_storage__relative_rounding_bound(kv_dtype, bound):
    engine = make_engine("llama", torch.float32)
    doc = Document(text_of_bytes(400), "0" * 64, "d.txt")
    ref = engine.ingest(doc, CFG)
    out = engine.ingest(doc, CFG, storage=KVStorage(kv_dtype))
    for a, b in zip(ref.layers, out.layers):
        normal = a.keys.abs() > 2**-14  # float16's subnormals round coarser, by design
        rel = ((a.keys - b.keys.float()).abs() / a.keys.abs())[normal].max()
        assert b.keys.dtype == getattr(torch, kv_dtype) and float(rel) <= bound, report("keys", a.keys, b.keys, bound)


@pytest.mark.parametrize("arch, kv_dtype", [("llama", "int8"), ("gemma3_text", "int4"), ("llama", "bfloat16")])
def test__quantized_cache__answers_alike_in_memory_and_from_the_file(arch, kv_dtype, tmp_path):
    engine = make_engine(arch, torch.float32)
    engine.stop_ids = set()
    doc = Document(text_of_bytes(600), "0" * 64, "d.txt")
    stored = engine.ingest(doc, CFG, storage=KVStorage(kv_dtype))
    path = save_cache(stored, tmp_path / "q.kv")
    loaded = load_cache(path)
    assert loaded.info.storage == stored.info.storage and loaded.info.storage.kv_dtype == kv_dtype
    qs = ["Which word?", "Where is the stone?"]
    a = [x.token_ids for x in answer(engine, stored, qs, 8, decode_config_for(stored))]
    b = [x.token_ids for x in answer(engine, loaded, qs, 8, decode_config_for(loaded))]
    assert a == b
    full = engine.ingest(doc, CFG, storage=KVStorage("float32"))
    assert path.stat().st_size < save_cache(full, tmp_path / "f.kv").stat().st_size


def test__int8_cache__agrees_with_the_float_cache_on_a_tiny_model():
    engine = make_engine("qwen2", torch.float32)
    engine.stop_ids = set()
    doc = Document(text_of_bytes(800, seed=4), "0" * 64, "d.txt")
    qs = ["Which word comes first?", "Name a river.", "What is green?"]
    ref = [x.token_ids for x in answer(engine, engine.ingest(doc, CFG), qs, 8, None)]
    q8 = engine.ingest(doc, CFG, storage=KVStorage("int8"))
    out = [x.token_ids for x in answer(engine, q8, qs, 8, None)]
    same = sum(x == y for a, b in zip(ref, out) for x, y in zip(a, b))
    assert same >= 0.9 * sum(len(a) for a in ref), (ref, out)


def _header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data


def test__damaged_scales__refused_like_any_other_damage(tmp_path):
    engine = make_engine("llama", torch.float32)
    stored = engine.ingest(Document(text_of_bytes(500), "0" * 64, "d.txt"), CFG, storage=KVStorage("int4"))
    path = save_cache(stored, tmp_path / "q.kv")
    n, header, data = _header(path)
    entry = header["segments.0.layers.1.keys.scale"]
    at = 8 + n + entry["data_offsets"][0] + 1
    flipped = bytearray(data)
    flipped[at] ^= 0x40
    (tmp_path / "flip.kv").write_bytes(bytes(flipped))
    with pytest.raises(CacheFormatError, match="KV digest mismatch"):
        load_cache(tmp_path / "flip.kv")
    # a consistent edit (every digest recomputed) that makes a scale negative is still refused
    from rocketkv_cli.store import v3

    raw = bytearray(data[8 + n :])
    start, stop = entry["data_offsets"]
    scales = torch.frombuffer(raw[start:stop], dtype=torch.float16).clone()
    scales[0] = -1.0
    raw[start:stop] = scales.view(torch.uint8).numpy().tobytes()
    meta = header["__metadata__"]
    segs = json.loads(meta["segments"])
    import hashlib

    segs[0]["kv_sha256"] = hashlib.sha256(bytes(raw[segs[0]["kv"][0] : segs[0]["kv"][1]])).hexdigest()
    meta["segments"] = json.dumps(segs)
    meta["payload_sha256"] = v3._root(segs)
    meta["metadata_sha256"] = metadata_digest(meta)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (tmp_path / "neg.kv").write_bytes(struct.pack("<Q", len(head)) + head + bytes(raw))
    with pytest.raises(CacheFormatError, match="disagree with the metadata"):
        load_cache(tmp_path / "neg.kv")


def test__segmented_file__only_the_segments_used_are_read_and_verified(tmp_path):
    engine = make_engine("llama", torch.float32)
    text = "".join(text_of_bytes(40 + i, i) + "\n" for i in range(40))
    stored = ingest_stream(engine, TextPieces(text, "book.txt"), CFG, segment_tokens=300, storage=KVStorage("int8"))
    path = save_cache(stored, tmp_path / "book.kv")
    n, header, data = _header(path)
    segs = json.loads(header["__metadata__"]["segments"])
    assert len(segs) >= 4
    damaged = bytearray(data)
    damaged[8 + n + segs[2]["kv"][0] + 3] ^= 0x01  # segment 2's KV only
    (tmp_path / "bad.kv").write_bytes(bytes(damaged))
    book = load_cache(tmp_path / "bad.kv")  # tokens of every segment verified, no KV read yet
    part = book.segments[1]
    (a,) = answer(engine, part, ["Which word?"], 4, decode_config_for(part))
    assert a.n_answer_tokens >= 1
    with pytest.raises(CacheFormatError, match="segment 2 KV digest mismatch"):
        book.segments[2].layers


def test__a_file_changed_after_loading__answers_from_what_was_verified(tmp_path):
    engine = make_engine("llama", torch.float32)
    engine.stop_ids = set()
    stored = engine.ingest(Document(text_of_bytes(500), "0" * 64, "d.txt"), CFG, storage=KVStorage("int8"))
    path = save_cache(stored, tmp_path / "q.kv")
    loaded = load_cache(path)  # read into private memory and verified
    before = next(answer(engine, loaded, ["Which word?"], 6, None)).token_ids
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = b"\0" * 4096  # overwritten in place
    with open(path, "r+b") as f:
        f.write(data)
    assert next(answer(engine, loaded, ["Which word?"], 6, None)).token_ids == before
    with pytest.raises(CacheFormatError):
        load_cache(path)


def test__segments_read_lazily_after_truncation__an_error_not_a_signal(tmp_path):
    engine = make_engine("llama", torch.float32)
    text = "".join(text_of_bytes(40 + i, i) + "\n" for i in range(30))
    stored = ingest_stream(engine, TextPieces(text, "book.txt"), CFG, segment_tokens=300)
    path = save_cache(stored, tmp_path / "book.kv")
    book = load_cache(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(CacheFormatError, match="shrank|truncated"):
        for seg in book.segments:
            seg.layers


def test__storage_validation_names_the_value():
    with pytest.raises(ValueError, match="kv_dtype"):
        KVStorage("int3")
    with pytest.raises(ValueError, match="key_group_tokens"):
        KVStorage("int8", key_group_tokens=0)
    with pytest.raises(ValueError, match="rotation"):
        KVStorage("float16", rotation="hadamard")
    with pytest.raises(ValueError, match="key_bits"):
        KVStorage("int4", key_bits="greedy")
    for name in ("int8+alloc", "int4+rope+alloc", "float16+alloc", "int4+alloc+alloc"):
        with pytest.raises(ValueError, match="alloc"):
            KVStorage.parse(name)
    with pytest.raises(ValueError, match="allocated key bits need int4"):
        KVStorage("int8", key_bits="allocated")
    # a uniform storage's record is what format v4 wrote (no key_bits); allocated bits add the field
    assert {**KVStorage().to_dict(), "key_bits": "uniform"} == dataclasses.asdict(KVStorage())
    assert KVStorage.parse("int4+alloc").to_dict() == dataclasses.asdict(KVStorage.parse("int4+alloc"))
    assert KVStorage.parse("int4+sinks0+alloc").name == "int4+alloc+sinks0"


def _redigest(tmp_path, path, name, **meta_changes):
    n, header, data = _header(path)
    header["__metadata__"].update(meta_changes)
    header["__metadata__"]["metadata_sha256"] = metadata_digest(header["__metadata__"])
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    out = tmp_path / name
    out.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n :])
    return out


@pytest.mark.parametrize("changes", [{"n_context_tokens": "²"}, {"n_context_tokens": str(1 << 40)},
                                     {"head_dim": str(1 << 20)}, {"n_kv_heads": "1٣"}],
                         ids=["superscript-digit", "huge-context", "huge-head-dim", "arabic-digit"])  # fmt: skip
def test__crafted_sizes__refused_before_anything_is_allocated(tmp_path, changes):
    engine = make_engine("llama", torch.float32)
    stored = engine.ingest(Document(text_of_bytes(300), "0" * 64, "d.txt"), CFG, storage=KVStorage("int8"))
    path = save_cache(stored, tmp_path / "q.kv")
    with pytest.raises(CacheFormatError, match="malformed metadata"):
        load_cache(_redigest(tmp_path, path, "crafted.kv", **changes))


def test__checkpoints_of_another_storage_are_not_reused(tmp_path):
    from rocketkv_cli.store.checkpoints import Checkpoints

    engine = make_engine("llama", torch.float32)
    text = "".join(text_of_bytes(40 + i, i) + "\n" for i in range(40))
    checkpoints = Checkpoints(tmp_path / "book.kv")
    ingest_stream(engine, TextPieces(text, "b"), CFG, 300, checkpoints, storage=KVStorage("int8"))
    events = []
    stored = ingest_stream(engine, TextPieces(text, "b"), CFG, 300, checkpoints, events.append,
                           storage=KVStorage("int4"))  # fmt: skip
    assert not any(e.resumed for e in events), "int8 checkpoints reused for an int4 ingest"
    assert {s.info.storage.kv_dtype for s in stored.segments} == {"int4"}
    again = []
    ingest_stream(engine, TextPieces(text, "b"), CFG, 300, checkpoints, again.append, storage=KVStorage("int4"))
    assert all(e.resumed for e in again)


def test__decode_config__page_larger_than_topk_refused():
    from rocketkv_cli.core.config import DecodeConfig

    with pytest.raises(ValueError, match="page_size must not exceed topk"):
        DecodeConfig(topk=4, page_size=8, n_score_dims=2)


def test__v4_file__int16_positions_float16_sinks_and_line_runs(tmp_path):
    """What v4 adds: positions in int16 (the segment is under 2^15 tokens), each head's first
    stored tokens as float16 sinks, token lines as runs — and the lines read back token for token."""
    engine = make_engine("llama", torch.float32)
    text = "".join(f"line {i} holds the river stone\n" for i in range(40))
    stored = engine.ingest(Document(text, "0" * 64, "d.txt"), CFG, storage=KVStorage("int4"))
    path = save_cache(stored, tmp_path / "q.kv")
    _, header, _ = _header(path)
    assert header["__metadata__"]["format_version"] == "4"
    assert header["segments.0.layers.0.positions"]["dtype"] == "I16"
    assert header["segments.0.layers.0.sinks.keys"]["dtype"] == "F16"
    assert header["segments.0.layers.0.sinks.keys"]["shape"][1] == 4
    runs = header["segments.0.token_line_runs"]["shape"]
    assert "segments.0.token_lines" not in header and runs[1] == 2 and 40 <= runs[0] <= 42  # 40 lines + framing
    loaded = load_cache(path)
    assert torch.equal(loaded.token_lines, stored.token_lines.to(torch.int32))
    assert loaded.info.storage.sink_tokens == 4
    exact = engine.ingest(Document(text, "0" * 64, "d.txt"), CFG, storage=KVStorage("float32"))
    for a, b, f in zip(stored.layers, loaded.layers, exact.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
        sink, ref = b.keys[0, :, :4], f.keys[0, :, :4]  # the sinks: the float keys to float16 rounding
        assert bool(((sink - ref).abs() <= ref.abs() * 2**-11 + 1e-7).all()), report("sink keys", ref, sink, 2**-11)


def test__position_dtype__int16_exactly_while_every_position_fits():
    from rocketkv_cli.store.v3 import position_dtype

    assert position_dtype(torch.tensor([[0, 32767]])) == torch.int16
    assert position_dtype(torch.tensor([[0, 32768]])) == torch.int32


def test__v3_segment_rewritten_as_v4__keeps_its_own_storage(tmp_path):
    """A v3 file's segments copied into a v4 file (what a resave does) stay as v3 stored them:
    no sinks, int32 positions; lines become runs; the answers are unchanged."""
    from pathlib import Path

    src = Path(__file__).parent / "data" / "v3-llama.kv"
    old = load_cache(src)
    path = save_cache(old, tmp_path / "copy.kv")
    _, header, _ = _header(path)
    assert header["__metadata__"]["format_version"] == "4" and "segments.0.token_line_runs" in header
    assert header["segments.0.layers.0.positions"]["dtype"] == "I32"
    new = load_cache(path)
    assert new.info.storage == old.info.storage and new.info.storage.sink_tokens == 0
    for a, b in zip(old.segments, new.segments):
        assert torch.equal(a.token_lines, b.token_lines)
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.positions, lb.positions)


@pytest.mark.parametrize("rows, n", [([[1, 1]], 5), ([[0, 1], [0, 2]], 5), ([[0, 1], [3, 2], [2, 3]], 5),
                                     ([[0, 1], [5, 2]], 5), ([[0, -1]], 5), ([], 5)])  # fmt: skip
def test__line_runs__malformed_rows_refused(rows, n):
    from rocketkv_cli.store.v3 import lines_from_runs

    assert lines_from_runs(torch.tensor(rows, dtype=torch.int32).reshape(-1, 2), n) is None


def test__line_runs__round_trip():
    from rocketkv_cli.store.v3 import line_runs, lines_from_runs

    lines = torch.tensor([0, 0, 1, 1, 1, 2, 4, 4, 0], dtype=torch.int32)
    runs = line_runs(lines)
    assert runs.tolist() == [[0, 0], [2, 1], [5, 2], [6, 4], [8, 0]]
    assert torch.equal(lines_from_runs(runs, 9), lines)


def test__v3_storage_without_sinks__reads_as_no_sinks(tmp_path):
    """A v3 file's kv_storage has no sink_tokens: it quantized every token, so it reads as 0; a
    v4 one without it, or a v3 one with v4's fields, is refused (never read with today's default)."""
    from rocketkv_cli.store.format import metadata_info

    engine = make_engine("llama", torch.float32)
    stored = engine.ingest(Document(text_of_bytes(300), "0" * 64, "d.txt"), CFG, storage=KVStorage("int8"))
    path = save_cache(stored, tmp_path / "q.kv")
    _, header, _ = _header(path)
    meta = dict(header["__metadata__"])
    raw = json.loads(meta["kv_storage"])
    del raw["sink_tokens"]
    meta.update(kv_storage=json.dumps(raw), format_version="3")
    assert metadata_info(meta, "q.kv", "").storage.sink_tokens == 0
    for version, storage in (("4", raw), ("3", {**raw, "sink_tokens": 0}), ("3", {**raw, "rotation": "rope"})):
        meta.update(kv_storage=json.dumps(storage), format_version=version)  # v4 always writes it; v3 never did
        with pytest.raises(CacheFormatError, match="malformed metadata"):
            metadata_info(meta, "q.kv", "")


def test__storage_default__the_measured_choice_per_preset_and_an_explicit_one_wins():
    from rocketkv_cli.batch.tasks import BatchSettings
    from rocketkv_cli.core.config import default_kv_dtype

    # docs/storage.md: int4 meets the agreement bar on SmolLM2 (int4+alloc too, a lower KL, but it opens
    # 1.2x slower), not on Gemma; unmeasured models get int8
    assert [default_kv_dtype(m) for m in ("smollm2-135m", "gemma-3-270m", "/models/other")] == ["int4", "int8", "int8"]
    assert BatchSettings(model="smollm2-135m").storage == KVStorage("int4")
    assert BatchSettings(model="gemma-3-270m").storage == KVStorage("int8")
    assert BatchSettings(model="smollm2-135m", storage=KVStorage("float32")).storage == KVStorage("float32")


NAMED = [
    ("int4", KVStorage("int4")),
    ("int4+sinks0", KVStorage("int4", sink_tokens=0)),
    ("int8+hadamard+sinks2", KVStorage("int8", rotation="hadamard", sink_tokens=2)),
    ("int4+rope", KVStorage("int4", rotation="rope")),
    ("int4+alloc", KVStorage("int4", key_bits="allocated")),
    ("float16", KVStorage("float16")),
]


@pytest.mark.parametrize("name, expected", NAMED)
def test__storage_names__parse_and_print_back(name, expected):
    assert KVStorage.parse(name) == expected and expected.name == name


@pytest.mark.parametrize(
    "name, message",
    [
        ("int4+sinks", "unknown storage option 'sinks'"),
        ("int4+fast", "unknown storage option 'fast'"),
        ("int4+sinks-1", "unknown storage option 'sinks-1'"),
        ("int4+hadamard+rope", "names two key bases"),
        ("int4+sinks2+sinks0", "names the sink count twice"),
        ("float16+sinks2", "sinksN only applies to int8 and int4"),
        ("int3", "kv_dtype must be one of"),
        ("int8+sinks99999999", "sink_tokens must be an integer in [0, 2^20], got 99999999"),  # was "unknown option"
        ("int8+sinks1048577", "sink_tokens must be an integer in [0, 2^20], got 1048577"),
    ],
)
def test__storage_names__unknown_parts_refused(name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        KVStorage.parse(name)


@pytest.mark.parametrize("name, sinks", [("v4-llama.kv", (4, ["float16"])), ("v3-llama.kv", (0, []))])
def test__describe__storage_as_read_with_the_sinks_dtype(name, sinks):
    """inspect shows the storage as the reader took it (v3 has no sinks) and what the sinks are stored in."""
    from rocketkv_cli.store.describe import describe

    storage = describe(Path(__file__).parent / "data" / name)["kv_storage"]
    assert (storage["sink_tokens"], storage["sink_dtypes"]) == sinks


def test__rope_rotation__undone_exactly_and_keys_rotated_back_to_before_rope():
    """`rope_rotate` is the inverse of what RoPE did (transformers' rotate_half pairing): keys
    rotated by a tiny model's own rotary embedding come back to the keys before it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from rocketkv_cli.core.quant import rope_rotate
    from rocketkv_cli.model.hf import rope_frequencies

    engine = make_engine("llama", torch.float64)
    freqs = rope_frequencies(engine.model, engine.shape.head_dim)
    assert all(f is not None for f in freqs)
    raw = torch.randn(1, engine.shape.n_kv_heads, 9, engine.shape.head_dim, dtype=torch.float64)
    pos = torch.tensor([[0, 3, 4, 10, 11, 50, 51, 52, 99]])
    cos, sin = engine.model.model.rotary_emb(raw, pos)
    _, rotated = apply_rotary_pos_emb(raw, raw, cos.to(raw.dtype), sin.to(raw.dtype))
    back = rope_rotate(rotated[0], pos.expand(engine.shape.n_kv_heads, -1), freqs[0].double(), inverse=True)
    assert float((back - raw[0]).abs().max()) < 1e-5, report("un-rotated", raw[0], back, 1e-5)
    again = rope_rotate(back, pos.expand(engine.shape.n_kv_heads, -1), freqs[0].double(), inverse=False)
    assert float((again - rotated[0]).abs().max()) < 1e-12


def test__gemma_layers__each_kind_gets_its_own_rope_frequencies():
    from rocketkv_cli.model.hf import rope_frequencies

    engine = make_engine("gemma3_text", torch.float32)
    freqs = rope_frequencies(engine.model, engine.shape.head_dim)
    windows = [s.sliding_window for s in engine.shape.layers]
    local = {tuple(f.tolist()) for f, w in zip(freqs, windows) if w is not None}
    full = {tuple(f.tolist()) for f, w in zip(freqs, windows) if w is None}
    assert len(local) == len(full) == 1 and local != full  # Gemma 3: another RoPE base for global layers


def test__pre_rope_basis__lowers_key_error_on_rotated_keys():
    """Keys with a per-channel mean, rotated by RoPE at scattered positions (what stored keys
    look like): quantized in the pre-RoPE basis they keep their narrow per-channel range; in the
    stored basis each pair swings by its magnitude."""
    from rocketkv_cli.core.quant import rope_rotate

    g = torch.Generator().manual_seed(1)
    d, s = 64, 256
    raw = torch.randn(1, s, d, generator=g) * 0.3 + torch.linspace(2, 6, d)  # consistent per-channel offsets
    pos = torch.sort(torch.randperm(8000, generator=g)[:s]).values.unsqueeze(0)
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
    keys = rope_rotate(raw, pos, freqs, inverse=False)
    values = torch.randn(1, s, d, generator=g)
    assert KVStorage("int4").rotation == "none" and KVStorage.parse("int4+rope").rotation == "rope"
    errors = {}
    for rotation in ("rope", "none"):
        storage = KVStorage("int4", rotation=rotation)
        k, _ = decode_layer(encode_layer(keys, values, storage, pos, freqs), storage, d,
                            pos)  # fmt: skip
        errors[rotation] = float((k - keys).pow(2).mean())
    assert errors["rope"] < errors["none"] / 4, errors


def test__pre_rope_storage_without_frequencies__refused_before_the_prefill():
    """A model whose rotary embedding rocketkv cannot read gets a one-line refusal, not a file
    that claims pre-RoPE keys that were never rotated."""
    from rocketkv_cli.errors import InputError

    engine = make_engine("llama", torch.float32)
    assert any(f is not None for f in engine.rope_freqs)  # the tiny model's own frequencies are readable
    ingest_stream(engine, TextPieces(text_of_bytes(300), "ok.txt"), CFG, storage=KVStorage.parse("int4+rope"))
    engine.rope_freqs = [None] * len(engine.rope_freqs)  # as for a model with partial or unknown RoPE
    with pytest.raises(InputError, match=r"int4\+rope: .* has no RoPE frequencies") as err:
        ingest_stream(engine, TextPieces(text_of_bytes(300), "doc.txt"), CFG, storage=KVStorage.parse("int4+rope"))
    assert "without +rope" in str(err.value)


@pytest.mark.parametrize("n_context, dtype", [(32768, torch.int16), (32769, torch.int32)])
def test__positions_at_the_int16_boundary__written_and_read_back_exactly(tmp_path, n_context, dtype):
    """A cache whose last position is 32767 stores int16 positions and one at 32768 int32; both
    read back as the same int64 positions (no wrap-around at the boundary)."""
    from safetensors import safe_open

    engine = make_engine("llama", torch.float32)
    small = engine.ingest(Document(text_of_bytes(400), "0" * 64, "doc.txt"), CFG, storage=KVStorage("int8"))
    shift = n_context - small.n_context_tokens  # move every kept token so the last sits at n_context - 1
    layers = tuple(dataclasses.replace(layer, positions=layer.positions + shift) for layer in small.layers)
    info = small.info.with_(n_context_tokens=n_context)
    from rocketkv_cli.core.cache import CompressedKVCache

    cache = CompressedKVCache(info, layers)
    path = save_cache(cache, tmp_path / "edge.kv")
    with safe_open(str(path), "pt") as f:
        assert f.get_tensor("segments.0.layers.0.positions").dtype == dtype
    loaded = load_cache(path)
    for a, b in zip(loaded.layers, layers):
        assert torch.equal(a.positions, b.positions)
        assert int(a.positions.max()) == n_context - 1


@pytest.mark.parametrize("hkv, s, d, g, gd", [(3, 1001, 64, 32, 32), (2, 64, 48, 16, 20), (1, 7, 10, 4, 3),
                                               (2, 5, 8, 8, 8)])  # fmt: skip
def test__dequantize__broadcast_groups_equal_the_gathered_formula_bit_for_bit(hkv, s, d, g, gd):
    """Keys (groups of g tokens per channel) and values (groups of gd channels per token), the last
    group short where the size is not a multiple: q · scale + lo with each element's own group's
    scale and minimum gathered into full-size copies (the formula the file format defines), in
    float32, bit for bit; a wrong number of groups is refused."""
    from rocketkv_cli.core.quant import _dequantize

    g_ = torch.Generator().manual_seed(s + d)
    q = torch.randint(0, 16, (hkv, s, d), dtype=torch.uint8, generator=g_)
    lo_k, sc_k = torch.randn(hkv, -(-s // g), d, generator=g_).bfloat16(), torch.rand(hkv, -(-s // g), d).half()
    lo_v, sc_v = torch.randn(hkv, s, -(-d // gd), generator=g_).bfloat16(), torch.rand(hkv, s, -(-d // gd)).bfloat16()
    tok, ch = torch.arange(s) // g, torch.arange(d) // gd
    want_k = q.float() * sc_k[:, tok].float() + lo_k[:, tok].float()
    want_v = q.float() * sc_v[..., ch].float() + lo_v[..., ch].float()
    assert torch.equal(_dequantize(q, sc_k, lo_k, dim=1, group=g), want_k)
    assert torch.equal(_dequantize(q, sc_v, lo_v, dim=2, group=gd), want_v)
    with pytest.raises(ValueError, match="quantization groups"):
        _dequantize(q, sc_k[:, :-1], lo_k[:, :-1], dim=1, group=g)


def test__check_target__system_paths_refused_but_a_file_on_dev_shm_is_a_file(tmp_path):
    """`-o /dev/stdout --force` (as root) replaced the link with the cache; refusing all of /dev
    then refused a tmpfs file under /dev/shm too."""
    from rocketkv_cli.errors import OutputError
    from rocketkv_cli.store.atomic import check_target

    for path in ("/dev/stdout", "/dev/null", "/proc/self/fd/1", "/sys/kernel/x.kv"):
        with pytest.raises(OutputError, match="is a system path"):
            check_target(Path(path), force=True)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        assert check_target(shm / "rocketkv-test-x.kv", force=False) == shm
